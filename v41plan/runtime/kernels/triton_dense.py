"""Fused dense-path kernels (Triton): the mHC site, ``hc_expand`` and the FP8 activation quantizer.

Each function here has the call shape of the torch composition it replaces
(``v41plan.runtime.kernels.dense_ref``) and runs as one kernel launch:

- ``mhc_site`` / ``mhc_site_fp8``: at one mHC site, the mix statistics (``flatten(X) @ fn.T``
  times the rsqrt-mean-square factor, float32 accumulation), the sigmoids, the softmax and
  every Sinkhorn iteration (a 4x4 matrix per token, in registers), the collapse with the
  previous site's pre-mix and the RMSNorm; ``mhc_site_fp8`` also quantizes the normed ``x`` in
  its epilogue to the W8A8 activation format (E4M3 codes + pow2 scale per 32 lanes). Three
  forms (``SITE_CONFIGS``; ``SITE_CONFIGS_WIDE`` at V4.1-Flash widths): the split form (small
  decode batches, every decode batch at wide hidden sizes: the first pass over 128-lane
  slices in parallel, the last of them finishing the token in the same launch), one token per
  program with the mix as per-lane products (up to 1024 tokens), or 16 tokens per program with
  the mix as a ``tl.dot`` (longer prefill chunks).
- ``mhc_expand_site``: the previous sublayer's ``hc_expand`` fused in front of the site (for
  rows where both run, e.g. every decode row).
- ``hc_expand``: ``X'[j] = post[j] * y + sum_i C[i][j] * X[i]`` alone.
- ``fp8_act_quant`` (codes + scales) and ``fake_fp8`` (dequantized): bit-exact with
  ``v41plan.model.quant.fake_fp8``.

Every op is a ``torch.library.custom_op`` (``torch.ops.v41plan.*``) with a fake (meta)
implementation, so ``torch.compile(fullgraph=True)`` keeps each as one opaque node. On CUDA
tensors the ops launch the Triton kernels; on CPU tensors they run the same kernels under the
Triton interpreter when this module was imported with ``TRITON_INTERPRET=1``, else the torch
reference. Inputs the kernels do not cover (float64 streams, ``hc != 4``, widths not a multiple
of the quantizer block) also take the torch reference, so every call shape stays valid.

Arithmetic and its accuracy (X in bf16 or float32; the mHC parameters, ``pre``/``post``/``C``
and all accumulation in float32):

- The quantizer is exact integer/power-of-two arithmetic: the scale ``pow2ceil(max(amax,
  1e-4) / 448)`` (a correctly rounded division, then the fp32 bit pattern), the codes
  round-to-nearest-even and saturating, assembled from bits. No float rounding step can differ
  from the reference, so codes, scales and dequantized values are bit-identical (finite inputs;
  NaN/inf blocks are out of scope). Casts to bf16 are explicit round-to-nearest-even (the
  interpreter's own cast truncates).
- mHC site, against the float64 evaluation of the same formulas on the same inputs, with
  ``u = 2**-24``, ``K = hc * D``, ``r`` the site's rsqrt-mean-square factor and
  ``E = c * u * r * max_j sum_l |f_l fn[j, l]|``, the worst-case error of the mix dot scaled
  like ``m`` (tiny against 1 for normal inputs). ``c = mix_error_terms(N, K)``: ``K`` for
  float32 products or FMAs summed in any order; ``6K + 16`` for the ``tf32x3`` tensor-core GEMM
  of the prefill form (each term is three exact TF32 products, the dropped low*low product and
  the splits' rounding stay within ``12u`` of it; three accumulations of ``K`` terms, each
  addition within ``2u`` as tensor cores may truncate instead of rounding):

  * ``|pre - pre64| <= |scale[0]| * E / 4 + 16u`` (sigmoid is 1/4-Lipschitz),
  * ``|post - post64| <= |scale[1]| * E / 2 + 32u``,
  * ``|C - C64| <= 4 * |scale[2]| * E + 64u * iters`` (the softmax at most doubles an error of
    its logits; each Sinkhorn normalization adds a few ulps and does not amplify the error
    already there, which the tests check over random and peaked matrices),
  * float32 X: ``|x - x64| <= 8u * rx * |w| * sum_k |pre_in[k] X[k]| + (D/2 + 8) u * |x64|``
    with ``rx`` the norm's rsqrt factor (collapse, then the norm's sum of squares);
    bf16 X: ``x`` is rounded twice to bf16 (after the collapse, after the norm) exactly where
    the torch reference rounds, so it is within 2 bf16 ulps of the reference run in bf16 and
    float32 accumulation.

  The bounds are per element; ``tests/runtime/test_triton_dense.py`` checks them.
- ``hc_expand``: ``|X' - X'64| <= 8u * (sum_i |C[i][j] X[i]| + |post[j] y|)`` in float32,
  one bf16 rounding (a half ulp, or one ulp against a bf16 reference) otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v41plan.model import quant as Q
from v41plan.model.layers import HcParams
from v41plan.runtime.kernels import dense_ref
from v41plan.runtime.kernels.triton_common import arrival_counters, pdl_enter, pdl_launch

__all__ = [
    "INTERPRETED",
    "SITE_CONFIGS",
    "SITE_CONFIGS_WIDE",
    "TritonDense",
    "codes_in_parallel",
    "fake_fp8",
    "fp8_act_quant",
    "hc_expand",
    "inverse_rope_groups",
    "mhc_expand_site",
    "mhc_expand_site_fp8",
    "mhc_site",
    "mhc_site_fp8",
    "mix_error_terms",
    "site_config",
]

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""True when this module's kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``
at import): CPU tensors then run the kernels themselves instead of the torch reference."""

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_HC = 4  # the kernel keeps one 4x4 Sinkhorn matrix per token in registers
# the products form up to 1024 tokens: on the H200 (reports/gpu/bench_dense_kernels.json,
# c3c745c) it took 0.028 ms at 64 tokens against 0.125 ms for tf32x3, 0.146 against 0.126 at 2048;
# the split form up to 16 (reports/gpu/sweep_decode_tiles.json: the attention site 28.4 us
# against 33.9 at one token, the FFN site with its expand even)
SITE_CONFIGS: list[tuple[int, tuple[str, int, int, int]]] = [
    (16, ("split", 1, 128, 4)),
    (1024, ("products", 1, 128, 4)),
    (1 << 62, ("tf32x3", 16, 32, 4)),
]
"""The site kernel by token count, the first bound that holds: ``(mix, tokens per program,
lanes per chunk, warps)``. ``split``: the first pass spread over ``SPLIT_LANES``-lane programs,
the last of a token's programs to finish it finishing the site (one launch,
``SPLIT_ONE_LAUNCH``). ``products``: one token per program, the
mix as per-lane float32 products summed once (decode batches: as many programs as tokens, no
wasted rows; lanes per chunk = 32 * warps keeps every tile in one layout). ``tf32x3`` /
``ieee``: ``tl.dot`` over ``tokens per program`` rows (prefill: every program reads all of
``fn``, so fewer programs mean less L2 traffic). Lanes per chunk stay a multiple of the
quantizer block (32)."""
WIDE_SITE_D = 4096
"""Hidden widths from which ``SITE_CONFIGS_WIDE`` applies instead of ``SITE_CONFIGS``."""
SITE_CONFIGS_WIDE: list[tuple[int, tuple[str, int, int, int]]] = [
    (16, ("split", 1, 128, 4)),
    (1024, ("split", 2, 128, 4)),
    (1 << 62, ("tf32x3", 16, 32, 4)),
]
"""The site kernel by token count at hidden ``>= WIDE_SITE_D`` (V4.1-Flash's 5120): the split
form for every decode batch. One program a token (``products``) streams all of ``fn``
(``4 * D * 24`` float32, 2 MB at 5120) through one SM; split, a program reads a
``SPLIT_LANES`` slice of it (49 KB) and a token's slices load on ``D / 128`` SMs at once. From
17 tokens two tokens share a program, which halves the reads of ``fn`` (64 tokens 29.7 ->
26.7 us, 8 tokens 15.2 either way; four a program 25.9 at 64 but 17.4 at 8: H100,
``reports/gpu/bench_dense_flash_sites_split_h100_ff13909.json``). Within each form a token's
sums are the same at every batch size; between them they differ, at the 16/17 boundary where
the W8A8 linears' decode tiles change too."""
_QUANT_TILE = 2048  # elements per quantizer program (about 16 per thread)


# --- device helpers -----------------------------------------------------------------------


@triton.jit
def _round_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even), still as fp32."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _to_stream(v, X_BF16: tl.constexpr):
    """fp32 ``v`` rounded to the stream dtype (bf16 or fp32), still as fp32."""
    if X_BF16:
        v = _round_bf16(v)
    return v


