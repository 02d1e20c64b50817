"""W8A8 linear in Triton: the published FP8 activation quantizer (by its own launch before the
GEMM, ``PREQUANT_ROWS``, or in the GEMM's prologue: the same codes), E4M3 weights with E8M0
32 x 32 block scales, float32 accumulation; prefill tiles on sm_90 by TMA (``GemmConfig.tma``).

``y[m, n] = sum_kb dot(xq[m, kb], wq[n, kb]) * sx[m, kb] * sw[n // 32, kb]``, ``kb`` the
32-lane blocks along K. Every product ``xq * sx * wq * sw`` is exact in float32 (two 4-bit
significands times powers of two), so the result is ``F.linear(fake_fp8(x, 32),
dequant_fp8_weight(w, scale))`` up to the order of the float32 additions.

**Bound** (checked by ``tests/runtime/test_triton_gemm.py`` on the interpreter and by
``tests/gpu/test_resident_gpu.py`` on the device): with ``P[m, n] = sum_k |x̂[m, k] ŵ[n, k]|``
(the dequantized operands) and ``y*`` the exact sum, ``|y - y*| <= K * u * P + |y*| * u_out``,
``u = 2**-24`` for float32 accumulation (``dot="fp32"`` and ``"bf16"``) and ``u_out`` the output
dtype's unit roundoff (0 for float32 output; ``2**-8`` for bf16). The ``"fp8"`` mode adds the
tensor core's own FP8 accumulation inside each 32-lane block, which retains fewer bits (the GPU
test measures it and holds it to ``u = 2**-13`` within a block).

Dot modes (``dot=``): ``"fp32"`` float32 operands (what Triton's CPU interpreter runs, and an
exact reference on the GPU), ``"bf16"`` the dequantized operands in bf16 (exact: a 4-bit
significand times a power of two) on bf16 tensor cores, ``"fp8"`` the E4M3 codes on FP8 tensor
cores with the scales applied to each 32-lane block's partial product; and ``"mm"`` (prefill
rows, ``MM_ROWS``): the dequantized operands in bf16 through the BLAS's GEMM (``torch.mm``,
float32 sums: the bf16 mode's bound), the weight's values in a transient buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from v41plan.runtime.kernels.triton_common import arrival_counters, pdl_enter, pdl_launch
from v41plan.runtime.kernels.triton_quant import (
    QUANT_BLOCK,
    act_quant_fp8,
    act_values_fp8,
    decode_e4m3,
    e8m0_value,
    encode_e4m3,
    fp8_act_scale,
    round_bf16,
    round_e4m3,
)

DOT_MODES = {"fp32": 0, "bf16": 1, "fp8": 2}
"""Dot-operand modes of the quantized GEMMs (see the module docstring)."""


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch parameters of one quantized GEMM launch."""

    block_m: int
    """Rows of ``x`` per program."""
    block_n: int
    """Output lanes per program."""
    block_k: int
    """K lanes per loop step (a multiple of 32; the ``"fp8"`` mode walks its 32-lane blocks
    unrolled, so any multiple gives the same sums)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop."""
    group_m: int = 8
    """Row tiles walked together, so that a weight tile is read from L2 while it is hot."""
    split_k: int = 1
    """Programs per output tile, each over its own ``K / split_k`` lanes (a whole number of
    ``block_k`` steps); a second launch sums their float32 partials in split order (no atomics,
    the same bits every run) and applies the epilogue. For few rows and a long K: a decode
    launch's output tiles alone are too few programs to stream the weight."""
    tma: bool = False
    """Read the operand tiles by tensor-memory (TMA) descriptors (``_w8a8_tma_kernel``): no
    per-element address or mask arithmetic, tiles land in shared memory ready for the tensor
    cores. Pre-quantized, ungrouped input, ``block_n`` a multiple of 32, any ``split_k`` (the
    pointer kernel's splits and their end); the ``"fp8"`` or ``"fp32"`` mode at ``block_k`` 32
    (the same sums as without it), or the ``"bf16"`` mode at any multiple of 32."""


SPLIT_MIN_LANES = 512
"""K lanes a split covers at least (its K loop's setup is then a small share of it)."""


