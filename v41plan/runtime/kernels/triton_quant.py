"""Triton pieces of the published quantizers: E8M0 scales, E4M3 and E2M1 codes, bit for bit.

The device functions here reproduce ``v41plan.model.quant`` exactly, with integer arithmetic on
the float32 bit pattern (no division, no ``log2``): ``fp8_act_scale`` is ``pow2ceil(max(amax,
1e-4) / 448)``, ``round_e4m3`` the round-to-nearest-even E4M3 grid saturating at 448, and the
decoders turn stored bytes back into float32 values. The kernels that use them pass codes as
uint8 bytes (E4M3 bits, packed E2M1 pairs with the even lane in the low nibble, E8M0 scale
bytes), so one kernel source serves the GPU and Triton's CPU interpreter alike.

``act_quant_fp8`` is the activation quantizer (``act_quant``: E4M3 with one power-of-two scale
per 32 lanes) as one kernel: codes and E8M0 scale bytes for a W8A8 or W4A8 GEMM;
``act_values_fp8`` its values (codes times scales) for a GEMM on exact bf16 operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import pdl_enter, pdl_launch

QUANT_BLOCK = 32
"""Lanes of one activation scale block (and of one weight scale block along K)."""

# float32 rounding constant: (v + 1.5 * 2**23) - 1.5 * 2**23 rounds |v| < 2**22 to the nearest
# integer, ties to even, in the hardware's own rounding mode
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def e8m0_value(field):
    """E8M0 byte (as an integer) -> the float32 power of two it encodes (0 for byte 0)."""
    return (field.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_act_scale(amax):
    """``pow2ceil(max(amax, 1e-4) / 448)`` exactly: (scale, 1/scale, E8M0 field).

    ``a / 448 = (m / 1.75) * 2**(e - 8)`` for ``a = m * 2**e``: a power of two up to ``m = 1.75``
    (fraction bits ``0x600000``), the next one above it.
    """
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    field = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = (field << 23).to(tl.float32, bitcast=True)
    inv = ((254 - field) << 23).to(tl.float32, bitcast=True)
    return scale, inv, field


@triton.jit
def round_e4m3(y):
    """Float32 ``y`` rounded to the E4M3 (fn) grid: nearest, ties to even, saturating at 448;
    the sign is kept (a negative value rounding to zero is -0, as a cast gives)."""
    a = tl.minimum(tl.abs(y), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # the subnormal grid below 2**-6 has the step 2**-9
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
    r = tl.minimum((((a * inv) + _RNE_MAGIC) - _RNE_MAGIC) * step, 448.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """Float32 ``x`` rounded to the nearest bf16 value, ties to even, returned as float32.

    By integer arithmetic: the interpreter's own float32 -> bf16 conversion truncates, so a
    kernel rounds with this first and the conversion after it is exact everywhere.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode_e4m3(q):
    """Float32 values already on the E4M3 grid -> their E4M3 bytes (int32 0..255)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(q)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((((ab >> 23) & 0xFF) - 120) << 3) | ((ab >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6
    return sign | tl.where(a < 0.015625, sub, normal)


@triton.jit
def decode_e4m3(b):
    """E4M3 bytes (integers 0..255) -> float32 values."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    sxm,
    sqm,
    ssm,
    BM: tl.constexpr,
    BKB: tl.constexpr,
    PDL: tl.constexpr = False,
    VALUES: tl.constexpr = False,
):
    """One program: ``BM`` rows x ``BKB`` 32-lane blocks of ``x`` -> E4M3 bytes + E8M0 bytes;
    ``VALUES``: the quantized values themselves (codes times scales, exact in bf16) into ``q``
    in its dtype, no scales."""
    pdl_enter(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1) * BKB + tl.arange(0, BKB)
    lane = tl.arange(0, 32)
    k = kb[None, :, None] * 32 + lane[None, None, :]
    mask = (rm[:, None, None] < M) & (k < K)
    x = tl.load(x_ptr + rm[:, None, None] * sxm + k, mask=mask, other=0.0).to(tl.float32)
    scale, inv, field = fp8_act_scale(tl.max(tl.abs(x), axis=2))
    q = round_e4m3(x * inv[:, :, None])
    if VALUES:
        v = q * scale[:, :, None]
        tl.store(q_ptr + rm[:, None, None] * sqm + k, v.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptr + rm[:, None, None] * sqm + k, encode_e4m3(q).to(tl.uint8), mask=mask)
        smask = (rm[:, None] < M) & (kb[None, :] < K // 32)
        tl.store(s_ptr + rm[:, None] * ssm + kb[None, :], field.to(tl.uint8), mask=smask)


@triton.jit
def _act_dequant_kernel(q_ptr, s_ptr, out_ptr, M, K, sqm, ssm, som, BM: tl.constexpr,
                        BKB: tl.constexpr):  # fmt: skip
    """One program: ``BM`` rows x ``BKB`` 32-lane blocks of E4M3 bytes and their E8M0 bytes ->
    the values (exact in bf16) in ``out``'s dtype."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1) * BKB + tl.arange(0, BKB)
    k = kb[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rm[:, None, None] < M) & (k < K)
    b = tl.load(q_ptr + rm[:, None, None] * sqm + k, mask=mask, other=0)
    smask = (rm[:, None] < M) & (kb[None, :] < K // 32)
    field = tl.load(s_ptr + rm[:, None] * ssm + kb[None, :], mask=smask, other=127)
    v = decode_e4m3(b) * e8m0_value(field)[:, :, None]
    tl.store(out_ptr + rm[:, None, None] * som + k, v.to(out_ptr.dtype.element_ty), mask=mask)


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 activation quantizer of a ``[M, K]`` tensor (``K % 32 == 0``), one kernel.

    Returns (codes ``float8_e4m3fn [M, K]``, scales ``float8_e8m0fnu [M, K/32]``) with
    ``codes * scale`` equal to ``quant.fake_fp8(x, 32)`` bit for bit.
    """
    if x.dim() != 2 or x.shape[1] % QUANT_BLOCK:
        raise ValueError(f"act_quant_fp8 takes [M, K] with K % 32 == 0, got {list(x.shape)}")
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.uint8, device=x.device)
    s = torch.empty((M, K // QUANT_BLOCK), dtype=torch.uint8, device=x.device)
    BM, BKB = 16, 4
    grid = (triton.cdiv(M, BM), triton.cdiv(K // QUANT_BLOCK, BKB))
    if M:
        _act_quant_kernel[grid](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), BM, BKB,
            **pdl_launch(x.device, M),
        )  # fmt: skip
    return q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def act_values_fp8(
    x: torch.Tensor, x_scales: torch.Tensor | None = None, dtype=torch.bfloat16
) -> torch.Tensor:
    """The FP8 activation quantizer's values ``quant.fake_fp8(x, 32)`` as ``dtype`` (bf16 or
    float32: exact either way, a 4-bit significand times a power of two), one kernel: of a
    ``[M, K]`` tensor (``K % 32 == 0``), or, with ``x_scales`` (E8M0 ``[M, K/32]``), of its
    E4M3 codes ``x``."""
    if x.dim() != 2 or x.shape[1] % QUANT_BLOCK:
        raise ValueError(f"act_values_fp8 takes [M, K] with K % 32 == 0, got {list(x.shape)}")
    x = x.contiguous()
    M, K = x.shape
    out = torch.empty((M, K), dtype=dtype, device=x.device)
    BM, BKB = 16, 4
    grid = (triton.cdiv(M, BM), triton.cdiv(K // QUANT_BLOCK, BKB))
    if not M:
        return out
    if x_scales is None:
        _act_quant_kernel[grid](
            x, out, out, M, K, x.stride(0), out.stride(0), 0, BM, BKB, VALUES=True
        )  # fmt: skip
    else:
        q, s = x.view(torch.uint8), x_scales.contiguous().view(torch.uint8)
        _act_dequant_kernel[grid](
            q, s, out, M, K, q.stride(0), s.stride(0), out.stride(0), BM, BKB
        )  # fmt: skip
    return out