@triton.jit
def _fp8_e4m3_pow2(v):
    """FP8 E4M3 with one pow2 scale per block along the last axis of fp32 ``v [R, G, B]``.

    Returns (codes as int32 byte values [R, G, B], dequantized fp32 [R, G, B], scales fp32
    [R, G]). Only exact operations: a correctly rounded division, power-of-two products and
    integer rounding.
    """
    amax = tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4)
    sbits = tl.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
    sexp = ((sbits >> 23) & 0xFF) + ((sbits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (sexp << 23).to(tl.float32, bitcast=True)
    inv = ((254 - sexp) << 23).to(tl.float32, bitcast=True)  # 1/scale, exact
    y = v * inv[:, :, None]
    neg = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(y), 448.0)
    # floor(log2 a), clamped at E4M3's smallest normal exponent (subnormals share its quantum)
    ex = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    t = a * ((130 - ex) << 23).to(tl.float32, bitcast=True)  # a / 2**(ex - 3), in [0, 16)
    n = t.to(tl.int32)
    frac = t - n.to(tl.float32)
    n = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    # the magnitude code: 8 * (biased exponent - 1) + mantissa with its implicit bit; a
    # round-up to 16 carries into the exponent by itself
    code = (8 * (ex + 6) + n) | (neg << 7)
    mag = (n.to(tl.float32) * ((124 + ex) << 23).to(tl.float32, bitcast=True)) * scale[:, :, None]
    deq = (mag.to(tl.int32, bitcast=True) | (neg << 31)).to(tl.float32, bitcast=True)
    return code, deq, scale


@triton.jit(do_not_specialize=["M"])  # one build for every batch width
def _fp8_quant_kernel(
    x_ptr,
    out_ptr,
    codes_ptr,
    scales_ptr,
    M,
    K,
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    """Quantize rows ``x [M, K]``: a ``BLOCK_M`` x ``GROUPS * BLOCK`` tile per program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, BLOCK)
    col = grp[None, :, None] * BLOCK + lane[None, None, :]
    r3 = rows[:, None, None].to(tl.int64)
    mask = (rows[:, None, None] < M) & (col < K)
    off = r3 * K + col
    v = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    code, deq, scale = _fp8_e4m3_pow2(v)
    if DEQUANT:
        tl.store(out_ptr + off, deq.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(codes_ptr + off, code.to(tl.uint8), mask=mask)
        ngroups = K // BLOCK
        smask = (rows[:, None] < M) & (grp[None, :] < ngroups)
        soff = rows[:, None].to(tl.int64) * ngroups + grp[None, :]
        tl.store(scales_ptr + soff, scale, mask=smask)


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _norm_rope_fp8_kernel(
    y_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, N, eps,
    D: tl.constexpr, RD: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
    X_BF16: tl.constexpr, QUANT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One row of ``norm_rope_fp8``: RMSNorm, RoPE on the last ``RD`` lanes (pairs), FP8."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    grp = tl.arange(0, GROUPS)
    lane = tl.arange(0, BLOCK)
    col = grp[:, None] * BLOCK + lane[None, :]  # [GROUPS, BLOCK]
    v = tl.load(y_ptr + row * D + col).to(tl.float32)
    r = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
    n = _to_stream((v * r) * tl.load(w_ptr + col).to(tl.float32), X_BF16)
    rope = col >= D - RD
    pcol = col ^ 1  # the lane's RoPE partner
    vp = tl.load(y_ptr + row * D + pcol, mask=rope, other=0.0).to(tl.float32)
    pn = _to_stream((vp * r) * tl.load(w_ptr + pcol, mask=rope, other=0.0).to(tl.float32), X_BF16)
    half = tl.where(rope, (col - (D - RD)) // 2, 0)
    c = tl.load(cos_ptr + row * (RD // 2) + half, mask=rope, other=1.0)
    sn = tl.load(sin_ptr + row * (RD // 2) + half, mask=rope, other=0.0)
    even = (col & 1) == 0
    rotated = tl.where(even, n * c - pn * sn, pn * sn + n * c)
    v = tl.where(rope, _to_stream(rotated, X_BF16), n)
    if QUANT:
        _, v3, _ = _fp8_e4m3_pow2(v[None, :, :])
        v = tl.reshape(v3, [GROUPS, BLOCK])
    tl.store(out_ptr + row * D + col, v.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _inverse_rope_groups_kernel(
    o_ptr, cos_ptr, sin_ptr, out_ptr, N, so_n, so_h,
    D: tl.constexpr, RD: tl.constexpr, HG: tl.constexpr, X_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One (row, head) of ``inverse_rope_groups``: the head's ``D`` lanes with the inverse RoPE
    on the last ``RD`` (pairs), stored at ``out[head // HG, row, (head % HG) * D:]``."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    col = tl.arange(0, D)
    src = o_ptr + row * so_n + head * so_h
    v = tl.load(src + col).to(tl.float32)
    rope = col >= D - RD
    vp = tl.load(src + (col ^ 1), mask=rope, other=0.0).to(tl.float32)  # the pair partner
    half = tl.where(rope, (col - (D - RD)) // 2, 0)
    c = tl.load(cos_ptr + row * (RD // 2) + half, mask=rope, other=1.0)
    sn = tl.load(sin_ptr + row * (RD // 2) + half, mask=rope, other=0.0)
    # the conjugate rotation: (re c + im s, im c - re s), as apply_rope(inverse=True) rounds it
    rotated = tl.where((col & 1) == 0, v * c + vp * sn, v * c - vp * sn)
    v = tl.where(rope, _to_stream(rotated, X_BF16), v)
    dst = out_ptr + ((head // HG) * N + row) * (HG * D) + (head % HG) * D
    tl.store(dst + col, v.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _rope_wo_a_kernel(
    o_ptr, cos_ptr, sin_ptr, w_ptr, z_ptr, N,
    D: tl.constexpr, RD: tl.constexpr, KG: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
    BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, X_BF16: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """``z [N, G*R]``: group ``g``'s ``BR`` outputs of ``BN`` rows, the inverse RoPE applied to
    each head's last ``RD`` lanes of ``o [N, H, D]`` as its tile is loaded."""
    nrb: tl.constexpr = R // BR
    g = tl.program_id(0) // nrb
    r = (tl.program_id(0) % nrb) * BR + tl.arange(0, BR)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    n64 = n.to(tl.int64)
    acc = tl.zeros([BN, BR], dtype=tl.float32)
    for k0 in range(0, KG, BK):
        kk = k0 + tl.arange(0, BK)
        lane = kk % D
        col = g * KG + kk
        x = tl.load(o_ptr + n64[:, None] * (G * KG) + col[None, :], mask=nm[:, None], other=0.0)
        x = x.to(tl.float32)
        rope = (lane >= D - RD)[None, :] & nm[:, None]
        xp = tl.load(o_ptr + n64[:, None] * (G * KG) + (col ^ 1)[None, :], mask=rope, other=0.0).to(
            tl.float32
        )
        half = tl.where(lane >= D - RD, (lane - (D - RD)) // 2, 0)
        c = tl.load(cos_ptr + n64[:, None] * (RD // 2) + half[None, :], mask=rope, other=1.0)
        sn = tl.load(sin_ptr + n64[:, None] * (RD // 2) + half[None, :], mask=rope, other=0.0)
        even = ((lane & 1) == 0)[None, :]
        # the conjugate rotation: (re, im) -> (re c + im s, im c - re s)
        rot = tl.where(even, x * c + xp * sn, x * c - xp * sn)
        x = tl.where(rope, _to_stream(rot, X_BF16), x)
        w = tl.load(w_ptr + (g * R + r)[:, None].to(tl.int64) * KG + kk[None, :])
        if DOT == 1:  # bf16 operands
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w))
        elif DOT == 2:  # float32 operands, IEEE products
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # the interpreter: exact float32 products, summed
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out = z_ptr + n64[:, None] * (G * R) + (g * R + r)[None, :]
    tl.store(out, acc.to(z_ptr.dtype.element_ty), mask=nm[:, None])


@triton.jit
def _expand_stream(x0, x1, x2, x3, y, C_ptr, post_ptr, r64, rmask, j: tl.constexpr):
    """Destination stream ``j``: ``sum_i C[i][j] X[i] + post[j] y`` in fp32; ``r64`` and
    ``rmask`` are the tokens, shaped to broadcast against the tiles."""
    c0 = tl.load(C_ptr + r64 * 16 + 0 + j, mask=rmask, other=0.0)
    c1 = tl.load(C_ptr + r64 * 16 + 4 + j, mask=rmask, other=0.0)
    c2 = tl.load(C_ptr + r64 * 16 + 8 + j, mask=rmask, other=0.0)
    c3 = tl.load(C_ptr + r64 * 16 + 12 + j, mask=rmask, other=0.0)
    q = tl.load(post_ptr + r64 * 4 + j, mask=rmask, other=0.0)
    return (((c0 * x0 + c1 * x1) + c2 * x2) + c3 * x3) + q * y


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _hc_expand_kernel(
    y_ptr,
    X_ptr,
    post_ptr,
    C_ptr,
    out_ptr,
    N,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    X_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out [N, 4, D]`` = the expand of ``y [N, D]`` into ``X [N, 4, D]``."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    m2 = rmask[:, None] & (d[None, :] < D)
    xo = r64[:, None] * (4 * D) + d[None, :]
    x0 = tl.load(X_ptr + xo, mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(X_ptr + xo + D, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + xo + 2 * D, mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(X_ptr + xo + 3 * D, mask=m2, other=0.0).to(tl.float32)
    yv = tl.load(y_ptr + r64[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    for j in tl.static_range(4):
        v = _expand_stream(x0, x1, x2, x3, yv, C_ptr, post_ptr, r64[:, None], rmask[:, None], j)
        tl.store(out_ptr + xo + j * D, _to_stream(v, X_BF16).to(ty), mask=m2)


@triton.jit
def _load_streams(
    X_ptr, xo, m, D, y_ptr, yo, C_prev_ptr, post_prev_ptr, rn, rm, X_out_ptr,
    EXPAND: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """The four streams' chunk at offsets ``xo`` (fp32); with ``EXPAND`` first the previous
    sublayer's expand of ``y`` (offsets ``yo``) into them, stored to ``X_out`` and returned."""
    x0 = tl.load(X_ptr + xo, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(X_ptr + xo + D, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + xo + 2 * D, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(X_ptr + xo + 3 * D, mask=m, other=0.0).to(tl.float32)
    if EXPAND:
        yv = tl.load(y_ptr + yo, mask=m, other=0.0).to(tl.float32)
        n0 = _to_stream(
            _expand_stream(x0, x1, x2, x3, yv, C_prev_ptr, post_prev_ptr, rn, rm, 0), X_BF16
        )
        n1 = _to_stream(
            _expand_stream(x0, x1, x2, x3, yv, C_prev_ptr, post_prev_ptr, rn, rm, 1), X_BF16
        )
        n2 = _to_stream(
            _expand_stream(x0, x1, x2, x3, yv, C_prev_ptr, post_prev_ptr, rn, rm, 2), X_BF16
        )
        n3 = _to_stream(
            _expand_stream(x0, x1, x2, x3, yv, C_prev_ptr, post_prev_ptr, rn, rm, 3), X_BF16
        )
        oty = X_out_ptr.dtype.element_ty
        tl.store(X_out_ptr + xo, n0.to(oty), mask=m)
        tl.store(X_out_ptr + xo + D, n1.to(oty), mask=m)
        tl.store(X_out_ptr + xo + 2 * D, n2.to(oty), mask=m)
        tl.store(X_out_ptr + xo + 3 * D, n3.to(oty), mask=m)
        x0 = n0
        x1 = n1
        x2 = n2
        x3 = n3
    return x0, x1, x2, x3


@triton.jit
def _mix3(xk, fn_ptr, k: tl.constexpr, D, dd, dm3, jj3, acc_pp, acc_c):
    """Add stream ``k``'s chunk ``xk [BN, 1, BD]`` times ``fn``'s matching columns to the mix
    products ``acc_pp`` (pre and post, mixes 0..7 of 16) and ``acc_c`` (mixes 8..23), both
    ``[BN, 16, BD]``: summed over the lanes once after the last chunk, so the loop needs no
    cross-thread reduction and every tile keeps one layout."""
    col = k * D + dd
    rowlen = 4 * D
    fpp = tl.load(fn_ptr + jj3 * rowlen + col, mask=dm3 & (jj3 < 8), other=0.0)
    fc = tl.load(fn_ptr + (jj3 + 8) * rowlen + col, mask=dm3, other=0.0)
    return acc_pp + xk * fpp, acc_c + xk * fc


@triton.jit
def _mix_dot(xk, fn_ptr, k: tl.constexpr, D, d, dmask, jj, acc_pp, acc_c, PRECISION: tl.constexpr):
    """Add stream ``k``'s chunk ``xk [BN, BD]`` times ``fn``'s matching columns to the mix
    accumulators ``acc_pp`` (mixes 0..7 of 16 columns) and ``acc_c`` (mixes 8..23), ``[BN, 16]``,
    with ``tl.dot`` at ``PRECISION`` (``tf32x3``: three TF32 products on the tensor cores,
    float32 accumulation; ``ieee``: float32 FMAs)."""
    rowlen = 4 * D
    col = k * D + d[:, None]
    pp_mask = dmask[:, None] & (jj[None, :] < 8)
    fpp = tl.load(fn_ptr + jj[None, :] * rowlen + col, mask=pp_mask, other=0.0)
    fc = tl.load(fn_ptr + (jj[None, :] + 8) * rowlen + col, mask=dmask[:, None], other=0.0)
    acc_pp = tl.dot(xk, fpp, acc_pp, input_precision=PRECISION)
    acc_c = tl.dot(xk, fc, acc_c, input_precision=PRECISION)
    return acc_pp, acc_c


@triton.jit
def _col(t, jj, c: tl.constexpr):
    """Column ``c`` of ``t [BN, 16]`` as a ``[BN]`` vector (exact: the other terms are 0)."""
    return tl.sum(tl.where(jj[None, :] == c, t, 0.0), axis=1)


@triton.jit
def _recip(s):
    """``1 / s`` within an ulp for a positive normal ``s``: the approximate reciprocal
    (``div.full``) and one Newton step, no branch. An IEEE division compiles to the same
    reciprocal plus a check and a call of the slow path, each inside its own branch region, so
    no two divisions overlap: 8 a Sinkhorn iteration took 0.31 us of the flash site (H100,
    ``reports/gpu/probe_site_flash_h100_9cf8666.json``)."""
    r = tl.fdiv(1.0, s, ieee_rounding=False)
    return tl.fma(r, tl.fma(-s, r, 1.0), r)


@triton.jit
def _norm4(a, b, c, d, eps):
    """``(a, b, c, d) / (a + b + c + d + eps)``, elementwise over the token vectors, as four
    products with one reciprocal (``_recip``): at most an ulp and a rounding more per value
    than the divisions (within the module's ``64u * iters`` bound of ``C``)."""
    r = _recip((((a + b) + c) + d) + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _softmax4(a, b, c, d, eps):
    """Softmax of one row of four logits, plus ``eps``."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a = tl.exp(a - m)
    b = tl.exp(b - m)
    c = tl.exp(c - m)
    d = tl.exp(d - m)
    r = _recip(((a + b) + c) + d)  # the sum is at least 1 (the largest term is exp(0))
    return a * r + eps, b * r + eps, c * r + eps, d * r + eps


@triton.jit
def _site_predict(
    acc_pp, acc_c, ss, r64, rmask, base_ptr, scale_ptr, pre_ptr, post_ptr, C_ptr,
    hc_eps, norm_eps, D: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """pre/post/C of the tokens ``r64`` from their raw mixes ``acc_pp``/``acc_c [BN, 16]`` and
    sums of squares ``ss [BN]``. The 4x4 Sinkhorn matrix of each token is 16 token vectors, so
    every normalization is elementwise (no cross-thread reduction inside the loop)."""
    jj = tl.arange(0, 16)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, 4.0 * D) + norm_eps))
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    bpp = tl.load(base_ptr + jj, mask=jj < 8, other=0.0)
    bc = tl.load(base_ptr + 8 + jj)
    zpp = (acc_pp * r[:, None]) * tl.where(jj < 4, s0, s1)[None, :] + bpp[None, :]
    g = tl.sigmoid(zpp)
    o2 = r64[:, None] * 4 + jj[None, :]
    tl.store(pre_ptr + o2, g + hc_eps, mask=rmask[:, None] & (jj[None, :] < 4))
    post_mask = rmask[:, None] & (jj[None, :] >= 4) & (jj[None, :] < 8)
    tl.store(post_ptr + o2 - 4, 2.0 * g, mask=post_mask)
    z = (acc_c * r[:, None]) * s2 + bc[None, :]
    # C[i][j] = cij: the softmax over j, the column normalization, then (row, column) pairs
    c00, c01, c02, c03 = _softmax4(
        _col(z, jj, 0), _col(z, jj, 1), _col(z, jj, 2), _col(z, jj, 3), hc_eps
    )
    c10, c11, c12, c13 = _softmax4(
        _col(z, jj, 4), _col(z, jj, 5), _col(z, jj, 6), _col(z, jj, 7), hc_eps
    )
    c20, c21, c22, c23 = _softmax4(
        _col(z, jj, 8), _col(z, jj, 9), _col(z, jj, 10), _col(z, jj, 11), hc_eps
    )
    c30, c31, c32, c33 = _softmax4(
        _col(z, jj, 12), _col(z, jj, 13), _col(z, jj, 14), _col(z, jj, 15), hc_eps
    )
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    for _it in range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    cp = C_ptr + r64 * 16
    tl.store(cp + 0, c00, mask=rmask)
    tl.store(cp + 1, c01, mask=rmask)
    tl.store(cp + 2, c02, mask=rmask)
    tl.store(cp + 3, c03, mask=rmask)
    tl.store(cp + 4, c10, mask=rmask)
    tl.store(cp + 5, c11, mask=rmask)
    tl.store(cp + 6, c12, mask=rmask)
    tl.store(cp + 7, c13, mask=rmask)
    tl.store(cp + 8, c20, mask=rmask)
    tl.store(cp + 9, c21, mask=rmask)
    tl.store(cp + 10, c22, mask=rmask)
    tl.store(cp + 11, c23, mask=rmask)
    tl.store(cp + 12, c30, mask=rmask)
    tl.store(cp + 13, c31, mask=rmask)
    tl.store(cp + 14, c32, mask=rmask)
    tl.store(cp + 15, c33, mask=rmask)


@triton.constexpr_function
def _pow2_ceil(n):
    """The smallest power of two >= ``n`` (a compile-time constant)."""
    return triton.next_power_of_2(int(n))


NORM_UNROLL = 8
"""The norm pass (``_site_norm``) of the one-launch forms (``products``, the dot forms) walks
``x`` in chunks of this many ``BLOCK_D`` lanes: each chunk's loads wait once, so the pass costs
``D / (8 * BLOCK_D)`` round trips, not ``D / BLOCK_D``."""

NORM_CHUNK_LANES = 8192
"""Lanes of ``x`` the split form's finishing program (one or two tokens) normalizes a round
trip, as ``norm_chunk`` rounds it (at most ``D`` rounded up to a power of two): one round trip
at hidden 5120 (the last 3072 lanes masked), where 1024 lanes took five. Flash widths, H100:
the site without its FP8 epilogue 8.8 -> 8.1 us at one token, 27.8 -> 26.6 at 64
(``benchmarks/probe_site.py``, ``reports/gpu/probe_site_flash_h100_2af20f1.json``; 2048 and
4096 lanes in between). The chunk does not change a value's arithmetic (the same bits at
every chunk, tested)."""


def norm_chunk(D: int, block_d: int) -> int:
    """``NORM_CHUNK_LANES`` as the split form's ``_site_norm`` chunk: a power of two, at least
    ``block_d`` (a multiple of 32), at most ``D`` rounded up to a power of two."""
    return max(block_d, min(_next_pow2(NORM_CHUNK_LANES), _next_pow2(D)))


@triton.jit
def _site_norm(
    xs, r64, rmask, w_ptr, x_ptr, codes_ptr, scales_ptr, norm_eps,
    D: tl.constexpr, CHUNK: tl.constexpr, QBLOCK: tl.constexpr,
    QUANT: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """Pass 2: RMSNorm of the collapse ``x`` pass 1 stored (sums of squares ``xs [BN]``), in
    place, and its FP8 quant, ``CHUNK`` lanes a round trip (``norm_chunk``). Other threads
    wrote ``x``: a barrier first, loads through L2."""
    tl.debug_barrier()
    rx = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(xs, 1.0 * D) + norm_eps))
    G: tl.constexpr = CHUNK // QBLOCK
    gi = tl.arange(0, G)
    lane = tl.arange(0, QBLOCK)
    ngroups = D // QBLOCK
    xty = x_ptr.dtype.element_ty
    for d0 in range(0, D, CHUNK):
        col = d0 + gi[None, :, None] * QBLOCK + lane[None, None, :]
        cmask = col < D
        m3 = rmask[:, None, None] & cmask
        off = r64[:, None, None] * D + col
        xv = tl.load(x_ptr + off, mask=m3, other=0.0, cache_modifier=".cg").to(tl.float32)
        wv = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        yv = _to_stream((xv * rx[:, None, None]) * wv, X_BF16)
        tl.store(x_ptr + off, yv.to(xty), mask=m3)
        if QUANT:
            code, _deq, sc = _fp8_e4m3_pow2(yv)
            tl.store(codes_ptr + off, code.to(tl.uint8), mask=m3)
            grp = d0 // QBLOCK + gi
            smask = rmask[:, None] & (grp[None, :] < ngroups)
            if scales_ptr.dtype.element_ty == tl.uint8:  # E8M0 bytes: the exponent field
                sc = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
            tl.store(scales_ptr + r64[:, None] * ngroups + grp[None, :], sc, mask=smask)


@triton.jit
def _site_pass1(
    X_ptr, pre_in_ptr, fn_ptr, y_ptr, post_prev_ptr, C_prev_ptr, X_out_ptr, x_ptr, r64, rmask,
    lo, D: tl.constexpr, LANES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXPAND: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """Pass 1 of a site over lanes ``[lo, lo + LANES)`` of the tokens ``r64``, in ``BLOCK_D``
    chunks on ``[BN, 1, BD]`` tiles: the expand (``EXPAND``), the collapse (stored unnormalized
    in ``x``); returns the per-lane mix products ``[BN, 16, BD]`` (pre/post, C) and sums of
    squares ``[BN, 1, BD]`` (streams, collapse), summed over the lanes by the caller."""
    rn = r64[:, None, None]
    rm3 = rmask[:, None, None]
    jj3 = tl.arange(0, 16)[None, :, None]
    p0 = tl.load(pre_in_ptr + rn * 4 + 0, mask=rm3, other=0.0)
    p1 = tl.load(pre_in_ptr + rn * 4 + 1, mask=rm3, other=0.0)
    p2 = tl.load(pre_in_ptr + rn * 4 + 2, mask=rm3, other=0.0)
    p3 = tl.load(pre_in_ptr + rn * 4 + 3, mask=rm3, other=0.0)
    acc_pp = tl.zeros((BLOCK_N, 16, BLOCK_D), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_N, 16, BLOCK_D), dtype=tl.float32)
    ss = tl.zeros((BLOCK_N, 1, BLOCK_D), dtype=tl.float32)
    xs = tl.zeros((BLOCK_N, 1, BLOCK_D), dtype=tl.float32)
    xty = x_ptr.dtype.element_ty
    for c0 in range(0, LANES, BLOCK_D):
        dd = lo + c0 + tl.arange(0, BLOCK_D)[None, None, :]
        dm3 = dd < D
        m3 = rm3 & dm3
        xo = rn * (4 * D) + dd
        x0, x1, x2, x3 = _load_streams(
            X_ptr, xo, m3, D, y_ptr, rn * D + dd, C_prev_ptr, post_prev_ptr, rn, rm3, X_out_ptr,
            EXPAND, X_BF16,
        )  # fmt: skip
        ss += ((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3
        acc_pp, acc_c = _mix3(x0, fn_ptr, 0, D, dd, dm3, jj3, acc_pp, acc_c)
        acc_pp, acc_c = _mix3(x1, fn_ptr, 1, D, dd, dm3, jj3, acc_pp, acc_c)
        acc_pp, acc_c = _mix3(x2, fn_ptr, 2, D, dd, dm3, jj3, acc_pp, acc_c)
        acc_pp, acc_c = _mix3(x3, fn_ptr, 3, D, dd, dm3, jj3, acc_pp, acc_c)
        xc = _to_stream(((p0 * x0 + p1 * x1) + p2 * x2) + p3 * x3, X_BF16)
        xs += xc * xc
        tl.store(x_ptr + rn * D + dd, xc.to(xty), mask=m3)
    return acc_pp, acc_c, ss, xs


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _mhc_site_kernel(
    X_ptr, pre_in_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_prev_ptr, C_prev_ptr,
    X_out_ptr, pre_ptr, post_ptr, C_ptr, x_ptr, codes_ptr, scales_ptr,
    N, hc_eps, norm_eps,
    D: tl.constexpr, ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QBLOCK: tl.constexpr, EXPAND: tl.constexpr, QUANT: tl.constexpr, X_BF16: tl.constexpr,
    NORM_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One mHC site for ``BLOCK_N`` (1 or 2) tokens (hc = 4), optionally behind the previous
    expand: the decode form.

    Pass 1 streams ``X`` once in ``BLOCK_D`` chunks on ``[BN, 1, BD]`` tiles (one layout family,
    ``BLOCK_D = 32 * warps``): the mix products, both sums of squares and the collapse (stored
    unnormalized in ``x``). Then the prediction (``_site_predict``) and pass 2 (``_site_norm``).
    """
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    acc_pp, acc_c, ss, xs = _site_pass1(
        X_ptr, pre_in_ptr, fn_ptr, y_ptr, post_prev_ptr, C_prev_ptr, X_out_ptr, x_ptr, r64,
        rmask, 0, D, D, BLOCK_N, BLOCK_D, EXPAND, X_BF16,
    )  # fmt: skip
    _site_predict(
        tl.sum(acc_pp, axis=2), tl.sum(acc_c, axis=2), tl.sum(tl.sum(ss, axis=2), axis=1),
        r64, rmask, base_ptr, scale_ptr, pre_ptr, post_ptr, C_ptr, hc_eps, norm_eps, D, ITERS,
    )  # fmt: skip
    _site_norm(
        tl.sum(tl.sum(xs, axis=2), axis=1), r64, rmask, w_ptr, x_ptr, codes_ptr, scales_ptr,
        norm_eps, D, NORM_CHUNK, QBLOCK, QUANT, X_BF16,
    )  # fmt: skip


PART_WIDTH = 34
"""Floats of one split program's partial per token: 16 pre/post mixes, 16 C mixes, the sums
of squares of the streams and of the collapse."""


@triton.jit
def _site_finish(
    part_ptr, base_ptr, scale_ptr, w_ptr, pre_ptr, post_ptr, C_ptr, x_ptr, codes_ptr, scales_ptr,
    r64, rmask, hc_eps, norm_eps,
    D: tl.constexpr, ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    NORM_CHUNK: tl.constexpr, QBLOCK: tl.constexpr, QUANT: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """Pass 2 of the split site for the tokens ``r64``: the partials summed by one fixed tree
    (the same sums at every batch width), the prediction (``_site_predict``) and the norm and
    quantizer over ``x`` (``_site_norm``). The partials are read past L1 (``.cg``): other
    programs wrote them."""
    jj = tl.arange(0, 16)[None, None, :]
    sp = tl.arange(0, _pow2_ceil(SPLIT))
    m2 = rmask[:, None] & (sp < SPLIT)[None, :]  # [BN, SPLIT rounded up]
    m3 = m2[:, :, None]
    base = part_ptr + (r64[:, None] * SPLIT + sp[None, :]) * 34
    # every partial in one load each (their latencies overlap), summed by a fixed tree
    pp = tl.load(base[:, :, None] + jj, mask=m3, other=0.0, cache_modifier=".cg")
    cc = tl.load(base[:, :, None] + 16 + jj, mask=m3, other=0.0, cache_modifier=".cg")
    ss = tl.load(base + 32, mask=m2, other=0.0, cache_modifier=".cg")
    xs = tl.load(base + 33, mask=m2, other=0.0, cache_modifier=".cg")
    acc_pp = tl.sum(pp, axis=1)
    acc_c = tl.sum(cc, axis=1)
    ss = tl.sum(ss, axis=1)
    xs = tl.sum(xs, axis=1)
    _site_predict(
        acc_pp, acc_c, ss, r64, rmask, base_ptr, scale_ptr, pre_ptr, post_ptr, C_ptr, hc_eps,
        norm_eps, D, ITERS,
    )  # fmt: skip
    _site_norm(
        xs, r64, rmask, w_ptr, x_ptr, codes_ptr, scales_ptr, norm_eps, D, NORM_CHUNK, QBLOCK,
        QUANT, X_BF16,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _mhc_site_part_kernel(
    X_ptr, pre_in_ptr, fn_ptr, y_ptr, post_prev_ptr, C_prev_ptr, X_out_ptr, x_ptr, part_ptr,
    base_ptr, scale_ptr, w_ptr, pre_ptr, post_ptr, C_ptr, codes_ptr, scales_ptr, count_ptr,
    N, hc_eps, norm_eps,
    D: tl.constexpr, LANES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EXPAND: tl.constexpr, X_BF16: tl.constexpr, ITERS: tl.constexpr,
    QBLOCK: tl.constexpr, QUANT: tl.constexpr, ONE_LAUNCH: tl.constexpr,
    NORM_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Pass 1 of the split site (decode): ``BLOCK_N`` tokens x the ``LANES`` lanes of split
    ``program_id(1)``: the expand (``EXPAND``, stored to ``X_out``), the collapse (stored
    unnormalized in ``x``) and the partial mixes and sums of squares (``part [N, SPLIT, 34]``).
    Splitting the lanes spreads the reading of ``fn`` over ``SPLIT`` programs per token: one
    program streaming all of it is latency-bound (the reason for this form).

    ``ONE_LAUNCH``: the last of a token block's ``SPLIT`` programs to finish its pass 1 runs
    pass 2 (``_site_finish``) itself. Each program counts itself in ``count[program_id(0)]``
    after a CTA barrier (so every thread's stores precede the release); the program that sees
    ``SPLIT - 1`` acquires them all and sets the count back to 0 for the next launch (the
    counters stay zero between launches, so graph replays need no reset)."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(1)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    acc_pp, acc_c, ss, xs = _site_pass1(
        X_ptr, pre_in_ptr, fn_ptr, y_ptr, post_prev_ptr, C_prev_ptr, X_out_ptr, x_ptr, r64,
        rmask, sp * LANES, D, LANES, BLOCK_N, BLOCK_D, EXPAND, X_BF16,
    )  # fmt: skip
    jj = tl.arange(0, 16)
    base = part_ptr + (r64 * SPLIT + sp) * 34
    m2 = rmask[:, None]
    tl.store(base[:, None] + jj[None, :], tl.sum(acc_pp, axis=2), mask=m2)
    tl.store(base[:, None] + 16 + jj[None, :], tl.sum(acc_c, axis=2), mask=m2)
    tl.store(base + 32, tl.sum(tl.sum(ss, axis=2), axis=1), mask=rmask)
    tl.store(base + 33, tl.sum(tl.sum(xs, axis=2), axis=1), mask=rmask)
    if ONE_LAUNCH:
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(count_ptr + tl.program_id(0), 0)
            _site_finish(
                part_ptr, base_ptr, scale_ptr, w_ptr, pre_ptr, post_ptr, C_ptr, x_ptr,
                codes_ptr, scales_ptr, r64, rmask, hc_eps, norm_eps, D, ITERS, SPLIT, BLOCK_N,
                NORM_CHUNK, QBLOCK, QUANT, X_BF16,
            )  # fmt: skip


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _mhc_site_finish_kernel(
    part_ptr, base_ptr, scale_ptr, w_ptr, pre_ptr, post_ptr, C_ptr, x_ptr, codes_ptr, scales_ptr,
    N, hc_eps, norm_eps,
    D: tl.constexpr, ITERS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    NORM_CHUNK: tl.constexpr, QBLOCK: tl.constexpr, QUANT: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """Pass 2 of the split site as its own launch (``SPLIT_ONE_LAUNCH`` off)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    _site_finish(
        part_ptr, base_ptr, scale_ptr, w_ptr, pre_ptr, post_ptr, C_ptr, x_ptr, codes_ptr,
        scales_ptr, rows.to(tl.int64), rmask, hc_eps, norm_eps, D, ITERS, SPLIT, BLOCK_N,
        NORM_CHUNK, QBLOCK, QUANT, X_BF16,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N"])  # one build for every batch width
def _mhc_site_dot_kernel(
    X_ptr, pre_in_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_prev_ptr, C_prev_ptr,
    X_out_ptr, pre_ptr, post_ptr, C_ptr, x_ptr, codes_ptr, scales_ptr,
    N, hc_eps, norm_eps,
    D: tl.constexpr, ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QBLOCK: tl.constexpr, EXPAND: tl.constexpr, QUANT: tl.constexpr, X_BF16: tl.constexpr,
    PRECISION: tl.constexpr, NORM_CHUNK: tl.constexpr,
):  # fmt: skip
    """``_mhc_site_kernel`` for 16 tokens or more per program (prefill): the mix GEMM is a
    ``tl.dot`` per stream and chunk on ``[BN, BD]`` tiles, so ``fn`` is read once per
    ``BLOCK_N`` tokens."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    rn = r64[:, None]
    rm2 = rmask[:, None]
    jj = tl.arange(0, 16)
    p0 = tl.load(pre_in_ptr + rn * 4 + 0, mask=rm2, other=0.0)
    p1 = tl.load(pre_in_ptr + rn * 4 + 1, mask=rm2, other=0.0)
    p2 = tl.load(pre_in_ptr + rn * 4 + 2, mask=rm2, other=0.0)
    p3 = tl.load(pre_in_ptr + rn * 4 + 3, mask=rm2, other=0.0)
    acc_pp = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    ss = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    xs = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    xty = x_ptr.dtype.element_ty
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        m2 = rm2 & dmask[None, :]
        xo = rn * (4 * D) + d[None, :]
        x0, x1, x2, x3 = _load_streams(
            X_ptr, xo, m2, D, y_ptr, rn * D + d[None, :], C_prev_ptr, post_prev_ptr, rn, rm2,
            X_out_ptr, EXPAND, X_BF16,
        )  # fmt: skip
        ss += ((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3
        acc_pp, acc_c = _mix_dot(x0, fn_ptr, 0, D, d, dmask, jj, acc_pp, acc_c, PRECISION)
        acc_pp, acc_c = _mix_dot(x1, fn_ptr, 1, D, d, dmask, jj, acc_pp, acc_c, PRECISION)
        acc_pp, acc_c = _mix_dot(x2, fn_ptr, 2, D, d, dmask, jj, acc_pp, acc_c, PRECISION)
        acc_pp, acc_c = _mix_dot(x3, fn_ptr, 3, D, d, dmask, jj, acc_pp, acc_c, PRECISION)
        xc = _to_stream(((p0 * x0 + p1 * x1) + p2 * x2) + p3 * x3, X_BF16)
        xs += xc * xc
        tl.store(x_ptr + rn * D + d[None, :], xc.to(xty), mask=m2)
    _site_predict(
        acc_pp, acc_c, tl.sum(ss, axis=1), r64, rmask, base_ptr, scale_ptr, pre_ptr, post_ptr,
        C_ptr, hc_eps, norm_eps, D, ITERS,
    )  # fmt: skip
    _site_norm(
        tl.sum(xs, axis=1), r64, rmask, w_ptr, x_ptr, codes_ptr, scales_ptr, norm_eps, D,
        NORM_CHUNK, QBLOCK, QUANT, X_BF16,
    )  # fmt: skip


# --- launchers ----------------------------------------------------------------------------


def _pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two ``<= min(n, cap)`` (at least 1)."""
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _quant_kernel_ok(x: torch.Tensor, block: int) -> bool:
    """Whether the quantizer kernel covers ``x`` (else the torch reference runs)."""
    return (
        x.dtype in _KERNEL_DTYPES
        and x.dim() >= 1
        and x.shape[-1] % block == 0
        and block >= 1
        and block & (block - 1) == 0
        and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))
    )


def _norm_rope_kernel_ok(y: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the norm-RoPE-FP8 kernel covers ``y [N, D]`` (else the composition runs)."""
    d, rd = y.shape[-1], 2 * cos.shape[-1]
    return (
        y.dtype in _KERNEL_DTYPES
        and y.dim() == 2
        and d % 32 == 0
        and (d // 32) & (d // 32 - 1) == 0
        and rd % 2 == 0
        and rd <= d
        and (y.is_cuda or (INTERPRETED and y.device.type == "cpu"))
    )


def _launch_norm_rope(y, weight, eps, cos, sin, quant):
    n, d = y.shape
    out = torch.empty(n, d, dtype=y.dtype, device=y.device)
    if n:
        _norm_rope_fp8_kernel[(n,)](
            y.contiguous(), weight.contiguous(), cos.float().contiguous(),
            sin.float().contiguous(), out, n, float(eps), D=d, RD=2 * cos.shape[-1],
            GROUPS=d // 32, BLOCK=32, X_BF16=y.dtype == torch.bfloat16, QUANT=bool(quant),
            num_warps=4, **pdl_launch(y.device, n),
        )  # fmt: skip
    return out


def _inverse_rope_groups_ok(o: torch.Tensor, cos: torch.Tensor, groups: int) -> bool:
    """Whether the inverse-RoPE kernel covers ``o [N, H, D]`` (else the composition runs)."""
    if o.dim() != 3 or o.dtype not in _KERNEL_DTYPES or groups <= 0 or o.shape[1] % groups:
        return False
    d, rd = o.shape[2], 2 * cos.shape[-1]
    return (
        d & (d - 1) == 0
        and rd <= d
        and o.stride(2) == 1
        and (o.is_cuda or (INTERPRETED and o.device.type == "cpu"))
    )


def _launch_inverse_rope_groups(o, cos, sin, groups):
    n, h, d = o.shape
    out = torch.empty(groups, n, h * d // groups, dtype=o.dtype, device=o.device)
    if n:
        _inverse_rope_groups_kernel[(n, h)](
            o, cos.float().contiguous(), sin.float().contiguous(), out, n, o.stride(0),
            o.stride(1), D=d, RD=2 * cos.shape[-1], HG=h // groups,
            X_BF16=o.dtype == torch.bfloat16, num_warps=4,
            enable_fp_fusion=False,  # products and sums rounded apart, as apply_rope's
            **pdl_launch(o.device, n),
        )  # fmt: skip
    return out


def _rope_wo_a_kernel_ok(o, cos, wo_a, groups) -> bool:
    """Whether the inverse-RoPE grouped ``wo_a`` kernel covers ``o [N, H, D]``."""
    if o.dim() != 3 or wo_a.dim() != 2 or o.dtype not in _KERNEL_DTYPES or wo_a.dtype != o.dtype:
        return False
    _, h, d = o.shape
    kg = h * d // groups if groups and h % groups == 0 else 0
    r = wo_a.shape[0] // groups if groups else 0
    return (
        kg > 0
        and wo_a.shape == (groups * r, kg)
        and r % 16 == 0
        and kg % 64 == 0
        and 2 * cos.shape[-1] <= d
        and (o.is_cuda or (INTERPRETED and o.device.type == "cpu"))
    )


def _launch_rope_wo_a(o, cos, sin, wo_a, groups, tiles=None):
    """Launch ``_rope_wo_a_kernel``; ``tiles`` ``(BR, BK, warps, stages)`` overrides the
    default (``benchmarks/probe_rope_wo_a.py`` sweeps them)."""
    n, h, d = o.shape
    kg, r = h * d // groups, wo_a.shape[0] // groups
    z = torch.empty(n, groups * r, dtype=o.dtype, device=o.device)
    if n:
        bn = min(64, max(16, _next_pow2(n)))
        br = 16 if r % 32 else 32
        # two stages of the [bn, bk] and [br, bk] tiles (float32 at most) stay under ~64 KB of
        # shared memory
        bk = {16: 256, 32: 128, 64: 64}[bn]
        warps, stages = 4, 2
        if tiles is not None:
            br, bk, warps, stages = tiles
        while kg % bk:
            bk //= 2
        if INTERPRETED:  # the interpreter's products, exact in float32 (no tl.dot)
            bn, br, bk = max(1, min(16, _next_pow2(n))), 16, 64
        grid = (groups * (r // br), triton.cdiv(n, bn))
        _rope_wo_a_kernel[grid](
            o.contiguous(), cos.float().contiguous(), sin.float().contiguous(),
            wo_a.contiguous(), z, n, D=d, RD=2 * cos.shape[-1], KG=kg, R=r, G=groups,
            BN=bn, BR=br, BK=bk, X_BF16=o.dtype == torch.bfloat16,
            DOT=0 if INTERPRETED else (1 if o.dtype == torch.bfloat16 else 2),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return z


def _launch_quant(x: torch.Tensor, block: int, dequant: bool):
    """Run the quantizer kernel over ``x [..., K]``: dequantized values, or (codes, scales)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    groups = _pow2_at_most(K // block, max(1, 1024 // block)) if K else 1
    block_m = min(_next_pow2(max(M, 1)), max(1, _QUANT_TILE // (groups * block)))
    grid = (triton.cdiv(M, block_m), triton.cdiv(K // block, groups))
    if dequant:
        out = torch.empty_like(x2)
        codes = scales = out  # unused by the kernel
    else:
        codes = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty((M, K // block), dtype=torch.float32, device=x.device)
        out = x2  # unused by the kernel
    if M and K:
        _fp8_quant_kernel[grid](
            x2, out, codes, scales, M, K, BLOCK_M=block_m, GROUPS=groups, BLOCK=block,
            DEQUANT=dequant, num_warps=4,
        )  # fmt: skip
    if dequant:
        return out.reshape(x.shape)
    lead = x.shape[:-1]
    return codes.view(torch.float8_e4m3fn).reshape(x.shape), scales.reshape(*lead, K // block)


def mix_error_terms(N: int, K: int) -> int:
    """``c`` of the site's mix error bound (module docstring) for ``N`` tokens, ``K = hc * D``:
    ``K`` for float32 products or FMAs, ``6K + 16`` for the ``tf32x3`` GEMM."""
    return 6 * K + 16 if site_config(N, K // _HC)[0] == "tf32x3" else K


def site_config(N: int, D: int = 0) -> tuple[str, int, int, int]:
    """``(mix, tokens per program, lanes per chunk, warps)`` of the site kernel for ``N``
    tokens of hidden width ``D`` (``SITE_CONFIGS``, or ``SITE_CONFIGS_WIDE`` from
    ``WIDE_SITE_D``)."""
    table = SITE_CONFIGS_WIDE if D >= WIDE_SITE_D else SITE_CONFIGS
    return next(cfg for bound, cfg in table if N <= bound)


def codes_in_parallel(N: int, D: int) -> bool:
    """Whether the site's FP8 epilogue (``mhc_site_fp8``) runs one token a program for ``N``
    tokens of width ``D`` (the split form up to 16 tokens), so quantizing in it costs each
    token's finishing program alone, in parallel. Where a program holds more tokens it costs
    more than the quantizer launch it saves (flash_slice at 64 tokens: the sites 2.04 -> 2.84
    ms a step against 80 quantizer launches fewer, 29.80 -> 30.35 ms; at one token 11.32 ->
    11.20, H100, reports/gpu/bench_decode_flash_slice_b*_site_codes_h100_9ab6a02.json)."""
    mix, tokens = site_config(N, D)[:2]
    return mix == "split" and tokens == 1


SPLIT_LANES = 128
"""Lanes of ``D`` per program of the split site's first pass (``"split"``): ``D / 128``
programs per token (8 at hidden 1024)."""


SPLIT_ONE_LAUNCH = True
"""Whether the split site runs as one launch (the last program of a token block finishes it,
``_mhc_site_part_kernel``) instead of a first pass and a finishing launch."""

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_blocks_max() -> int:
    """The most token blocks a split launch of the shipped tables has (512 at wide widths: 1024
    tokens, two a program)."""
    return max(
        triton.cdiv(bound, cfg[1])
        for table in (SITE_CONFIGS, SITE_CONFIGS_WIDE)
        for bound, cfg in table
        if cfg[0] == "split"
    )


def _arrival_counters(dev: torch.device, blocks: int) -> torch.Tensor:
    """The split site's zeroed arrival counters on ``dev``: one int32 per token block, left zero
    by every launch. Allocated on first use for the widest split launch of the tables, so one
    tensor serves every later launch: a captured graph keeps the address it was captured with,
    and a replaced tensor is kept alive, never freed under a graph that reads it."""
    have = _COUNTERS.get(dev)
    if have and have[-1].numel() >= blocks:
        return have[-1]
    return arrival_counters(_COUNTERS, dev, max(64, blocks, _split_blocks_max()))


def split_lanes(D: int, block_d: int) -> tuple[int, int]:
    """``(lanes per program, programs per token)`` of the split site's first pass: chunks of
    ``block_d`` lanes, ``SPLIT_LANES`` (at least one chunk) per program."""
    lanes = max(block_d, SPLIT_LANES // block_d * block_d)
    return lanes, triton.cdiv(D, lanes)


def _site_kernel_ok(X: torch.Tensor, D: int, hc: int, quant_block: int | None) -> bool:
    """Whether the site kernel covers these streams (else the torch reference runs)."""
    ok = (
        X.dtype in _KERNEL_DTYPES
        and hc == _HC
        and X.dim() == 3
        and X.shape[1] == _HC
        and (X.is_cuda or (INTERPRETED and X.device.type == "cpu"))
    )
    if quant_block is not None:
        ok = ok and D % quant_block == 0 and 32 % quant_block == 0
    return ok


def _launch_site(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    iters: int,
    expand: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    quant_block: int | None,
    e8m0: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Run the site kernel: ``(X_out or None, pre, post, C, x, codes or None, scales or
    None)``; ``e8m0``: the scales as E8M0 bytes (``float8_e8m0fnu``), not float32."""
    N, hc, D = X.shape
    dev = X.device
    f32 = torch.float32
    X = X.contiguous()
    pre_in = pre_in.to(f32).contiguous()
    fn = fn.to(f32).contiguous()
    base = base.to(f32).contiguous()
    scale = scale.to(f32).contiguous()
    norm_weight = norm_weight.contiguous()
    pre = torch.empty((N, hc), dtype=f32, device=dev)
    post = torch.empty((N, hc), dtype=f32, device=dev)
    C = torch.empty((N, hc, hc), dtype=f32, device=dev)
    x = torch.empty((N, D), dtype=X.dtype, device=dev)
    qb = quant_block or 32
    codes = torch.empty((N, D), dtype=torch.uint8, device=dev) if quant_block else x
    sdt = torch.uint8 if e8m0 else f32
    scales = torch.empty((N, D // qb), dtype=sdt, device=dev) if quant_block else pre
    if expand is not None:
        y, post_prev, C_prev = expand
        y = y.contiguous()
        post_prev = post_prev.to(f32).contiguous()
        C_prev = C_prev.to(f32).contiguous()
        X_out = torch.empty_like(X)
    else:
        y, post_prev, C_prev, X_out = X, pre_in, pre_in, X  # unused by the kernel
    mix, block_n, block_d, warps = site_config(N, D)
    bf16 = X.dtype == torch.bfloat16
    if N and mix == "split":
        lanes, split = split_lanes(D, block_d)
        part = torch.empty((N, split, PART_WIDTH), dtype=f32, device=dev)
        blocks = triton.cdiv(N, block_n)
        one = SPLIT_ONE_LAUNCH
        count = _arrival_counters(dev, blocks) if one else part
        _mhc_site_part_kernel[(blocks, split)](
            X, pre_in, fn, y, post_prev, C_prev, X_out, x, part,
            base, scale, norm_weight, pre, post, C, codes, scales, count,
            N, float(hc_eps), float(norm_eps), D=D, LANES=lanes, SPLIT=split, BLOCK_N=block_n,
            BLOCK_D=block_d, EXPAND=expand is not None, X_BF16=bf16, ITERS=int(iters),
            QBLOCK=qb, QUANT=quant_block is not None, ONE_LAUNCH=one, num_warps=warps,
            NORM_CHUNK=norm_chunk(D, block_d), **pdl_launch(dev, N),
        )  # fmt: skip
        if not one:
            _mhc_site_finish_kernel[(blocks,)](
                part, base, scale, norm_weight, pre, post, C, x, codes, scales,
                N, float(hc_eps), float(norm_eps), D=D, ITERS=int(iters), SPLIT=split,
                BLOCK_N=block_n, NORM_CHUNK=norm_chunk(D, block_d), QBLOCK=qb,
                QUANT=quant_block is not None, X_BF16=bf16, num_warps=warps,
            )  # fmt: skip
    elif N:
        kernel, extra = _mhc_site_kernel, pdl_launch(dev, N)
        if mix != "products":
            kernel, extra = _mhc_site_dot_kernel, {"PRECISION": mix}
        kernel[(triton.cdiv(N, block_n),)](
            X, pre_in, fn, base, scale, norm_weight, y, post_prev, C_prev, X_out,
            pre, post, C, x, codes, scales,
            N, float(hc_eps), float(norm_eps), D=D, ITERS=int(iters),
            BLOCK_N=block_n, BLOCK_D=block_d, QBLOCK=qb,
            EXPAND=expand is not None, QUANT=quant_block is not None,
            X_BF16=bf16, NORM_CHUNK=block_d * NORM_UNROLL, num_warps=warps, **extra,
        )  # fmt: skip
    return (
        X_out if expand is not None else None,
        pre,
        post,
        C,
        x,
        codes.view(torch.float8_e4m3fn) if quant_block else None,
        (scales.view(torch.float8_e8m0fnu) if e8m0 else scales) if quant_block else None,
    )


def _expand_kernel_ok(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor) -> bool:
    """Whether the expand kernel covers these operands (else the torch reference runs)."""
    return (
        X.dtype in _KERNEL_DTYPES
        and y.dtype in _KERNEL_DTYPES
        and post.dtype == torch.float32
        and X.dim() == 3
        and X.shape[1] == _HC
        and (X.is_cuda or (INTERPRETED and X.device.type == "cpu"))
    )


def _launch_expand(y, X, post, C) -> torch.Tensor:
    """Run the expand kernel over ``X [N, 4, D]``."""
    N, _, D = X.shape
    X = X.contiguous()
    out = torch.empty_like(X)
    if N and D:
        block_d = _pow2_at_most(D, 256)
        block_n = max(1, min(_next_pow2(N), 1024 // block_d))
        grid = (triton.cdiv(N, block_n), triton.cdiv(D, block_d))
        _hc_expand_kernel[grid](
            y.contiguous(), X, post.contiguous(), C.contiguous(), out, N, D,
            BLOCK_N=block_n, BLOCK_D=block_d, X_BF16=X.dtype == torch.bfloat16, num_warps=4,
            **pdl_launch(X.device, N),
        )  # fmt: skip
    return out


# --- custom ops (opaque to torch.compile) ---------------------------------------------------


def _params(fn, base, scale) -> HcParams:
    return HcParams(fn, base, scale)


@torch.library.custom_op("v41plan::fp8_act_quant", mutates_args=())
def _fp8_act_quant_op(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``float8_e4m3fn``, pow2 float32 scales) of ``x``; see ``fp8_act_quant``."""
    if _quant_kernel_ok(x, block):
        return _launch_quant(x, block, dequant=False)
    return dense_ref.fp8_act_quant(x, block)


@_fp8_act_quant_op.register_fake
def _(x, block):
    lead = x.shape[:-1]
    return (
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
        x.new_empty((*lead, x.shape[-1] // block), dtype=torch.float32),
    )


@torch.library.custom_op("v41plan::fake_fp8", mutates_args=())
def _fake_fp8_op(x: torch.Tensor, block: int) -> torch.Tensor:
    """``quant.fake_fp8(x, block)`` with the quantizer on (the wrapper checks the switch)."""
    if _quant_kernel_ok(x, block):
        return _launch_quant(x, block, dequant=True)
    with Q.fake_quant(True):
        return Q.fake_fp8(x, block).contiguous().clone()


@_fake_fp8_op.register_fake
def _(x, block):
    return x.new_empty(x.shape)  # contiguous, as the kernel's output (not ``x``'s strides)


@torch.library.custom_op("v41plan::norm_rope_fp8", mutates_args=())
def _norm_rope_fp8_op(
    y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    quant: bool,
) -> torch.Tensor:  # fmt: skip
    """``norm_rope_fp8`` (the switch read by the wrapper: ``quant``)."""
    if _norm_rope_kernel_ok(y, cos):
        return _launch_norm_rope(y, weight, eps, cos, sin, quant)
    with Q.fake_quant(quant):
        return dense_ref.norm_rope_fp8(y, weight, eps, cos, sin).contiguous().clone()


@_norm_rope_fp8_op.register_fake
def _(y, weight, eps, cos, sin, quant):
    return y.new_empty(y.shape)


@torch.library.custom_op("v41plan::inverse_rope_groups", mutates_args=())
def _inverse_rope_groups_op(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int
) -> torch.Tensor:
    """``inverse_rope_groups``."""
    if _inverse_rope_groups_ok(o, cos, groups):
        return _launch_inverse_rope_groups(o, cos, sin, groups)
    return dense_ref.inverse_rope_groups(o, cos, sin, groups).clone()


@_inverse_rope_groups_op.register_fake
def _(o, cos, sin, groups):
    n, h, d = o.shape
    return o.new_empty((groups, n, h * d // groups))


@torch.library.custom_op("v41plan::rope_wo_a", mutates_args=())
def _rope_wo_a_op(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int
) -> torch.Tensor:
    """``rope_wo_a``."""
    if _rope_wo_a_kernel_ok(o, cos, wo_a, groups):
        return _launch_rope_wo_a(o, cos, sin, wo_a, groups)
    return dense_ref.rope_wo_a(o, cos, sin, wo_a, groups).contiguous()


@_rope_wo_a_op.register_fake
def _(o, cos, sin, wo_a, groups):
    return o.new_empty((o.shape[0], wo_a.shape[0]))


@torch.library.custom_op("v41plan::hc_expand", mutates_args=())
def _hc_expand_op(
    y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """``layers.hc_expand(y, X, post, C)`` as one kernel."""
    if _expand_kernel_ok(y, X, post):
        return _launch_expand(y, X, post, C)
    return dense_ref.hc_expand(y, X, post, C).contiguous()


@_hc_expand_op.register_fake
def _(y, X, post, C):
    return X.new_empty(X.shape)  # contiguous, as the kernel's output


def _scale_dtype(e8m0: bool) -> torch.dtype:
    """The site's scale format: E8M0 bytes or float32 powers of two."""
    return torch.float8_e8m0fnu if e8m0 else torch.float32


def _empty_codes(X: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, scales) placeholders of a site run without the quantizer: ``[N, 0]``."""
    n = X.shape[0]
    return (
        X.new_empty((n, 0), dtype=torch.float8_e4m3fn),
        X.new_empty((n, 0), dtype=_scale_dtype(e8m0)),
    )


def _site_fake(X, quant_block, e8m0=False):
    n, hc, D = X.shape
    f32 = torch.float32
    qb = quant_block if quant_block > 0 else None
    codes = X.new_empty((n, D if qb else 0), dtype=torch.float8_e4m3fn)
    scales = X.new_empty((n, D // qb if qb else 0), dtype=_scale_dtype(e8m0))
    return (
        X.new_empty((n, hc), dtype=f32),
        X.new_empty((n, hc), dtype=f32),
        X.new_empty((n, hc, hc), dtype=f32),
        X.new_empty((n, D)),
        codes,
        scales,
    )


def _site_ref(X, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, qb, e8m0=False):
    """The torch composition behind the site op (operands the kernel does not cover)."""
    hc = X.shape[1]
    p = _params(fn, base, scale)
    if qb:
        args = (X, pre_in, p, norm_weight, hc, iters, hc_eps, norm_eps, qb)
        return dense_ref.mhc_site_fp8(*args, e8m0=e8m0)
    out = dense_ref.mhc_site(X, pre_in, p, norm_weight, hc, iters, hc_eps, norm_eps)
    return (*out, *_empty_codes(X, e8m0))


@torch.library.custom_op("v41plan::mhc_site", mutates_args=())
def _mhc_site_op(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    iters: int,
    quant_block: int,
    e8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, C, x, codes, scales) of one site; ``quant_block`` 0: no quantizer (codes
    and scales ``[N, 0]``); ``e8m0``: the scales as E8M0 bytes (what the W8A8 GEMM reads)."""
    qb = quant_block if quant_block > 0 else None
    if _site_kernel_ok(X, X.shape[-1], X.shape[1], qb) and fn.dtype == torch.float32:
        _, pre, post, C, x, codes, scales = _launch_site(
            X, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, None, qb, e8m0
        )
        if qb is None:
            codes, scales = _empty_codes(X, e8m0)
        return pre, post, C, x, codes, scales
    return tuple(
        _site_ref(X, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, qb, e8m0)
    )


@_mhc_site_op.register_fake
def _(X, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, quant_block, e8m0=False):
    return _site_fake(X, quant_block, e8m0)


@torch.library.custom_op("v41plan::mhc_expand_site", mutates_args=())
def _mhc_expand_site_op(
    y: torch.Tensor,
    X: torch.Tensor,
    post_prev: torch.Tensor,
    C_prev: torch.Tensor,
    pre_in: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    iters: int,
    quant_block: int,
    e8m0: bool = False,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """(X2, pre, post, C, x, codes, scales): the expand into ``X`` then the site on ``X2``."""
    qb = quant_block if quant_block > 0 else None
    if (
        _site_kernel_ok(X, X.shape[-1], X.shape[1], qb)
        and _expand_kernel_ok(y, X, post_prev)
        and fn.dtype == torch.float32
    ):
        X2, pre, post, C, x, codes, scales = _launch_site(
            X, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters,
            (y, post_prev, C_prev), qb, e8m0,
        )  # fmt: skip
        if qb is None:
            codes, scales = _empty_codes(X, e8m0)
        return X2, pre, post, C, x, codes, scales
    X2 = dense_ref.hc_expand(y, X, post_prev, C_prev)
    site = _site_ref(X2, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, qb, e8m0)
    return (X2, *site)


@_mhc_expand_site_op.register_fake
def _(
    y, X, post_prev, C_prev, pre_in, fn, base, scale, norm_weight, hc_eps, norm_eps, iters, qb,
    e8m0=False,
):  # fmt: skip
    return (X.new_empty(X.shape), *_site_fake(X, qb, e8m0))


# --- drop-in wrappers (the torch functions' call shapes) ------------------------------------


def fp8_act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 activation format of ``x [..., K]`` in one kernel: E4M3 codes
    (``float8_e4m3fn [..., K]``) and pow2 float32 scales ``[..., K/block]``;
    ``codes * scales == quant.fake_fp8(x, block)`` bit for bit."""
    return torch.ops.v41plan.fp8_act_quant(x, block)


def fake_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``quant.fake_fp8(x, block)`` in one kernel, bit for bit (fp32 and bf16; float64 takes
    the reference). Honours ``set_fake_quant``."""
    if not Q.fake_quant_enabled():
        return x
    return torch.ops.v41plan.fake_fp8(x, block)


def norm_rope_fp8(
    y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``dense_ref.norm_rope_fp8`` (the window-KV epilogue: RMSNorm, RoPE, FP8) in one kernel
    over rows ``y [N, D]``. The norm's sum and its ``rsqrt`` are the kernel's own, so a lane can
    differ from the composition by one rounding of the stream dtype (and, after it, one E4M3
    step); the RoPE and the quantizer then round where the composition rounds."""
    return torch.ops.v41plan.norm_rope_fp8(y, weight, eps, cos, sin, Q.fake_quant_enabled())


def inverse_rope_groups(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int
) -> torch.Tensor:
    """``dense_ref.inverse_rope_groups`` in one kernel: the output projection's inverse RoPE of
    ``o [N, H, D]``, written as ``[groups, N, H * D / groups]`` (what the grouped ``wo_a``
    product reads without a copy). Bit-identical to the composition: the rotation's products
    and sums round where ``apply_rope``'s do (no fused multiply-adds)."""
    return torch.ops.v41plan.inverse_rope_groups(o, cos, sin, groups)


def rope_wo_a(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int
) -> torch.Tensor:
    """``dense_ref.rope_wo_a`` (the output projection's inverse RoPE and grouped ``wo_a``) in one
    kernel: ``[N, groups * o_lora_rank]``. Not used by the runtime yet: on the H200 it measured
    41 us against the composition's 29 us at one row and 273 us against 31 us at 64
    (``benchmarks/probe_rope_wo_a.py``), bit-identical to it; kept with its tests and probe as
    the starting point of the fused output projection. The RoPE rounds where the composition
    rounds; the products accumulate in float32 in the kernel's own order (bf16 operands, as
    the cuBLAS product of the composition; float32 operands in IEEE precision)."""
    return torch.ops.v41plan.rope_wo_a(o, cos, sin, wo_a, groups)


def hc_expand(
    y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """``layers.hc_expand`` in one kernel: ``X'[j] = post[j] * y + sum_i C[i][j] * X[i]``."""
    return torch.ops.v41plan.hc_expand(y, X, post, C)


def mhc_site(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dense_ref.mhc_site`` in one kernel: ``(pre, post, C, x)``."""
    if hc != X.shape[1]:
        raise ValueError(f"hc {hc} does not match the streams' shape {tuple(X.shape)}")
    out = torch.ops.v41plan.mhc_site(
        X, pre_in, p.fn, p.base, p.scale, norm_weight, hc_eps, norm_eps, iters, 0
    )
    return out[0], out[1], out[2], out[3]


def mhc_site_fp8(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    block: int = 32,
    e8m0: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``dense_ref.mhc_site_fp8`` in one kernel: ``(pre, post, C, x, codes, scales)``, the
    codes and scales being ``fp8_act_quant(x, block)`` (``e8m0``: the scales as E8M0 bytes,
    the W8A8 GEMM's input format)."""
    if hc != X.shape[1]:
        raise ValueError(f"hc {hc} does not match the streams' shape {tuple(X.shape)}")
    return tuple(
        torch.ops.v41plan.mhc_site(
            X, pre_in, p.fn, p.base, p.scale, norm_weight, hc_eps, norm_eps, iters, block, e8m0
        )
    )


def mhc_expand_site(
    y: torch.Tensor,
    X: torch.Tensor,
    post_prev: torch.Tensor,
    C_prev: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, ...]:
    """``dense_ref.mhc_expand_site`` in one kernel: ``(X2, pre, post, C, x)``."""
    if hc != X.shape[1]:
        raise ValueError(f"hc {hc} does not match the streams' shape {tuple(X.shape)}")
    out = torch.ops.v41plan.mhc_expand_site(
        y, X, post_prev, C_prev, pre_in, p.fn, p.base, p.scale, norm_weight,
        hc_eps, norm_eps, iters, 0,
    )  # fmt: skip
    return out[0], out[1], out[2], out[3], out[4]


def mhc_expand_site_fp8(
    y: torch.Tensor,
    X: torch.Tensor,
    post_prev: torch.Tensor,
    C_prev: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    block: int = 32,
    e8m0: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``dense_ref.mhc_expand_site_fp8`` in one kernel: ``(X2, pre, post, C, x, codes,
    scales)`` (``e8m0`` as in ``mhc_site_fp8``)."""
    if hc != X.shape[1]:
        raise ValueError(f"hc {hc} does not match the streams' shape {tuple(X.shape)}")
    return tuple(
        torch.ops.v41plan.mhc_expand_site(
            y, X, post_prev, C_prev, pre_in, p.fn, p.base, p.scale, norm_weight,
            hc_eps, norm_eps, iters, block, e8m0,
        )
    )  # fmt: skip


class TritonDense:
    """The fused dense pieces as one object (``dense_ref`` has the same functions)."""

    name = "triton"
    fp8_act_quant = staticmethod(fp8_act_quant)
    fake_fp8 = staticmethod(fake_fp8)
    norm_rope_fp8 = staticmethod(norm_rope_fp8)
    inverse_rope_groups = staticmethod(inverse_rope_groups)
    rope_wo_a = staticmethod(rope_wo_a)
    hc_expand = staticmethod(hc_expand)
    mhc_site = staticmethod(mhc_site)
    mhc_site_fp8 = staticmethod(mhc_site_fp8)
    mhc_expand_site = staticmethod(mhc_expand_site)
    mhc_expand_site_fp8 = staticmethod(mhc_expand_site_fp8)
    codes_in_parallel = staticmethod(codes_in_parallel)