def _programs_wanted() -> int:
    """Programs a weight-streaming launch should have: two per streaming multiprocessor."""
    if not torch.cuda.is_available():
        return 264
    return 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def split_k_for(N: int, K: int, cfg: GemmConfig) -> int:
    """K splits of a decode launch (up to 64 rows) of ``cfg``'s tiles: enough programs to stream
    the weight with one row block (see ``GemmConfig.split_k``), each split over at least
    ``SPLIT_MIN_LANES`` lanes. It does not depend on the rows: a row's sums are the same at
    every decode batch size."""
    want = triton.cdiv(_programs_wanted(), triton.cdiv(N, cfg.block_n))
    return max(1, min(want, K // SPLIT_MIN_LANES))


def default_config(M: int, N: int, K: int, dot: str) -> GemmConfig:
    """A tile shape for an ``[M, K] x [N, K]`` launch: narrow rows for decode, 128-wide tiles
    for prefill (the benchmark sweeps alternatives)."""
    if dot == "fp32" and not torch.cuda.is_available():
        # Triton's interpreter: its cost is per operation, not per element, so few wide tiles
        bn, bk = min(128, triton.next_power_of_2(N)), min(128, triton.next_power_of_2(K))
        return GemmConfig(16, max(bn, 16), bk, num_warps=1, num_stages=1)
    bk = 32 if dot == "fp8" else 64
    # decode: the K loop's latency bounds these launches, not their bytes; narrow tiles give
    # narrow weights more programs (reports/gpu/sweep_decode_tiles.json, H200). Up to 16 rows
    # of a wide weight 64-lane K steps (one row on an H100: wq_b 19.9 -> 18.7, wo_b 26.4 ->
    # 25.9, shared.w2 10.8 -> 9.6 us, reports/gpu/bench_gemm_moe_occupancy_h100_30f483e.json;
    # the fp8 mode's sums whatever the step). Narrow weights keep 16-row tiles at 17-64 rows:
    # 64-row tiles are faster there (wq_a 23.2 -> 16.5 us at 64 rows) but run on the FP8
    # wgmma, whose sums inside a 32-lane block keep fewer bits than the f16 mma.sync the 16-row
    # tiles' FP8 codes run on (tiny's shared expert at 21 rows 3e-8 -> 2.7e-4 from the float32
    # reference: scripts/diag_moe_gpu.py); the bf16 mode's exact operands and float32 sums take
    # 64-row tiles at 17-64 rows whatever the weight's width (DECODE_BF16_ROWS)
    fp8 = dot == "fp8"
    if M <= 64:
        if N <= 2048 and (M <= 16 or dot != "bf16"):
            cfg = GemmConfig(16, 32, 64 if fp8 else 128, num_warps=4, num_stages=4)
        elif M <= 16:
            cfg = GemmConfig(16, 64, 64 if fp8 else 128, num_warps=4, num_stages=4)
        else:
            cfg = GemmConfig(64, 64, bk, num_warps=4, num_stages=4)
        return dataclasses.replace(cfg, split_k=split_k_for(N, K, cfg))
    # prefill (reports/gpu/bench_gemm_moe_sweep*.json, H200): fp8, 64-lane K steps beat 32
    # (wq_b 2.84 -> 2.48 ms, wo_b 2.92 -> 2.67 at 8K rows); bf16, 32-lane steps beat 64 and
    # 128 (2.35 against 2.91 and 2.93 ms); 256-wide tiles spill
    if dot == "fp8":
        return GemmConfig(128, 128, 64, num_warps=8, num_stages=4)
    return GemmConfig(128, 128, 32 if dot == "bf16" else bk, num_warps=8, num_stages=3)


@triton.jit
def load_a_tile(
    x_ptr,
    xs_ptr,
    rm,
    rk,
    k0,
    mmask,
    kmask,
    sxm,
    sxsm,
    QUANT_X: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """One ``[BM, BK]`` activation tile: (operand, per-row scale ``[BM]``).

    ``"fp8"`` (BK = 32): the E4M3 operand and its 32-lane block's scale. Otherwise the
    dequantized float32 values (the scale already applied) and a dummy scale. ``QUANT_X``
    quantizes float activations here (``fake_fp8``'s rounding, bit for bit); else ``x_ptr``
    holds E4M3 bytes and ``xs_ptr`` their E8M0 bytes ``[M, K/32]``.
    """
    amask = mmask[:, None] & kmask[None, :]
    if QUANT_X:
        xf = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=amask, other=0.0)
        x3 = tl.reshape(xf.to(tl.float32), [BM, BK // 32, 32])
        scale, inv, _field = fp8_act_scale(tl.max(tl.abs(x3), axis=2))
        q3 = round_e4m3(x3 * inv[:, :, None])
        if DOT == 2:
            a = tl.reshape(q3, [BM, BK]).to(tl.float8e4nv)
            sx = tl.reshape(scale, [BM])
        else:
            a = tl.reshape(q3 * scale[:, :, None], [BM, BK])
            sx = tl.zeros([BM], dtype=tl.float32)
    else:
        bits = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=amask, other=0)
        if DOT == 2:
            a = bits.to(tl.float8e4nv, bitcast=True)
            # a block past K (a partial last K tile) has no scale: read none (a neighbour's
            # byte, or 0xFF = NaN past the end, would poison the zero codes' product)
            live = tl.sum(kmask.to(tl.int32), axis=0) > 0
            sx = e8m0_value(tl.load(xs_ptr + rm * sxsm + k0 // 32, mask=mmask & live, other=0))
        elif DOT == 1:
            # the tile's BK / 32 scales once, the codes by the E4M3 conversion, the product
            # in bf16 (exact: a 4-bit significand times a power of two)
            nb: tl.constexpr = BK // 32
            live = tl.max(tl.reshape(kmask.to(tl.int32), [nb, 32]), axis=1) > 0
            kbi = k0 // 32 + tl.arange(0, nb)
            fld = tl.load(
                xs_ptr + rm[:, None] * sxsm + kbi[None, :],
                mask=mmask[:, None] & live[None, :],
                other=0,
            )
            v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            a = tl.reshape(tl.reshape(v, [BM, nb, 32]) * e8m0_value(fld)[:, :, None], [BM, BK])
            a = a.to(tl.bfloat16)
            sx = tl.zeros([BM], dtype=tl.float32)
        else:
            fld = tl.load(xs_ptr + rm[:, None] * sxsm + rk[None, :] // 32, mask=amask, other=0)
            a = decode_e4m3(bits) * e8m0_value(fld)
            sx = tl.zeros([BM], dtype=tl.float32)
    return a, sx


@triton.jit
def qdot(acc, a, sa, b, sb, DOT: tl.constexpr):
    """``acc + a @ b^T``: per-32-block scales applied to the partial product in the ``"fp8"``
    mode, bf16 or exact float32 operands otherwise."""
    if DOT == 2:
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
    elif DOT == 1:
        acc += tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
    else:
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    return acc


@triton.jit
def fp8_weight_tile_bf16(wb, ws_ptr, rn, kb, nmask, kmask, swsn, BN: tl.constexpr,
                         BK: tl.constexpr):  # fmt: skip
    """The E4M3 weight codes ``wb [BN, BK]`` (rows ``rn``, a multiple of 32 from a 32-row
    boundary; lanes from ``kb``) as bf16 values: the tile's ``(BN / 32) x (BK / 32)`` block
    scales loaded once, the codes by the E4M3 conversion, the product in float32 then bf16
    (exact: a 4-bit significand times a power of two)."""
    mb: tl.constexpr = BN // 32
    nb: tl.constexpr = BK // 32
    rlive = tl.max(tl.reshape(nmask.to(tl.int32), [mb, 32]), axis=1) > 0
    klive = tl.max(tl.reshape(kmask.to(tl.int32), [nb, 32]), axis=1) > 0
    rb = tl.min(rn, axis=0) // 32 + tl.arange(0, mb)
    kbi = kb // 32 + tl.arange(0, nb)
    fmask = rlive[:, None] & klive[None, :]
    fld = tl.load(ws_ptr + rb[:, None] * swsn + kbi[None, :], mask=fmask, other=0)
    v = tl.reshape(wb.to(tl.float8e4nv, bitcast=True).to(tl.float32), [mb, 32, nb, 32])
    return tl.reshape(v * e8m0_value(fld)[:, None, :, None], [BN, BK]).to(tl.bfloat16)


@triton.jit
def _fp8_dequant_kernel(w_ptr, ws_ptr, out_ptr, N, swn, swsn, K: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):  # fmt: skip
    """``fp8_weight_tile_bf16`` of the tile (``program_id(0)``, ``program_id(1)``) stored in
    ``out``'s dtype (bf16 or float32: exact either way)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1) * BK
    rk = kb + tl.arange(0, BK)
    nmask, kmask = rn < N, rk < K
    m = nmask[:, None] & kmask[None, :]
    wb = tl.load(w_ptr + rn[:, None] * swn + rk[None, :], mask=m, other=0)
    b = fp8_weight_tile_bf16(wb, ws_ptr, rn, kb, nmask, kmask, swsn, BN, BK)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], b.to(out_ptr.dtype.element_ty), mask=m)


def dequant_fp8(
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    dtype=torch.bfloat16,
    out: torch.Tensor | None = None,
):
    """An FP8 weight's values ``[N, K]`` in ``dtype`` (bf16 or float32; exact), one launch:
    ``model.quant.dequant_fp8_weight``'s values; into ``out`` (contiguous ``[N, K]``) if given."""
    N, K = w_codes.shape
    w, ws = _bytes(w_codes), _bytes(w_scales)
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=w.device)
    elif out.shape != (N, K) or not out.is_contiguous():
        raise ValueError(f"dequant_fp8: out {list(out.shape)} is a contiguous {[N, K]}")
    bn, bk = 64, 128
    _fp8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        w, ws, out, N, w.stride(0), ws.stride(0), K=K, BN=bn, BK=bk
    )
    return out


@triton.jit
def w8a8_step(acc, a, sx, w_ptr, ws_ptr, rn, rk, kb, nmask, kmask, swn, swsn,
              DOT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """``acc`` plus one K step of ``a @ W^T`` over the ``BK`` lanes ``rk`` and ``BN`` output
    rows ``rn`` (see ``_w8a8_kernel``)."""
    bmask = nmask[:, None] & kmask[None, :]
    wb = tl.load(w_ptr + rn[:, None] * swn + rk[None, :], mask=bmask, other=0)
    if DOT == 2:
        sw = e8m0_value(tl.load(ws_ptr + (rn // 32) * swsn + kb // 32, mask=nmask, other=0))
        acc = qdot(acc, a, sx, wb.to(tl.float8e4nv, bitcast=True), sw, DOT)
    elif DOT == 1 and BN % 32 == 0:
        b = fp8_weight_tile_bf16(wb, ws_ptr, rn, kb, nmask, kmask, swsn, BN, BK)
        acc = qdot(acc, a, sx, b, sx, DOT)
    else:
        fld = tl.load(ws_ptr + (rn // 32)[:, None] * swsn + rk[None, :] // 32, mask=bmask)
        acc = qdot(acc, a, sx, decode_e4m3(wb) * e8m0_value(fld), sx, DOT)
    return acc


@triton.jit
def swiglu_fp8(acc1, acc3, limit, rw, ROUND_BF16: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr):  # fmt: skip
    """The clamped SwiGLU of gate/up products ``[BM, BN]`` (rounded to bf16 first where the
    linears round) times the routing weights ``rw [BM]``, rounded, then its FP8 activation codes:
    (E4M3 bytes ``[BM, BN]``, E8M0 fields ``[BM, BN / 32]``)."""
    if ROUND_BF16:  # the linears' outputs are rounded to the compute dtype
        acc1 = round_bf16(acc1)
        acc3 = round_bf16(acc3)
    gate = tl.minimum(acc1, limit)
    up = tl.minimum(tl.maximum(acc3, -limit), limit)
    act = gate * tl.sigmoid(gate) * up * rw[:, None]
    if ROUND_BF16:
        act = round_bf16(act)
    act3 = tl.reshape(act, [BM, BN // 32, 32])
    _scale, inv, field = fp8_act_scale(tl.max(tl.abs(act3), axis=2))
    return tl.reshape(encode_e4m3(round_e4m3(act3 * inv[:, :, None])), [BM, BN]), field


@triton.jit
def tile_origin(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first lane) of this program's output tile, row tiles walked ``GROUP_M`` at
    a time so that a weight tile is read from L2 while it is hot."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BM, pid_n * BN


@triton.jit
def tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row ids ``[BM]``, lane ids ``[BN]``) of ``tile_origin``'s tile."""
    m0, n0 = tile_origin(M, N, BM, BN, GROUP_M)
    return m0 + tl.arange(0, BM), n0 + tl.arange(0, BN)


@triton.jit
def rope_lanes(acc, rm, rn, mmask, cos_ptr, sin_ptr, scm, HEAD_D: tl.constexpr,
               ROPE_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """``acc [BM, BN]`` (lanes ``rn`` of ``[.., heads * HEAD_D]``) with RoPE on the last
    ``ROPE_D`` lanes of every head: interleaved pairs ``(2i, 2i + 1)`` rotated by row ``rm``'s
    ``cos, sin [M, ROPE_D / 2]`` (``layers.apply_rope``, in float32)."""
    re, im = tl.split(tl.reshape(acc, [BM, BN // 2, 2]))
    even = tl.reshape(tl.split(tl.reshape(rn, [BN // 2, 2]))[0], [BN // 2])
    lane = even % HEAD_D
    rot = lane >= HEAD_D - ROPE_D
    pair = tl.where(rot, (lane - (HEAD_D - ROPE_D)) // 2, 0)
    cmask = mmask[:, None] & rot[None, :]
    c = tl.load(cos_ptr + rm[:, None] * scm + pair[None, :], mask=cmask, other=1.0)
    s = tl.load(sin_ptr + rm[:, None] * scm + pair[None, :], mask=cmask, other=0.0)
    re2 = tl.where(rot[None, :], re * c - im * s, re)
    im2 = tl.where(rot[None, :], re * s + im * c, im)
    return tl.reshape(tl.join(re2, im2), [BM, BN])


@triton.jit
def store_linear(acc, y_ptr, cos_ptr, sin_ptr, rm, rn, mmask, nmask, sym, scm,
                 OUT_BF16: tl.constexpr, HEAD_D: tl.constexpr, ROPE_D: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The linear's epilogue: ``acc`` rounded to bf16 where the output is, RoPE on the last
    ``ROPE_D`` lanes of every ``HEAD_D``-lane head (``ROPE_D > 0``) rounded again, stored."""
    if OUT_BF16:
        acc = round_bf16(acc)
    if ROPE_D > 0:
        acc = rope_lanes(acc, rm, rn, mmask, cos_ptr, sin_ptr, scm, HEAD_D, ROPE_D, BM, BN)
        if OUT_BF16:
            acc = round_bf16(acc)
    ymask = mmask[:, None] & nmask[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def store_partial(acc, part_ptr, rm, rn, mmask, nmask, M, N):
    """A K split's float32 partial ``[BM, BN]`` into ``part [split, M, N]`` (split = axis 1)."""
    row = tl.program_id(1) * M + rm
    mask = mmask[:, None] & nmask[None, :]
    tl.store(part_ptr + row[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mask)


@triton.jit
def last_split_arrived(count_ptr, SPLIT_K: tl.constexpr):
    """Count this program in at ``count[program_id(0)]`` once its partials are stored (a CTA
    barrier first, so every thread's stores precede the release): True for the tile's last
    split to arrive, which acquires the others' partials and sets the count back to 0 (replays
    need no reset)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        tl.store(count_ptr + tl.program_id(0), 0)
    return last


@triton.jit
def sum_partials(part_ptr, rm, rn, mmask, nmask, M, N, S: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CG: tl.constexpr = False):  # fmt: skip
    """The ``S`` partials of the tile ``(rm, rn)`` summed in split order, float32. ``CG``:
    loaded past L1 (other programs of the launch wrote them)."""
    mask = mmask[:, None] & nmask[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in tl.static_range(S):
        row = s * M + rm
        at = part_ptr + row[:, None].to(tl.int64) * N + rn[None, :]
        if CG:
            acc += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(at, mask=mask, other=0.0)
    return acc


@triton.jit
def end_tile(acc, y_ptr, cos_ptr, sin_ptr, part_ptr, count_ptr, rm, rn, mmask, nmask, M, N, sym,
             scm, OUT_BF16: tl.constexpr, HEAD_D: tl.constexpr, ROPE_D: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr,
             ONE_LAUNCH: tl.constexpr):  # fmt: skip
    """A linear's output tile from its float32 sums ``acc``: stored (``store_linear``), or,
    with ``SPLIT_K > 1``, this split's partial stored and, with ``ONE_LAUNCH``, the tile's last
    split to arrive summing every partial in split order and storing the tile."""
    if SPLIT_K > 1:
        store_partial(acc, part_ptr, rm, rn, mmask, nmask, M, N)
        if ONE_LAUNCH:  # noqa: SIM102 (a compile-time branch: no counting without it)
            if last_split_arrived(count_ptr, SPLIT_K):
                acc = sum_partials(part_ptr, rm, rn, mmask, nmask, M, N, SPLIT_K, BM, BN, True)
                store_linear(acc, y_ptr, cos_ptr, sin_ptr, rm, rn, mmask, nmask, sym, scm,
                             OUT_BF16, HEAD_D, ROPE_D, BM, BN)  # fmt: skip
    else:
        store_linear(acc, y_ptr, cos_ptr, sin_ptr, rm, rn, mmask, nmask, sym, scm, OUT_BF16,
                     HEAD_D, ROPE_D, BM, BN)  # fmt: skip


@triton.jit
def _w8a8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    cos_ptr,
    sin_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K: tl.constexpr,
    sxm,
    sxg,
    sxo,
    sxsm,
    swn,
    swsn,
    sym,
    scm,
    QUANT_X: tl.constexpr,
    DOT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    KG: tl.constexpr,
    HEAD_D: tl.constexpr,
    ROPE_D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    ONE_LAUNCH: tl.constexpr = False,
    A16: tl.constexpr = False,
    XO: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """One ``[BM, BN]`` output tile of ``x @ W^T``; see ``w8a8_linear``. ``K`` is a compile-time
    constant: a weight's width, and the interpreter needs Python loop bounds. ``KG > 0``: ``x``
    is ``[M, K / KG, KG]`` with group stride ``sxg`` (lane ``k`` at group ``k // KG``).
    ``ROPE_D > 0``: RoPE on the last ``ROPE_D`` lanes of every ``HEAD_D``-lane head of the
    output, after its bf16 rounding, then rounded again. ``SPLIT_K > 1``: this program sums
    the ``K_SPLIT`` lanes of split ``program_id(1)`` into ``part``; ``_split_sum_kernel`` ends
    the product, or with ``ONE_LAUNCH`` the tile's last split to finish: each counts itself in
    ``count[program_id(0)]`` after a CTA barrier, and the one that sees ``SPLIT_K - 1``
    acquires the others' partials, sets the count back to 0 (so replays need no reset) and
    sums them in split order (``_split_sum_kernel``'s sums, bit for bit). ``A16``: ``x`` holds
    float activations taken as they are (no quantizer; ``"bf16"`` or ``"fp32"`` mode), the
    weight-only product of ``w8a16_grouped``. ``XO > 0``: every ``XO`` output lanes read their
    own input, ``x_ptr + (lane // XO) * sxo`` (a block-diagonal product: ``BN`` divides
    ``XO``). ``PDL``: a dependent launch (``triton_common.pdl_launch``)."""
    pdl_enter(PDL)
    m0, n0 = tile_origin(M, N, BM, BN, GROUP_M)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    if XO > 0:
        x_ptr += (n0 // XO).to(tl.int64) * sxo
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    # the fp8 mode scales each 32-lane block's product: a wider BK walks its blocks unrolled,
    # in the same order (the sums are BK=32's, bit for bit)
    SUB: tl.constexpr = 32 if DOT == 2 else BK
    for kk in range(0, K_SPLIT, BK):
        for j in tl.static_range(BK // SUB):
            kb = k_lo + kk + j * SUB
            rk = kb + tl.arange(0, SUB)
            kmask = rk < K
            if K_SPLIT % BK != 0:  # a split's last step ends at its last scale block
                kmask &= kk + j * SUB + tl.arange(0, SUB) < K_SPLIT
            rka = rk if KG == 0 else (rk // KG) * sxg + rk % KG
            if A16:
                a = tl.load(
                    x_ptr + rm[:, None] * sxm + rka[None, :],
                    mask=mmask[:, None] & kmask[None, :],
                    other=0.0,
                )
                a = a.to(tl.bfloat16) if DOT == 1 else a.to(tl.float32)
                sx = tl.zeros([BM], dtype=tl.float32)
            else:
                a, sx = load_a_tile(
                    x_ptr, xs_ptr, rm, rka, kb, mmask, kmask, sxm, sxsm, QUANT_X, DOT, BM, SUB
                )
            acc = w8a8_step(
                acc, a, sx, w_ptr, ws_ptr, rn, rk, kb, nmask, kmask, swn, swsn, DOT, BN, SUB
            )
    end_tile(acc, y_ptr, cos_ptr, sin_ptr, part_ptr, count_ptr, rm, rn, mmask, nmask, M, N,
             sym, scm, OUT_BF16, HEAD_D, ROPE_D, BM, BN, SPLIT_K, ONE_LAUNCH)  # fmt: skip


@triton.jit
def _tma_bf16_steps(
    x_desc, xs_ptr, w_desc, ws_ptr, m0, n0, rm, rb, mmask, bmask, K: tl.constexpr, sxsm, swsn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr, k_lo=0,
    K_SPLIT: tl.constexpr = 0,
):  # fmt: skip
    """The ``"bf16"`` mode's K loop over TMA tiles: each ``BK``-lane step's E4M3 codes times
    their block scales (one byte a row and 32-lane block for the activations, one a 32 x 32
    block for the weight), exact in bf16 (a 4-bit significand times a power of two), then one
    bf16 dot into the float32 accumulator, which stays in the tensor cores between steps (no
    per-block scaling of partial products: the dots need no wait). ``F32_DOT``: the same
    operands widened to float32 (the interpreter, whose bf16 dot is not exact). ``K_SPLIT >
    0``: lanes ``k_lo .. k_lo + K_SPLIT`` only (a K split); a step's lanes past the split take
    the scale 0, so their codes (the next split's) add nothing."""
    nb: tl.constexpr = BK // 32
    mb: tl.constexpr = BN // 32
    LANES: tl.constexpr = K if K_SPLIT == 0 else K_SPLIT
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in range(0, LANES, BK):
        kb = k_lo + kk
        kbi = kb // 32 + tl.arange(0, nb)
        klive = kbi * 32 < K  # a block past K has no scale byte (its codes read as zeros)
        if K_SPLIT > 0:
            klive &= kk + tl.arange(0, nb) * 32 < K_SPLIT
        fx = tl.load(
            xs_ptr + rm[:, None] * sxsm + kbi[None, :],
            mask=mmask[:, None] & klive[None, :],
            other=0,
        )
        fw = tl.load(
            ws_ptr + rb[:, None] * swsn + kbi[None, :],
            mask=bmask[:, None] & klive[None, :],
            other=0,
        )
        a = tl.reshape(x_desc.load([m0, kb]).to(tl.float32), [BM, nb, 32])
        b = tl.reshape(w_desc.load([n0, kb]).to(tl.float32), [mb, 32, nb, 32])
        a = tl.reshape(a * e8m0_value(fx)[:, :, None], [BM, BK])
        b = tl.reshape(b * e8m0_value(fw)[:, None, :, None], [BN, BK])
        if F32_DOT:
            acc += tl.dot(a.to(tl.bfloat16).to(tl.float32), tl.trans(b), input_precision="ieee")
        else:
            acc += tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
    return acc


@triton.jit
def _w8a8_tma_kernel(
    x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, cos_ptr, sin_ptr, part_ptr, count_ptr, M, N,
    K: tl.constexpr, sxsm, swsn, sym, scm, DOT: tl.constexpr, OUT_BF16: tl.constexpr,
    HEAD_D: tl.constexpr, ROPE_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    GROUP_M: tl.constexpr, BK: tl.constexpr = 32, F32_DOT: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, K_SPLIT: tl.constexpr = 0, ONE_LAUNCH: tl.constexpr = False,
):  # fmt: skip
    """``_w8a8_kernel`` on pre-quantized codes with its operand tiles read by TMA descriptors
    (``x_desc``: E4M3 ``[M, K]`` in ``[BM, BK]`` blocks, ``w_desc``: ``[N, K]`` in ``[BN, BK]``;
    past the edges they read zeros). ``"fp8"`` / ``"fp32"`` (``BK = 32``): each 32-lane block is
    one dot scaled as in the ``"fp8"`` mode, so the sums are ``_w8a8_kernel``'s at ``BK = 32``
    bit for bit; the scale bytes of a block are loaded one block ahead (their latency then
    overlaps the dot before), the weight's as one byte per 32-row block (``BN`` a multiple of
    32), broadcast to the lanes. ``"bf16"`` (``_tma_bf16_steps``): ``BK`` lanes a dot.
    ``SPLIT_K > 1``: split ``program_id(1)`` of ``K_SPLIT`` lanes into ``part``, ended as
    ``_w8a8_kernel``'s splits are (``ONE_LAUNCH``, or ``_split_sum_kernel``)."""
    m0, n0 = tile_origin(M, N, BM, BN, GROUP_M)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rb = n0 // 32 + tl.arange(0, BN // 32)
    mmask = rm < M
    nmask = rn < N
    bmask = rb * 32 < N
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    LANES: tl.constexpr = K if SPLIT_K == 1 else K_SPLIT
    if DOT == 1:
        acc = _tma_bf16_steps(
            x_desc, xs_ptr, w_desc, ws_ptr, m0, n0, rm, rb, mmask, bmask, K, sxsm, swsn, BM, BN,
            BK, F32_DOT, k_lo, 0 if SPLIT_K == 1 else K_SPLIT,
        )  # fmt: skip
    else:
        acc = _tma_fp8_blocks(
            x_desc, xs_ptr, w_desc, ws_ptr, m0, n0, rm, rb, mmask, bmask, K, sxsm, swsn, BM, BN,
            DOT, k_lo, LANES,
        )  # fmt: skip
    end_tile(acc, y_ptr, cos_ptr, sin_ptr, part_ptr, count_ptr, rm, rn, mmask, nmask, M, N,
             sym, scm, OUT_BF16, HEAD_D, ROPE_D, BM, BN, SPLIT_K, ONE_LAUNCH)  # fmt: skip


@triton.jit
def _tma_fp8_blocks(
    x_desc, xs_ptr, w_desc, ws_ptr, m0, n0, rm, rb, mmask, bmask, K: tl.constexpr, sxsm, swsn,
    BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr, k_lo, LANES: tl.constexpr,
):  # fmt: skip
    """The ``"fp8"`` / ``"fp32"`` modes' K loop over TMA tiles, lanes ``k_lo .. k_lo + LANES``:
    each 32-lane block one dot scaled by its two scales, the next block's scale bytes loaded
    one block ahead."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    fx = tl.load(xs_ptr + rm * sxsm + k_lo // 32, mask=mmask & (k_lo < K), other=0)
    fw = tl.load(ws_ptr + rb * swsn + k_lo // 32, mask=bmask & (k_lo < K), other=0)
    for kk in range(0, LANES, 32):
        kb = k_lo + kk
        sx = e8m0_value(fx)
        sw = e8m0_value(fw)
        # the next block's scales (none past K or the split: a neighbour's byte or 0xFF is no
        # scale)
        live = (kb + 32 < K) & (kk + 32 < LANES)
        fx = tl.load(xs_ptr + rm * sxsm + kb // 32 + 1, mask=mmask & live, other=0)
        fw = tl.load(ws_ptr + rb * swsn + kb // 32 + 1, mask=bmask & live, other=0)
        a = x_desc.load([m0, kb])
        b = w_desc.load([n0, kb])
        s = sx[:, None] * sw[None, :]
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BN // 32, 32]), [BM, BN])
        if DOT == 2:
            acc += tl.dot(a, tl.trans(b)) * s
        else:
            sl = tl.reshape(tl.broadcast_to(sw[:, None], [BN // 32, 32]), [BN])
            af = a.to(tl.float32) * sx[:, None]
            bf = b.to(tl.float32) * sl[:, None]
            acc += tl.dot(af, tl.trans(bf), input_precision="ieee")
    return acc


@triton.jit
def _split_sum_kernel(
    part_ptr, y_ptr, cos_ptr, sin_ptr, M, N, sym, scm, S: tl.constexpr, OUT_BF16: tl.constexpr,
    HEAD_D: tl.constexpr, ROPE_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """A split-K linear's end: the ``S`` float32 partials of one ``[BM, BN]`` tile summed in
    split order, then ``_w8a8_kernel``'s epilogue."""
    rm, rn = tile_ids(M, N, BM, BN, 1)
    mmask = rm < M
    nmask = rn < N
    acc = sum_partials(part_ptr, rm, rn, mmask, nmask, M, N, S, BM, BN)
    store_linear(acc, y_ptr, cos_ptr, sin_ptr, rm, rn, mmask, nmask, sym, scm, OUT_BF16, HEAD_D,
                 ROPE_D, BM, BN)  # fmt: skip


@triton.jit
def store_swiglu(acc1, acc3, limit, h_ptr, hs_ptr, rm, rn, mmask, nmask, N, shm, shsm,
                 ROUND_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The shared expert's epilogue: ``swiglu_fp8`` of the gate/up sums (no routing weight),
    its E4M3 codes and E8M0 fields stored."""
    ones = tl.full([BM], 1.0, dtype=tl.float32)  # no routing weight: times one is exact
    q, field = swiglu_fp8(acc1, acc3, limit, ones, ROUND_BF16, BM, BN)
    hmask = mmask[:, None] & nmask[None, :]
    tl.store(h_ptr + rm[:, None] * shm + rn[None, :], q.to(tl.uint8), mask=hmask)
    rb = tl.min(rn, axis=0) // 32 + tl.arange(0, BN // 32)  # the tile's 32-lane blocks
    bmask = mmask[:, None] & (rb < N // 32)[None, :]
    tl.store(hs_ptr + rm[:, None] * shsm + rb[None, :], field.to(tl.uint8), mask=bmask)


@triton.jit
def _w8a8_swiglu_kernel(
    xq_ptr,
    xs_ptr,
    w1_ptr,
    ws1_ptr,
    w3_ptr,
    ws3_ptr,
    h_ptr,
    hs_ptr,
    part_ptr,
    limit,
    M,
    N,
    K: tl.constexpr,
    sxm,
    sxsm,
    swn,
    swsn,
    shm,
    shsm,
    DOT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    count_ptr=None,
    ONE_LAUNCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One ``[BM, BN]`` tile of the shared expert's ``h = swiglu(x W1^T, x W3^T)`` from
    pre-quantized ``x``, written as its FP8 activation codes (E4M3 + E8M0 per 32 lanes; ``BN``
    a multiple of 32): what ``w2`` reads. See ``w8a8_swiglu``. ``SPLIT_K > 1``: the two
    partials of split ``program_id(1)`` into ``part [2, SPLIT_K, M, N]``, then
    ``_swiglu_split_sum_kernel`` ends the product, or with ``ONE_LAUNCH`` the tile's last
    split to arrive does (as in ``_w8a8_kernel``: its sums, bit for bit)."""
    pdl_enter(PDL)
    rm, rn = tile_ids(M, N, BM, BN, GROUP_M)
    mmask = rm < M
    nmask = rn < N
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    SUB: tl.constexpr = 32 if DOT == 2 else BK
    for kk in range(0, K_SPLIT, BK):
        for j in tl.static_range(BK // SUB):
            kb = k_lo + kk + j * SUB
            rk = kb + tl.arange(0, SUB)
            kmask = rk < K
            if K_SPLIT % BK != 0:  # a split's last step ends at its last scale block
                kmask &= kk + j * SUB + tl.arange(0, SUB) < K_SPLIT
            a, sx = load_a_tile(
                xq_ptr, xs_ptr, rm, rk, kb, mmask, kmask, sxm, sxsm, False, DOT, BM, SUB
            )
            acc1 = w8a8_step(
                acc1, a, sx, w1_ptr, ws1_ptr, rn, rk, kb, nmask, kmask, swn, swsn, DOT, BN, SUB
            )
            acc3 = w8a8_step(
                acc3, a, sx, w3_ptr, ws3_ptr, rn, rk, kb, nmask, kmask, swn, swsn, DOT, BN, SUB
            )
    if SPLIT_K > 1:
        store_partial(acc1, part_ptr, rm, rn, mmask, nmask, M, N)
        store_partial(acc3, part_ptr + SPLIT_K * M * N, rm, rn, mmask, nmask, M, N)
        if ONE_LAUNCH:  # noqa: SIM102 (a compile-time branch: no counting without it)
            if last_split_arrived(count_ptr, SPLIT_K):
                acc1 = sum_partials(part_ptr, rm, rn, mmask, nmask, M, N, SPLIT_K, BM, BN, True)
                acc3 = sum_partials(part_ptr + SPLIT_K * M * N, rm, rn, mmask, nmask, M, N,
                                    SPLIT_K, BM, BN, True)  # fmt: skip
                store_swiglu(acc1, acc3, limit, h_ptr, hs_ptr, rm, rn, mmask, nmask, N, shm,
                             shsm, ROUND_BF16, BM, BN)  # fmt: skip
    else:
        store_swiglu(acc1, acc3, limit, h_ptr, hs_ptr, rm, rn, mmask, nmask, N, shm, shsm,
                     ROUND_BF16, BM, BN)  # fmt: skip


@triton.jit
def _swiglu_split_sum_kernel(
    part_ptr, h_ptr, hs_ptr, limit, M, N, shm, shsm, S: tl.constexpr,
    ROUND_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """A split-K shared expert's end: each product's ``S`` partials summed in split order,
    then ``_w8a8_swiglu_kernel``'s epilogue."""
    rm, rn = tile_ids(M, N, BM, BN, 1)
    mmask = rm < M
    nmask = rn < N
    acc1 = sum_partials(part_ptr, rm, rn, mmask, nmask, M, N, S, BM, BN)
    acc3 = sum_partials(part_ptr + S * M * N, rm, rn, mmask, nmask, M, N, S, BM, BN)
    store_swiglu(acc1, acc3, limit, h_ptr, hs_ptr, rm, rn, mmask, nmask, N, shm, shsm,
                 ROUND_BF16, BM, BN)  # fmt: skip


PREQUANT_ROWS = 1
"""Rows from which ``w8a8_linear`` quantizes its input in a launch of its own rather than in
the GEMM's prologue (the same codes): every row count. Prefill rows 0.71 -> 0.42 ms at ``wq_a``,
8K rows (bench_gemm_moe.py); decode, quantizer launch included (flash_slice widths, one row /
64 rows, reports/gpu/bench_gemm_moe_sweep3.json): ``wq_b`` 27.2 -> 19.1 / 53.2 -> 34.4 us,
``wo_b`` 36.6 -> 26.3 / 70.4 -> 49.1, ``wq_a`` 15.0 -> 13.0, ``wkv`` even; each output tile's
prologue otherwise quantizes the same row again."""

PREFILL_TMA_TILE: GemmConfig | None = GemmConfig(128, 64, 32, num_warps=4, num_stages=4, tma=True)
"""The tile of a CUDA ``"fp8"`` launch on pre-quantized prefill rows (more than 64) when the
device has TMA (sm_90+) and the operands are 16-byte aligned: ``GemmConfig.tma``'s kernel (its
sm_90 loop 202 instructions a 32-lane block against the pointer kernel's 659, no spills;
scripts/check_dense_kernels_sm90.py; 8K rows of ``wq_b`` 2.47 -> 1.67 ms, of ``wo_b`` 2.65 ->
1.77, reports/gpu/bench_gemm_moe_sweep3.json). None: the pointer kernel's ``default_config``."""


DECODE_BF16_ROWS = True
"""Whether a CUDA launch of 17 to 64 rows whose caller names no dot mode runs the ``"bf16"``
mode (``decode_dot``): the E4M3 codes times their scales, exact in bf16, one dot a 64-lane K
step into float32 sums, in 64-row tiles at every weight width; the ``"fp8"`` mode's 64-row
wgmma keeps fewer bits of a block's sum, so narrow weights take 16-row tiles there. The
17-64-row sweeps (H100): ``wq_b`` 35.3 -> 30.5 us, ``wo_b`` even, ``shared.w2`` 15.4 -> 17.9
(``bench_gemm_moe_decode_bf16_h100_c50e287.json``); the joint ``wq_a``/``wkv`` 29 -> 20 us
by TMA tiles (``bench_gemm_moe_decode_tma_h100_965b9c7.json``). The flash_slice decode step at
batch 64 (H100): 30.28 -> 29.62 ms, W8A8 kernel time 7.12 -> 6.79
(``bench_decode_flash_slice_b64_folded_bf16rows_h100_8a9cd7d.json``; the other side:
``bench_decode_paths.py`` variant ``compiled_decode_fp8_rows``)."""


MM_ROWS: int | None = 1024
"""Rows from which a CUDA ``w8a8_linear`` or ``w8a8_swiglu`` whose caller names no dot mode
runs the ``"mm"`` mode: the activation quantizer's values and the weight's (``act_values_fp8``,
``dequant_fp8``: exact in bf16, the weight into a transient buffer) through the BLAS's bf16
GEMM, float32 sums. The ``"fp8"`` kernel's per-32-lane rescaling issues one ``FFMA`` per output
element a block, as many cycles as the FP8 tensor cores' own work, and held the Triton kernel
near 0.3 of the FP8 rate (README, "Why the W8A8 prefill tile stays near 0.3"); the bf16 rate is
about 0.64 of the FP8 rate and the BLAS's tiles reach most of it. Measured on an H100
(``bench_gemm_moe_mm_h100_9b9150c.json``): at 8K rows 0.54-0.56 of the FP8 rate against
0.27-0.29 (``wq_b``, ``wo_b``), the shared expert's gate/up 0.50 against 0.07; at 1024 rows
0.41-0.42 against 0.25-0.29; the 8K flash_slice prefill 1324 -> 1076 ms, replay on 695 -> 561
(``bench_prefill_flash_slice_mm_h100_9b9150c.json``). ``None``: never."""


def mm_rows(M: int, device: torch.device) -> bool:
    """Whether a launch of ``M`` rows whose caller names no dot mode runs the ``"mm"`` mode:
    from ``MM_ROWS`` rows on CUDA."""
    return device.type == "cuda" and MM_ROWS is not None and M >= MM_ROWS


def decode_dot(M: int, device: torch.device) -> str:
    """The dot mode of a ``w8a8_linear`` of ``M`` rows whose caller names none: ``"mm"`` from
    ``MM_ROWS`` rows on CUDA (``mm_rows``), ``"bf16"`` at 17-64 rows on CUDA with
    ``DECODE_BF16_ROWS``, else ``default_dot``'s."""
    if mm_rows(M, device):
        return "mm"
    if DECODE_BF16_ROWS and device.type == "cuda" and 16 < M <= 64:
        return "bf16"
    return default_dot(device)


@triton.jit
def _rope_rows_kernel(y_ptr, cos_ptr, sin_ptr, M, sym, scm, OUT_BF16: tl.constexpr,
                      HEAD_D: tl.constexpr, ROPE_D: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    """``store_linear``'s RoPE on stored rows, in place: the last ``ROPE_D`` lanes of head
    ``program_id(1)`` of ``BM`` rows, rotated in float32 and rounded to ``y``'s dtype (to
    nearest even in bf16, as ``store_linear``)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * HEAD_D + HEAD_D - ROPE_D + tl.arange(0, ROPE_D)
    mmask = rm < M
    ptr = y_ptr + rm[:, None] * sym + rn[None, :]
    acc = tl.load(ptr, mask=mmask[:, None], other=0.0).to(tl.float32)
    acc = rope_lanes(acc, rm, rn, mmask, cos_ptr, sin_ptr, scm, HEAD_D, ROPE_D, BM, ROPE_D)
    if OUT_BF16:
        acc = round_bf16(acc)
    tl.store(ptr, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None])


@contextlib.contextmanager
def float32_sums():
    """cuBLAS's bf16 products inside sum in float32: it may otherwise reduce a product's K
    splits in bf16 (``allow_bf16_reduced_precision_reduction``, on by default), outside the
    bound the ``"mm"`` mode and ``w8a16_grouped``'s prefill state. Restored after."""
    flags = torch.backends.cuda.matmul
    was = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = was


def _blas_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.mm(a, b)`` with float32 sums (``float32_sums``)."""
    with float32_sums():
        return torch.mm(a, b)


def _mm_linear(x, x_scales, w_codes, w_scales, out_dtype, rope) -> torch.Tensor:
    """``w8a8_linear``'s ``"mm"`` mode: ``x [M, K]`` (float, or E4M3 codes with ``x_scales``)
    quantized to its values, the weight's values, one BLAS GEMM (bf16 operands for a bf16
    output, else float32), then ``store_linear``'s RoPE in place."""
    vals = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    y = _blas_mm(act_values_fp8(x, x_scales, vals), dequant_fp8(w_codes, w_scales, vals).t())
    y = y.to(out_dtype)
    if rope is not None and y.shape[0]:
        cos, sin, head_d = rope
        rope_d, (M, N) = 2 * cos.shape[-1], y.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        bm = 32
        _rope_rows_kernel[(triton.cdiv(M, bm), N // head_d)](
            y, cos, sin, M, y.stride(0), cos.stride(0), OUT_BF16=y.dtype == torch.bfloat16,
            HEAD_D=head_d, ROPE_D=rope_d, BM=bm, enable_fp_fusion=False,
        )  # fmt: skip
    return y


DECODE_TMA = False
"""Whether an ``"fp8"`` launch on pre-quantized decode rows (up to 64) reads its operand tiles
by TMA descriptors (``tma_ready``: sm_90+, aligned operands): ``default_config``'s tiles and K
splits with ``GemmConfig.tma`` at 32-lane steps (the ``"fp8"`` mode's sums at any step), so
every row keeps the pointer kernel's sums, bit for bit. (The ``"fp32"`` mode takes it only at
32-lane steps, its sums being per step: the interpreter's tests.) Off: the pointer kernel."""


def tma_ready(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x``'s and ``w``'s codes can be read by TMA descriptors: a CUDA device of
    compute capability 9 or more (or Triton's interpreter), 16-byte aligned rows and bases."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (x, w))  # fmt: skip


SPLIT_ONE_LAUNCH = True
"""Whether a split-K linear ends in its own launch's last split (``_w8a8_kernel``'s and
``_w8a8_swiglu_kernel``'s ``ONE_LAUNCH``; an arrival counter per output tile) instead of a
second launch (``_split_sum_kernel``, ``_swiglu_split_sum_kernel``): the same sums (tested
under the interpreter; equal bits on the H100 at flash_slice shapes), one launch fewer (168 a
flash_slice decode step, 40 more where the shared expert's gate/up takes it: tiles of up to 16
rows, reports/gpu/bench_gemm_moe_swiglu_launch_h100_*.json) and faster at 7 of 8
decode shapes (wq_a 12.5 -> 11.5 us, wkv 10.6 -> 8.9 at one row; shared.w2 at 64 rows 17.9 ->
18.2), ``benchmarks/probe_split_launch.py``, reports/gpu/probe_split_launch_h100_ac8bb9e.json."""

SPLIT_COUNTERS_MIN = 1 << 16
"""Arrival counters allocated at first use (int32, one per output tile of a launch)."""

_SPLIT_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(dev: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed arrival counters on ``dev`` for a launch of ``tiles`` output tiles, left zero by
    every launch. Allocated once at first use (``SPLIT_COUNTERS_MIN``, more when a launch needs
    it, before any capture: the warm-up runs every shape first); a replaced tensor is kept
    alive, so a captured graph never reads a freed counter. One stream of launches at a time
    (each leaves them zero before the next starts)."""
    return arrival_counters(_SPLIT_COUNTERS, dev, max(SPLIT_COUNTERS_MIN, tiles))


SUM_TILE = (16, 128)
"""``[rows, lanes]`` of a split-K linear's sum program."""

SWIGLU_SUM_TILE = (16, 64)
"""``[rows, lanes]`` of the shared expert's split-K sum program (lanes a multiple of 32: its
end quantizes 32-lane blocks; 128 lanes spill at sm_90, scripts/check_dense_kernels_sm90.py)."""


def _splits(K: int, cfg: GemmConfig) -> tuple[int, int]:
    """``(splits, lanes a split covers)`` of ``cfg`` over ``K`` lanes: ``cfg.split_k`` rounded
    so that every split covers a whole number of 32-lane scale blocks and none is empty. The
    boundaries do not depend on ``block_k`` (a split's last K step is masked at its end), so
    decode tiles that differ only in their K step give a row the same sums (a 16- and a 64-row
    tile do not in the ``"fp8"`` mode: the tensor-core instruction differs)."""
    blocks = triton.cdiv(K, QUANT_BLOCK)
    per = triton.cdiv(blocks, max(1, min(cfg.split_k, blocks)))
    return triton.cdiv(blocks, per), per * QUANT_BLOCK


def default_dot(device: torch.device) -> str:
    """``"fp32"`` on the CPU (Triton's interpreter), ``"fp8"`` on CUDA: the mode of callers
    that name none and do not choose by rows (``w8a8_linear`` does, ``decode_dot``: its 17-64
    rows in the bf16 mode and, with ``MM_ROWS``, prefill rows in the mm mode, so on CUDA a row's
    sums differ, in their last bits, on either side of 16/17, 64/65 and ``MM_ROWS`` rows, as
    the fp8 mode's 16- and 64-row tiles already did; within each range they do not change
    with the launch's rows)."""
    return "fp8" if device.type == "cuda" else "fp32"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 / E8M0 / int8 tensor's bytes as uint8 (what the kernels read)."""
    return t.contiguous().view(torch.uint8)


def w8a8_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    x_scales: torch.Tensor | None = None,
    dot: str | None = None,
    config: GemmConfig | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """``y [M, N] = fake_fp8(x, 32) @ dequant(w)^T`` with FP8 operands, one kernel.

    ``x [M, K]``: bf16/fp32/fp16 activations, quantized first (``act_quant_fp8``, from
    ``PREQUANT_ROWS`` rows: every row count) or in the GEMM's prologue; or, with ``x_scales``
    (E8M0 ``[M, K/32]``), E4M3 codes already quantized. ``x`` may also be ``[M, G, K/G]``
    with any row and group strides (read as its flattening, with no copy in the prologue, or
    flattened for the quantizer; ``K/G % 32 == 0``, not pre-quantized): the grouped output
    projection's ``wo_a`` result, ``[G, M, K/G]`` transposed.
    ``w_codes`` ``float8_e4m3fn [N, K]``, ``w_scales`` E8M0 (``float8_e8m0fnu`` or uint8)
    ``[ceil(N/32), K/32]``. ``K % 32 == 0``. ``out_dtype`` defaults to ``x``'s float dtype (bf16
    for pre-quantized input). ``rope = (cos, sin, head_dim)`` (``cos, sin [M, rd/2]`` float32)
    applies ``layers.apply_rope`` to every ``head_dim``-lane head of the output in the epilogue.
    See the module docstring for the error bound and ``dot``.
    """
    grouped = x.dim() == 3
    M = x.shape[0]
    K = x.shape[1] * x.shape[2] if grouped else x.shape[1]
    N = w_codes.shape[0]
    if K % QUANT_BLOCK or w_codes.shape[1] != K or (grouped and x.shape[2] % QUANT_BLOCK):
        raise ValueError(
            f"w8a8_linear: x {list(x.shape)} and w {list(w_codes.shape)} (x [M, K] or "
            f"[M, G, K/G] against w [N, K], with K and K/G multiples of {QUANT_BLOCK})"
        )
    dot = dot or decode_dot(M, x.device)
    quant_x = x_scales is None
    if grouped and not quant_x:
        raise ValueError("w8a8_linear: a grouped [M, G, K/G] input is quantized in the prologue")
    if out_dtype is None:
        out_dtype = x.dtype if quant_x else torch.bfloat16
    if rope is not None:
        cos, sin, head_d = rope
        if cos.dtype != torch.float32 or N % head_d or head_d % 2:
            raise ValueError("w8a8_linear: rope takes float32 cos/sin and whole heads")
    if dot == "mm":
        if grouped:
            x = x.reshape(M, K)
        return _mm_linear(x, x_scales, w_codes, w_scales, out_dtype, rope)
    if quant_x and M >= PREQUANT_ROWS:
        # many row tiles: the prologue would quantize each row tile once per output tile;
        # quantizing once first gives the same codes (the same rounding, bit for bit)
        xq, xs = act_quant_fp8(x.reshape(M, K) if grouped else x)
        return w8a8_linear(xq, w_codes, w_scales, out_dtype, xs, dot, config, rope)
    cfg = config or default_config(M, N, K, dot)
    if (
        config is None
        and PREFILL_TMA_TILE is not None
        and M > 64
        and dot == "fp8"
        and not quant_x
        and not grouped
        and x.device.type == "cuda"
        and tma_ready(x, w_codes)
    ):
        cfg = PREFILL_TMA_TILE
    elif (
        config is None
        and DECODE_TMA
        and M <= 64
        and (dot == "fp8" or (dot == "fp32" and cfg.block_k == QUANT_BLOCK))
        and not quant_x
        and not grouped
        and cfg.block_n % QUANT_BLOCK == 0
        and tma_ready(x, w_codes)
    ):
        cfg = dataclasses.replace(cfg, block_k=QUANT_BLOCK, tma=True)
    if cfg.block_k % QUANT_BLOCK:
        raise ValueError(f"block_k {cfg.block_k}: a multiple of {QUANT_BLOCK} (the scale block)")
    if grouped:
        xk = x if x.stride(2) == 1 else x.contiguous()
        kg, sxg = x.shape[2], xk.stride(1)
    else:
        xk = x.contiguous() if quant_x else _bytes(x)
        kg, sxg = 0, 0
    xs = xk if quant_x else _bytes(x_scales)
    w, ws = _bytes(w_codes), _bytes(w_scales)
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    head_d = rope_d = 0
    cos = sin = y
    if rope is not None:
        cos, sin, head_d = rope
        rope_d = 2 * cos.shape[-1]
        if cfg.block_n % 2:
            raise ValueError("w8a8_linear: rope takes an even block_n")
        cos, sin = cos.contiguous(), sin.contiguous()
    split, k_split = _splits(K, cfg)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
    if cfg.tma:
        bk_ok = cfg.block_k == QUANT_BLOCK or dot == "bf16"
        if quant_x or grouped or not bk_ok:
            raise ValueError(
                "w8a8_linear: GemmConfig.tma takes pre-quantized, ungrouped input and block_k "
                f"{QUANT_BLOCK} outside the bf16 mode (quantized input: {not quant_x}, "
                f"grouped: {grouped}, block_k: {cfg.block_k}, dot: {dot})"
            )
        if cfg.block_n % QUANT_BLOCK:
            raise ValueError(
                f"w8a8_linear: GemmConfig.tma's block_n is a multiple of {QUANT_BLOCK}"
            )
        e4m3 = torch.float8_e4m3fn
        xd = TensorDescriptor.from_tensor(xk.view(e4m3), [cfg.block_m, cfg.block_k])
        wd = TensorDescriptor.from_tensor(w.view(e4m3), [cfg.block_n, cfg.block_k])
        part = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=y.device)
        one = split > 1 and SPLIT_ONE_LAUNCH
        count = split_counters(y.device, grid[0]) if one else part
        _w8a8_tma_kernel[grid](
            xd, xs, wd, ws, y, cos, sin, part, count, M, N, K, xs.stride(0), ws.stride(0),
            y.stride(0), cos.stride(0), DOT=DOT_MODES[dot], OUT_BF16=out_dtype == torch.bfloat16,
            HEAD_D=head_d, ROPE_D=rope_d, BM=cfg.block_m, BN=cfg.block_n, GROUP_M=cfg.group_m,
            BK=cfg.block_k, F32_DOT=x.device.type == "cpu", SPLIT_K=split, K_SPLIT=k_split,
            ONE_LAUNCH=one, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=rope is None,
        )  # fmt: skip
        if split > 1 and not one:
            _sum_splits(part, y, cos, sin, split, head_d, rope_d)
        return y
    return _launch_pointer(
        xk, xs, w, ws, y, cos, sin, cfg, (xk.stride(0), sxg, 0, xs.stride(0)), K, dot,
        QUANT_X=quant_x, KG=kg, HEAD_D=head_d, ROPE_D=rope_d,
    )  # fmt: skip


def _launch_pointer(xk, xs, w, ws, y, cos, sin, cfg, x_strides, K, dot, **consts):
    """Launch ``_w8a8_kernel`` (its K splits ending in the same launch, ``SPLIT_ONE_LAUNCH``,
    or in ``_split_sum_kernel``) into ``y [M, N]``; ``x_strides`` = ``(sxm, sxg, sxo, sxsm)``,
    ``consts`` the kernel's operand-form constants. Returns ``y``."""
    M, N = y.shape
    rope = consts["ROPE_D"] > 0
    out_bf16 = y.dtype == torch.bfloat16
    split, k_split = _splits(K, cfg)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
    part = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=y.device)
    one = split > 1 and SPLIT_ONE_LAUNCH
    count = split_counters(y.device, grid[0]) if one else part
    _w8a8_kernel[grid](
        xk, xs, w, ws, y, cos, sin, part, count, M, N, K, *x_strides, w.stride(0), ws.stride(0),
        y.stride(0), cos.stride(0), DOT=DOT_MODES[dot], OUT_BF16=out_bf16, BM=cfg.block_m,
        BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split, K_SPLIT=k_split,
        ONE_LAUNCH=one, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # the RoPE's products and sums round apart, as apply_rope's (the scale products of the
        # K loop multiply by powers of two: exact either way)
        enable_fp_fusion=not rope, **consts, **pdl_launch(y.device, M),
    )  # fmt: skip
    if split > 1 and not one:
        _sum_splits(part, y, cos, sin, split, consts["HEAD_D"], consts["ROPE_D"])
    return y


def _sum_splits(part, y, cos, sin, split: int, head_d: int, rope_d: int) -> None:
    """``_split_sum_kernel``: a split-K linear's ``split`` partials ``part [split, M, N]`` summed
    in split order into ``y``, with its epilogue (the RoPE where ``rope_d > 0``)."""
    M, N = y.shape
    bm, bn = SUM_TILE
    _split_sum_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        part, y, cos, sin, M, N, y.stride(0), cos.stride(0), S=split,
        OUT_BF16=y.dtype == torch.bfloat16, HEAD_D=head_d, ROPE_D=rope_d, BM=bm, BN=bn,
        enable_fp_fusion=rope_d == 0,
    )  # fmt: skip


A16_BMM_ROWS = 512
"""Rows from which ``w8a16_grouped`` on bf16 runs the weight's bf16 values (dequantized into a
transient buffer, one launch) through ``torch.bmm``: prefill. Below, the W8A16 kernel reads
the FP8 weight itself (decode: 16.7 against 26.0 us at one row, H100)."""


A16_PREFILL_TILE = GemmConfig(128, 128, 64, num_warps=8, num_stages=3)
"""``w8a16_grouped``'s tile above 64 rows on the W8A16 kernel (64-lane K steps: 1.50 against
1.96 ms for the W8A8 bf16 mode's 32 at 8K rows, H100, reports/gpu/probe_wo_a_*.json)."""


def w8a16_grouped(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    dot: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The grouped weight-only product of the output projection's ``wo_a``: ``y [M, G * R]``,
    ``y[:, g R:(g + 1) R] = x[g] @ dequant(w)[g R:(g + 1) R]^T``, one launch.

    ``x [G, M, K]``: float activations taken as they are (the published ``wo_a`` has no
    activation quantizer), any group and row strides; ``w_codes`` ``float8_e4m3fn [G * R, K]``
    with E8M0 32 x 32 scales ``[G * R / 32, K / 32]`` (``R`` and ``K`` multiples of 32): the
    FP8 weight as published, half the bytes of its bf16 values. ``"bf16"`` mode for bf16
    activations on CUDA (each weight tile dequantized in registers, exact in bf16), ``"fp32"``
    otherwise (float32 activations; the interpreter). The result is ``torch.bmm(x,
    dequant(w).view(G, R, K).transpose(1, 2))`` up to the order of the float32 additions (the
    bound of the module docstring with ``u_out`` of ``out_dtype``). ``y``'s ``[M, G, R]`` view
    is what ``wo_b`` reads."""
    G, M, K = x.shape
    N = w_codes.shape[0]
    R = N // G if G else 0
    if not G or N % G or R % QUANT_BLOCK or K % QUANT_BLOCK or w_codes.shape[1] != K:
        raise ValueError(
            f"w8a16_grouped: x {list(x.shape)} [G, M, K] against w {list(w_codes.shape)} "
            f"[G * R, K] (R and K multiples of {QUANT_BLOCK})"
        )
    # bf16 operands hold bf16 activations exactly; float32 ones stay float32
    dot = dot or ("bf16" if x.is_cuda and x.dtype == torch.bfloat16 else "fp32")
    if dot == "fp8":
        raise ValueError("w8a16_grouped: bf16 or fp32 operands (the activations stay unquantized)")
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    if config is None and M >= A16_BMM_ROWS and dot == "bf16" and y.dtype == torch.bfloat16:
        # prefill rows: the weight's bf16 values into a transient buffer, then cuBLAS (its
        # tiles beat the pointer kernel's 2.5x at 8K rows, reports/gpu/probe_wo_a_*.json)
        wd = dequant_fp8(w_codes, w_scales).view(G, R, K)
        with float32_sums():
            torch.bmm(x, wd.transpose(1, 2), out=y.view(M, G, R).transpose(0, 1))
        return y
    cfg = config or (A16_PREFILL_TILE if M > 64 else default_config(M, N, K, dot))
    bn = cfg.block_n
    while R % bn:  # a tile inside one group (R a multiple of 32)
        bn //= 2
    if bn != cfg.block_n:
        cfg = dataclasses.replace(cfg, block_n=bn)
        if config is None:
            cfg = dataclasses.replace(cfg, split_k=split_k_for(N, K, cfg))
    xk = x if x.stride(2) == 1 else x.contiguous()
    w, ws = _bytes(w_codes), _bytes(w_scales)
    return _launch_pointer(
        xk, xk, w, ws, y, y, y, cfg, (xk.stride(1), 0, xk.stride(0), 0), K, dot, QUANT_X=False,
        KG=0, HEAD_D=0, ROPE_D=0, A16=True, XO=R,
    )  # fmt: skip


@triton.jit
def _swiglu_rows_kernel(g_ptr, h_ptr, hs_ptr, limit, M, N, sgm, shm, shsm,
                        ROUND_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """``store_swiglu`` of stored gate/up sums ``g [M, 2N]`` (gate lanes first): the ``"mm"``
    mode's end of ``w8a8_swiglu``."""
    rm, rn = tile_ids(M, N, BM, BN, 1)
    mmask, nmask = rm < M, rn < N
    m = mmask[:, None] & nmask[None, :]
    ptr = g_ptr + rm[:, None] * sgm + rn[None, :]
    acc1 = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    acc3 = tl.load(ptr + N, mask=m, other=0.0).to(tl.float32)
    store_swiglu(acc1, acc3, limit, h_ptr, hs_ptr, rm, rn, mmask, nmask, N, shm, shsm, ROUND_BF16,
                 BM, BN)  # fmt: skip


def _mm_swiglu(xq, x_scales, w1, w3, limit, dtype):
    """``w8a8_swiglu``'s ``"mm"`` mode: the values of ``x`` and of ``w1`` over ``w3`` (one
    transient ``[2N, K]`` buffer), one BLAS GEMM whose sums round to ``dtype`` (bf16 operands
    for bf16, else float32), then the SwiGLU and its FP8 codes (``_swiglu_rows_kernel``)."""
    (M, K), N = xq.shape, w1[0].shape[0]
    vals = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    wv = torch.empty((2 * N, K), dtype=vals, device=xq.device)
    dequant_fp8(*w1, out=wv[:N])
    dequant_fp8(*w3, out=wv[N:])
    g = _blas_mm(act_values_fp8(xq, x_scales, vals), wv.t())
    h = torch.empty((M, N), dtype=torch.uint8, device=xq.device)
    hs = torch.empty((M, N // QUANT_BLOCK), dtype=torch.uint8, device=xq.device)
    bm, bn = SWIGLU_SUM_TILE
    if M:
        _swiglu_rows_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            g, h, hs, float(limit), M, N, g.stride(0), h.stride(0), hs.stride(0),
            ROUND_BF16=dtype == torch.bfloat16, BM=bm, BN=bn,
        )  # fmt: skip
    return h.view(torch.float8_e4m3fn), hs.view(torch.float8_e8m0fnu)


def w8a8_swiglu(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    w1: tuple[torch.Tensor, torch.Tensor],
    w3: tuple[torch.Tensor, torch.Tensor],
    limit: float,
    dtype: torch.dtype,
    dot: str | None = None,
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's gate/up product, clamped SwiGLU and the FP8 quantization of its
    result in one kernel: ``act_quant_fp8(swiglu(x W1^T, x W3^T).to(dtype))`` with ``x`` the
    pre-quantized ``xq [M, K]`` (E4M3) and ``x_scales`` (E8M0 ``[M, K/32]``), ``w1``/``w3``
    ``(codes [N, K], E8M0 scales [N/32, K/32])``, ``N % 32 == 0``. The products round to
    ``dtype`` as ``w8a8_linear``'s outputs do; the SwiGLU is ``moe_torch.swiglu``'s (Triton's
    ``sigmoid``: a float32 rounding or two from torch's ``silu``), rounded to ``dtype``.
    Returns (codes ``float8_e4m3fn [M, N]``, scales ``float8_e8m0fnu [M, N/32]``), what
    ``w8a8_linear(..., x_scales=)`` reads.
    """
    M, K = xq.shape
    N = w1[0].shape[0]
    if K % QUANT_BLOCK or N % QUANT_BLOCK or w1[0].shape != w3[0].shape or w1[0].shape[1] != K:
        raise ValueError(f"w8a8_swiglu: x {list(xq.shape)}, w1 {list(w1[0].shape)}")
    dot = dot or ("mm" if mm_rows(M, xq.device) else default_dot(xq.device))
    if dot == "mm":
        return _mm_swiglu(xq, x_scales, w1, w3, limit, dtype)
    cfg = config or default_config(M, N, K, dot)
    if cfg.block_k % QUANT_BLOCK or cfg.block_n % QUANT_BLOCK:
        raise ValueError(f"w8a8_swiglu: tiles {cfg} (block_n and block_k multiples of 32)")
    x, xs = _bytes(xq), _bytes(x_scales)
    (c1, s1), (c3, s3) = ((_bytes(c), _bytes(s)) for c, s in (w1, w3))
    h = torch.empty((M, N), dtype=torch.uint8, device=xq.device)
    hs = torch.empty((M, N // QUANT_BLOCK), dtype=torch.uint8, device=xq.device)
    if M:
        split, k_split = _splits(K, cfg)
        part = (
            h if split == 1 else torch.empty((2, split, M, N), dtype=torch.float32, device=h.device)
        )
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
        # one launch for tiles of up to 16 rows only: a 64-row tile's last split sums two
        # [64, 64] products over every split alone (17 rows 23 -> 31 us, one row 17 -> 16)
        one = split > 1 and SPLIT_ONE_LAUNCH and cfg.block_m <= 16
        count = split_counters(h.device, grid[0]) if one else part
        _w8a8_swiglu_kernel[grid](
            x, xs, c1, s1, c3, s3, h, hs, part, float(limit), M, N, K,
            x.stride(0), xs.stride(0), c1.stride(0), s1.stride(0), h.stride(0), hs.stride(0),
            DOT=DOT_MODES[dot], ROUND_BF16=dtype == torch.bfloat16, BM=cfg.block_m,
            BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
            K_SPLIT=k_split, count_ptr=count, ONE_LAUNCH=one, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl_launch(h.device, M),
        )  # fmt: skip
        if split > 1 and not one:
            bm, bn = SWIGLU_SUM_TILE
            _swiglu_split_sum_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
                part, h, hs, float(limit), M, N, h.stride(0), hs.stride(0), S=split,
                ROUND_BF16=dtype == torch.bfloat16, BM=bm, BN=bn,
            )  # fmt: skip
    return h.view(torch.float8_e4m3fn), hs.view(torch.float8_e8m0fnu)
