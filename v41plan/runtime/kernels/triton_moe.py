"""Grouped W4A8 MoE in Triton over the selected experts only.

Three launches after the routing and ``moe_torch.align_rows`` (the same permutation as the
torch implementation, padded to the kernel's ``block_m``):

1. ``_gate_up_kernel``: per (row block, intermediate tile) one expert's ``w1`` and ``w3`` tiles,
   FP4 codes decoded in the kernel (E2M1 nibbles, E8M0 per 32 along K), against the token rows'
   FP8 input gathered in place; the clamped SwiGLU times the routing weight, then the FP8
   quantization of the intermediate (E4M3, E8M0 per 32) in the epilogue;
2. ``_down_kernel``: the grouped ``w2`` GEMM of those rows, rounded to the compute dtype;
3. ``_combine_kernel``: each token's ``k`` rows summed in slot order (deterministic, no
   atomics) plus an optional addend (the shared expert), float32.

Blocks past the last expert return at once, so the grid is the worst case and nothing syncs
with the host. Arithmetic matches ``moe_torch.grouped_moe_torch`` (and ``layers.MoE``) up to
float32 summation order; a near-tie of the intermediate's FP8 rounding can then take the other
side (one E4M3 step of one lane), which the tests allow for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from v41plan.model.quant import QuantWeight
from v41plan.runtime.kernels.moe_torch import MoERows, align_rows, padded_rows
from v41plan.runtime.kernels.triton_common import interpreted, pdl_enter, pdl_launch
from v41plan.runtime.kernels.triton_gemm import (
    DOT_MODES,
    default_dot,
    load_a_tile,
    qdot,
    swiglu_fp8,
)
from v41plan.runtime.kernels.triton_quant import (
    QUANT_BLOCK,
    decode_e4m3,
    e8m0_value,
    round_bf16,
)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two grouped GEMMs (``block_m`` is also the permutation's padding)."""

    block_m: int
    """Rows per block: every block holds one expert's rows."""
    block_n: int
    """Intermediate lanes per gate/up program (a multiple of 32: the epilogue quantizes)."""
    block_n_down: int
    """Output lanes per down program."""
    block_k: int
    """K lanes per step (a multiple of 32; the ``"fp8"`` mode walks its 32-lane blocks
    unrolled)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth."""
    prefetch: bool = False
    """bf16 and fp32 modes: each K step's raw tiles (FP4 bytes, FP8 codes, their scale bytes)
    are loaded one step ahead, into registers, so their latency overlaps the step before
    (Triton pipelines only loads that feed a dot directly; these feed the decode first). The
    same arithmetic."""
    pairs: bool = False
    """Each K step as two dots, over its even and its odd lanes: the weight operands are the
    packed bytes' low and high nibbles, decoded in place (on CUDA in the bf16 mode two codes
    per 32-bit instruction, ``E2M1_PAIRS_ASM``), and the activations are bf16 rows stored
    deinterleaved (``deinterleave_fp8`` before the launch; the gate/up epilogue writes the
    intermediate so too), so nothing is interleaved or decoded twice. The same products; the
    float32 sums in another order."""
    tma: bool = False
    """With ``pairs``: the activation and FP4 code tiles read by TMA descriptors (no
    per-element address or mask arithmetic, vectorized copies to shared memory). The input rows
    are first written in the kernels' row order (``deinterleave_rows``: the permuted, padded
    rows, zeros for padding), so a row block is contiguous; the scale bytes are loaded one K
    step ahead. CUDA sm_90+ (or Triton's interpreter), 16-byte aligned code rows. The pairs
    mode's sums, bit for bit."""
    max_registers: int | None = None
    """A cap on each thread's registers (the compiler's ``maxnreg``; None: its own choice). Fewer
    registers let more programs share a multiprocessor: the decode gate/up holds 152, so three
    4-warp programs fit and one token's 432 live programs take 1.1 waves; at 128, four fit and
    they take one. The same arithmetic (the compiler spills what does not fit). NVIDIA only:
    launches on a ROCm device leave it out."""


def default_moe_dot(device: torch.device) -> str:
    """The grouped MoE's dot mode: ``"bf16"`` on CUDA at every row count (an 8K prefill's routed
    experts 35.8 -> 17.0 ms against the FP8 mode, decode within 5% and a little ahead with its
    tiles: reports/gpu/bench_gemm_moe_sweep2.json), ``default_dot``'s elsewhere."""
    return "bf16" if device.type == "cuda" else default_dot(device)


def default_moe_config(rows: int, dot: str, hidden: int = 128, inter: int = 128) -> MoEConfig:
    """Tiles for ``rows = N * k`` routed rows: narrow blocks for decode, wide for prefill."""
    if dot == "fp32" and not torch.cuda.is_available():
        # Triton's interpreter: its cost is per operation, not per element, so few wide tiles
        bi = max(32, min(128, triton.next_power_of_2(inter)))
        bd = max(32, min(128, triton.next_power_of_2(hidden)))
        return MoEConfig(16, bi, bd, max(bi, bd), num_warps=1, num_stages=1)
    bk = 32 if dot == "fp8" else 64
    # bf16 on CUDA: even and odd lanes apart (pairs; reports/gpu/bench_gemm_moe_sweep3.json,
    # flash_slice widths: decode 1 / 64 0.177 / 0.851 -> 0.100 / 0.365 ms with 32 / 64
    # gate/up lanes a program; the tiles by TMA lose there, 0.111 / 0.463) and, at 8K routed
    # rows, with the tiles by TMA too (17.0 -> 9.75 ms); grouped_moe_w4a8 drops tma where the
    # device or the weights cannot take it. A program's lanes do not change any sum.
    cuda_bf16 = dot == "bf16" and torch.cuda.is_available()
    if rows <= 1024:  # decode: narrow gate/up tiles
        if dot == "bf16" and rows <= 16:
            # four programs a multiprocessor at 128 registers, not three at 152: one token's
            # routed experts 93.4 -> 89.0 us; the 64-lane tiles lose with the cap (8 tokens 252
            # -> 280 us; H100, bench_gemm_moe_occupancy_h100_30f483e.json)
            regs = 128 if cuda_bf16 and torch.version.hip is None else None
            return MoEConfig(16, 32, 64, 256, 4, 3, pairs=cuda_bf16, max_registers=regs)
        if dot == "bf16":
            return MoEConfig(16, 64, 64, 256, num_warps=4, num_stages=3, pairs=cuda_bf16)
        return MoEConfig(16, 32, 64, 128 if dot == "fp8" else bk, num_warps=4, num_stages=3)
    if dot == "bf16" and rows >= 8192:
        # 128-row blocks (17.0 ms against 24.9 with 64 at an 8K prefill, bench_gemm_moe_sweep2);
        # below 8K routed rows the padding of every expert's group to 128 would weigh (not
        # measured)
        fast = {"pairs": True, "tma": True} if cuda_bf16 else {}
        return MoEConfig(128, 128, 128, 128 if fast else 64, num_warps=8, num_stages=3, **fast)
    return MoEConfig(64, 128, 128, bk, num_warps=8, num_stages=3)


PAIRS_ASM = True
"""``MoEConfig.pairs`` in the bf16 mode on CUDA decodes by ``E2M1_PAIRS_ASM`` and
``E4M3_PAIRS_ASM``; False: by Triton's operations (the same values; a test compares them)."""

FOLDED_SCALES = True
"""Whether the asm decode (``PAIRS_ASM``) of weights whose E8M0 scale fields all lie in
``[1, FOLD_MAX_FIELD]`` (``scales_fold``, checked at load: scales up to 2) multiplies each pair by
its scale times ``2**126`` in one instruction (``E2M1_PAIRS_FOLDED_ASM``) instead of by
``2**126`` and then by the scale: the same exact products, one instruction fewer a pair of
codes (the one-token gate/up loop 672 -> 606 SASS instructions a 256-lane step, sm_90 build:
``scripts/check_dense_kernels_sm90.py --hidden 5120 --only "moe gate_up" --strides16
--loop-histogram``). The same bits on an H100 (``tests/gpu/test_resident_gpu.py -k grouped``);
flash_slice decode step, H100: batch 1 11.70 -> 11.37 ms, batch 64 30.28 -> 28.89
(``bench_decode_flash_slice_b1_folded_bf16rows_h100_8a9cd7d.json``, ``..._b64_...``; the
other side: ``bench_decode_paths.py`` variant ``compiled_unfolded_scales``)."""

FOLD_MAX_FIELD = 128
"""The largest E8M0 field whose scale times ``2**126`` is a bf16 value (``2**127``)."""


def scales_fold(*weights: QuantWeight) -> bool:
    """Whether every scale field of ``weights`` lies in ``[1, FOLD_MAX_FIELD]`` (one reduction
    each, at load): their scales times ``2**126`` are bf16 powers of two, and byte 0 (no scale
    in the kernels' convention) does not occur."""
    for w in weights:
        f = w.scales.view(torch.uint8)
        if f.numel() and not bool(((f >= 1) & (f <= FOLD_MAX_FIELD)).all()):
            return False
    return True


ALIGN_MAX_ROWS = 4096
"""Routed rows (``N * k``) up to which ``align_rows_fused`` permutes in one Triton program;
above it (long prefill chunks) the torch permutation runs."""

ALIGN_ONE_HOT_ELEMS = 1 << 15
"""``experts x rows`` (powers of two) up to which the permutation ranks every row in one
``[experts, rows]`` one-hot prefix sum instead of a loop over experts (decode: 32 or 48
experts by 512 rows at batch 64)."""


@triton.jit
def _align_rows_kernel(
    ids_ptr, row_ids_ptr, pos_ptr, ends_ptr, be_ptr, nk, R, expert_first,
    E: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
    GBLOCKS: tl.constexpr, ONE_HOT: tl.constexpr = False, EP: tl.constexpr = 1,
    RB: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """``moe_torch.align_rows`` in one program: the ``nk`` flat rows (``BLOCK`` lanes) ranked
    within their local expert by a prefix sum per expert (the stable sort's order: token, then
    slot), each expert's group padded to ``BM``; ``R`` padded positions (``RBLOCK`` lanes). No
    loop bound is read from an argument, so the interpreter runs it as it is. ``ONE_HOT``: the
    ``[EP, BLOCK]`` one-hot of the rows' experts (``EP`` a power of two >= ``E``) ranks every
    row in one prefix sum along the rows, the experts' padded ends in one along the experts,
    and each ``BM`` block's expert counts the ends at or below its start (``searchsorted``),
    where the loop runs ``E`` dependent steps: the same integers."""
    pdl_enter(PDL)
    i = tl.arange(0, BLOCK)
    imask = i < nk
    e = tl.load(ids_ptr + i, mask=imask, other=0).to(tl.int64) - expert_first
    local = imask & (e >= 0) & (e < E)
    r = tl.arange(0, RBLOCK)  # padding: no row, no expert
    tl.store(row_ids_ptr + r, tl.full([RBLOCK], -1, tl.int64), mask=r < R)
    if ONE_HOT:
        gg = tl.arange(0, EP)
        oh = (local[None, :] & (e[None, :] == gg[:, None])).to(tl.int16)  # [EP, BLOCK]
        pad_e = (tl.sum(oh.to(tl.int32), axis=1) + BM - 1) // BM * BM
        ends_e = tl.cumsum(pad_e, axis=0)  # experts past E count no row: their ends repeat
        start_e = ends_e - pad_e
        rank_e = tl.cumsum(oh, axis=1).to(tl.int32) - 1  # below 2**15: BLOCK <= 4096
        pos_e = tl.sum(tl.where(oh != 0, start_e[:, None] + rank_e, 0), axis=0).to(tl.int64)
        ppos = tl.where(local, pos_e, -1)
        tl.store(ends_ptr + gg, ends_e, mask=gg < E)
        bb = tl.arange(0, RB)  # the R // BM row blocks
        g_of = tl.sum((ends_e[None, :] <= (bb * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(be_ptr + bb, tl.where(g_of < E, g_of, -1), mask=bb < R // BM)
        tl.debug_barrier()  # the row stores below land on the padding
    else:
        tl.store(be_ptr + r, tl.full([RBLOCK], -1, tl.int32), mask=r < R // BM)
        tl.debug_barrier()  # the stores below land on the padding
        ppos = tl.full([BLOCK], -1, tl.int64)
        end = tl.zeros([1], dtype=tl.int64)
        for g in range(E):
            m = local & (e == g)
            mi = m.to(tl.int64)
            rank = tl.cumsum(mi, axis=0) - 1
            ppos = tl.where(m, tl.sum(end, axis=0) + rank, ppos)
            padded = (tl.sum(mi, axis=0) + BM - 1) // BM * BM
            start = tl.sum(end, axis=0)
            tl.store(ends_ptr + g + tl.zeros([1], dtype=tl.int32), (end + padded).to(tl.int32))
            blk = tl.arange(0, GBLOCKS)  # an expert's blocks: at most cdiv(nk, BM)
            tl.store(
                be_ptr + start // BM + blk,
                tl.full([GBLOCKS], g, tl.int32),
                mask=blk < padded // BM,
            )
            end += padded
    tl.store(pos_ptr + i, ppos, mask=imask)
    tl.store(row_ids_ptr + ppos, i.to(tl.int64), mask=imask & (ppos >= 0))


def align_rows_fused(
    ids: torch.Tensor, expert_first: int, expert_count: int, block_m: int
) -> MoERows:
    """``moe_torch.align_rows`` (the same integers) as one Triton launch up to
    ``ALIGN_MAX_ROWS`` routed rows on CUDA (or under the interpreter); the torch permutation
    otherwise."""
    n, k = ids.shape
    nk = n * k
    interp = ids.device.type == "cpu" and interpreted(_align_rows_kernel)
    if not (ids.is_cuda or interp) or nk > ALIGN_MAX_ROWS or nk == 0:
        return align_rows(ids, expert_first, expert_count, block_m)
    dev = ids.device
    R = padded_rows(n, k, expert_count, block_m)
    row_ids = torch.empty(R, dtype=torch.int64, device=dev)
    pos = torch.empty(nk, dtype=torch.int64, device=dev)
    ends = torch.empty(expert_count, dtype=torch.int32, device=dev)
    be = torch.empty(R // block_m, dtype=torch.int32, device=dev)
    block = max(16, triton.next_power_of_2(nk))
    rblock = triton.next_power_of_2(R)
    ep = max(2, triton.next_power_of_2(expert_count))
    rb = max(2, triton.next_power_of_2(R // block_m))
    one_hot = ep * block <= ALIGN_ONE_HOT_ELEMS and ep * rb <= ALIGN_ONE_HOT_ELEMS
    _align_rows_kernel[(1,)](
        ids.reshape(nk).contiguous(), row_ids, pos, ends, be, nk, R, int(expert_first),
        E=expert_count, BM=block_m, BLOCK=block, RBLOCK=rblock,
        GBLOCKS=triton.next_power_of_2(-(-nk // block_m)), ONE_HOT=one_hot, EP=ep, RB=rb,
        num_warps=8 if one_hot or block > 1024 else 4, **pdl_launch(dev, n),
    )  # fmt: skip
    return MoERows(row_ids, pos, ends, be, block_m)


@triton.jit
def e2m1_pair_bytes(p):
    """Packed E2M1 bytes (even lane in the low nibble) -> (low, high) E4M3 bytes of the codes'
    values times ``2**-6``: the sign to bit 7 and the three magnitude bits to bits 2-4, where
    E2M1's exponent and mantissa become E4M3's low exponent bits and top mantissa bit (the
    subnormal 0.5 lands on E4M3's subnormal ``2**-7``): four integer operations a code and no
    compare (the exact E4M3 bytes would need a case for the subnormal); the caller multiplies
    the block scale by 64."""
    p = p.to(tl.int32)
    lo = ((p << 4) & 0x80) | ((p << 2) & 0x1C)
    hi = (p & 0x80) | ((p >> 2) & 0x1C)
    return lo, hi


@triton.jit
def fp4_raw(w_ptr, s_ptr, rn, k0, nmask, swn, ssn, K: tl.constexpr, BK: tl.constexpr):
    """The raw ``[BN, BK]`` tile of a packed E2M1 weight at lanes ``k0..``: (packed bytes
    ``[BN, BK/2]``, E8M0 bytes ``[BN, BK/32]``); zeros past ``K``."""
    rp = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(
        w_ptr + rn[:, None] * swn + rp[None, :],
        mask=nmask[:, None] & (rp < K // 2)[None, :],
        other=0,
    )
    kbi = k0 // 32 + tl.arange(0, BK // 32)
    fmask = nmask[:, None] & (kbi < K // 32)[None, :]
    return p, tl.load(s_ptr + rn[:, None] * ssn + kbi[None, :], mask=fmask, other=0)


@triton.jit
def fp4_bf16(p, fld, BN: tl.constexpr, BK: tl.constexpr):
    """``fp4_raw``'s tile as bf16 values: the codes by ``e2m1_pair_bytes`` and the E4M3
    conversion, times their block scales (and 64) in float32, then bf16 (exact)."""
    lo, hi = e2m1_pair_bytes(p)
    v = tl.interleave(lo, hi).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sc = e8m0_value(fld) * 64.0
    return tl.reshape(tl.reshape(v, [BN, BK // 32, 32]) * sc[:, :, None], [BN, BK]).to(tl.bfloat16)


@triton.jit
def fp8_rows_raw(x_ptr, xs_ptr, rows, k0, rmask, sxm, sxsm, K: tl.constexpr, BK: tl.constexpr):
    """The raw ``[BM, BK]`` tile of FP8 activations (rows ``rows``, lanes ``k0..``): (E4M3
    bytes, E8M0 bytes ``[BM, BK/32]``); zeros past ``K``."""
    rk = k0 + tl.arange(0, BK)
    bits = tl.load(
        x_ptr + rows[:, None] * sxm + rk[None, :], mask=rmask[:, None] & (rk < K)[None, :], other=0
    )
    kbi = k0 // 32 + tl.arange(0, BK // 32)
    fmask = rmask[:, None] & (kbi < K // 32)[None, :]
    return bits, tl.load(xs_ptr + rows[:, None] * sxsm + kbi[None, :], mask=fmask, other=0)


@triton.jit
def fp8_rows_bf16(bits, fld, BM: tl.constexpr, BK: tl.constexpr):
    """``fp8_rows_raw``'s tile as bf16 values (exact: E4M3 times a power of two)."""
    v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(tl.reshape(v, [BM, BK // 32, 32]) * e8m0_value(fld)[:, :, None], [BM, BK]).to(
        tl.bfloat16
    )


def _e2m1_pairs_asm(folded: bool) -> str:
    """The PTX of ``E2M1_PAIRS_ASM`` (``folded``: of ``E2M1_PAIRS_FOLDED_ASM``)."""
    lines = [".reg .b32 t0, t1, u, n;"] if folded else [".reg .b32 t0, t1, u, c, n;"]
    lines += [] if folded else ["mov.b32 c, 0x7E807E80;"]  # 2**126, bf16 pairs
    lines += ["mov.b32 n, 0x80008000;"]
    lines += ["prmt.b32 t0, $4, 0, 0x4140;", "prmt.b32 t1, $4, 0, 0x4342;"]
    # (output, packed pair, nibble mask, multiplier placing the nibble, scale)
    low, high = ("0x000F000F", "0x1040"), ("0x00F000F0", "0x0104")
    parts = [("$0", "t0", *low, "$5"), ("$1", "t1", *low, "$6")]
    parts += [("$2", "t0", *high, "$5"), ("$3", "t1", *high, "$6")]
    for out, pair, mask, mul, scale in parts:
        lines += [f"and.b32 u, {pair}, {mask};", f"mul.lo.u32 u, u, {mul};"]
        lines += ["and.b32 u, u, 0x81C081C0;"]
        if not folded:
            lines += ["fma.rn.bf16x2 u, u, c, n;"]
        lines += [f"fma.rn.bf16x2 {out}, u, {scale}, n;"]
    return "{\n" + "\n".join(lines) + "\n}"


E2M1_PAIRS_ASM = tl.constexpr(_e2m1_pairs_asm(False))
"""Four packed E2M1 bytes ($4) and their bf16 block scales ($5, $6) -> the low nibbles' values
($0, $1) and the high nibbles' ($2, $3), bf16 pairs. ``prmt`` puts two bytes in the two 16-bit
halves; one multiply by ``2**6 + 2**12`` (``2**2 + 2**8`` for the high nibble) of the masked
nibble copies it to two places that cannot carry into each other, and a mask keeps the sign at
bit 15 and the exponent and mantissa bits at bf16's lowest exponent bits and top mantissa bit:
the code's value times ``2**-126`` (the subnormal 0.5 as bf16's subnormal ``2**-127``). Two exact
multiplies (``fma`` with -0) by ``2**126`` and by the scale follow: three integer and two float
instructions per pair of codes."""


E2M1_PAIRS_FOLDED_ASM = tl.constexpr(_e2m1_pairs_asm(True))
"""``E2M1_PAIRS_ASM`` with the scales ($5, $6) already times ``2**126`` (``lane_scales`` with
``FOLD``): one exact multiply a pair (the code's value times ``2**-126``, a bf16 subnormal for
0.5, times ``2**(field - 1)``), so three integer and one float instruction per pair of codes."""


@triton.jit
def e8m0_bf16(field, FOLD: tl.constexpr = False):
    """E8M0 bytes -> their bf16 powers of two (0 for byte 0, as ``e8m0_value``); ``FOLD``: times
    ``2**126`` (fields 1 to 128, ``scales_fold``)."""
    f = field.to(tl.int16)
    if FOLD:
        f = f + 126
    return (f << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def lane_scales(fld, R: tl.constexpr, BK: tl.constexpr, FOLD: tl.constexpr = False):
    """E8M0 bytes ``[R, BK/32]`` -> each lane pair's bf16 scale ``[R, BK/2]`` (``FOLD``: times
    ``2**126``)."""
    sc = e8m0_bf16(fld, FOLD)
    return tl.reshape(tl.broadcast_to(sc[:, :, None], [R, BK // 32, 16]), [R, BK // 2])


@triton.jit
def fp4_pairs(p, fld, ASM: tl.constexpr, OPND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``fp4_raw``'s tile as two operands ``[BN, BK/2]``: the even lanes' values (low nibbles)
    and the odd lanes' (high nibbles), times their block scales (exact). ``ASM``: 0 Triton's
    operations, 1 ``E2M1_PAIRS_ASM``, 2 ``E2M1_PAIRS_FOLDED_ASM`` (``FOLDED_SCALES``)."""
    if ASM == 2:
        sc = lane_scales(fld, BN, BK, True)
        lo, hi = tl.inline_asm_elementwise(
            E2M1_PAIRS_FOLDED_ASM, "=r,=r,=r,=r,r,r,r", [p, sc],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip
        return lo, hi
    sc = lane_scales(fld, BN, BK)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            E2M1_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [p, sc], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4,
        )  # fmt: skip
    else:
        lo8, hi8 = e2m1_pair_bytes(p)
        s = sc.to(tl.float32) * 64.0
        lo = (lo8.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(OPND)
        hi = (hi8.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(OPND)
    return lo, hi


@triton.jit
def deinterleaved_rows(xb_ptr, rows, k0, rmask, sxm, K: tl.constexpr, BK: tl.constexpr):
    """Lanes ``k0 .. k0 + BK`` of bf16 rows stored deinterleaved (``deinterleave_fp8``: the
    even lanes, then the odd ones): (even lanes ``[BM, BK/2]``, odd lanes); zeros past ``K``."""
    rp = k0 // 2 + tl.arange(0, BK // 2)
    m = rmask[:, None] & (rp < K // 2)[None, :]
    at = xb_ptr + rows[:, None] * sxm + rp[None, :]
    return tl.load(at, mask=m, other=0.0), tl.load(at + K // 2, mask=m, other=0.0)


@triton.jit
def _deinterleave_kernel(xq_ptr, xs_ptr, out_ptr, sxm, sxsm, som, D: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """One row's ``BLOCK`` lane pairs of FP8 activations (E4M3 bytes, E8M0 per 32) as their
    bf16 values, the even lanes to ``out[:, :D/2]`` and the odd ones to ``out[:, D/2:]``."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < D // 2
    ev = tl.load(xq_ptr + row * sxm + 2 * j, mask=m, other=0)
    od = tl.load(xq_ptr + row * sxm + 2 * j + 1, mask=m, other=0)
    sc = e8m0_value(tl.load(xs_ptr + row * sxsm + j // 16, mask=m, other=0))
    ev = ev.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    od = od.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    tl.store(out_ptr + row * som + j, ev.to(tl.bfloat16), mask=m)
    tl.store(out_ptr + row * som + D // 2 + j, od.to(tl.bfloat16), mask=m)


def deinterleave_fp8(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """FP8 activations ``[N, D]`` (E4M3, E8M0 ``[N, D/32]``) as bf16 ``[N, D]`` with the even
    lanes first and the odd ones after (exact values): ``MoEConfig.pairs``' operand rows."""
    n, d = xq.shape
    out = torch.empty((n, d), dtype=torch.bfloat16, device=xq.device)
    if n:
        xq8, xs8 = _bytes(xq), _bytes(xs)
        block = min(1024, triton.next_power_of_2(d // 2))
        _deinterleave_kernel[(n, triton.cdiv(d // 2, block))](
            xq8,
            xs8,
            out,
            xq8.stride(0),
            xs8.stride(0),
            out.stride(0),
            D=d,
            BLOCK=block,
            **pdl_launch(xq.device, n),
        )
    return out


@triton.jit
def _deinterleave_rows_kernel(
    xq_ptr, xs_ptr, row_ptr, out_ptr, sxm, sxsm, som, D: tl.constexpr, TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``_deinterleave_kernel`` for permuted row ``program_id(0)``: the token of its flat id
    ``row_ptr[r]`` (``flat // TOPK``), or zeros for a padding row (-1)."""
    r = tl.program_id(0).to(tl.int64)
    flat = tl.load(row_ptr + r)
    valid = flat >= 0
    row = tl.where(valid, flat // TOPK, 0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < D // 2
    lm = m & valid
    ev = tl.load(xq_ptr + row * sxm + 2 * j, mask=lm, other=0)
    od = tl.load(xq_ptr + row * sxm + 2 * j + 1, mask=lm, other=0)
    sc = e8m0_value(tl.load(xs_ptr + row * sxsm + j // 16, mask=lm, other=0))
    ev = ev.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    od = od.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    tl.store(out_ptr + r * som + j, ev.to(tl.bfloat16), mask=m)
    tl.store(out_ptr + r * som + D // 2 + j, od.to(tl.bfloat16), mask=m)


def deinterleave_rows(
    xq: torch.Tensor, xs: torch.Tensor, row_ids: torch.Tensor, topk: int
) -> torch.Tensor:
    """``deinterleave_fp8``'s rows in the grouped kernels' order: ``[R, D]`` bf16, row ``r`` the
    token ``row_ids[r] // topk`` (its even lanes, then its odd ones), zeros where
    ``row_ids[r] < 0`` (padding). ``MoEConfig.tma``'s contiguous operand rows."""
    R, d = row_ids.shape[0], xq.shape[1]
    out = torch.empty((R, d), dtype=torch.bfloat16, device=xq.device)
    if R:
        xq8, xs8 = _bytes(xq), _bytes(xs)
        block = min(1024, triton.next_power_of_2(d // 2))
        _deinterleave_rows_kernel[(R, triton.cdiv(d // 2, block))](
            xq8, xs8, row_ids, out, xq8.stride(0), xs8.stride(0), out.stride(0), D=d, TOPK=topk,
            BLOCK=block,
        )  # fmt: skip
    return out


@triton.jit
def fp4_scales_raw(s_ptr, rn, k0, nmask, ssn, K: tl.constexpr, BK: tl.constexpr):
    """The E8M0 bytes ``[BN, BK/32]`` of ``fp4_raw``'s tile (zeros past ``K``)."""
    kbi = k0 // 32 + tl.arange(0, BK // 32)
    fmask = nmask[:, None] & (kbi < K // 32)[None, :]
    return tl.load(s_ptr + rn[:, None] * ssn + kbi[None, :], mask=fmask, other=0)


@triton.jit
def pair_dot(acc, ev, od, lo, hi, DOT: tl.constexpr):
    """``acc + ev @ lo^T + od @ hi^T``: a K step as its even and odd lanes' dots."""
    if DOT == 1:
        acc = tl.dot(ev, tl.trans(lo), acc)
        acc = tl.dot(od, tl.trans(hi), acc)
    else:
        acc = tl.dot(ev, tl.trans(lo), acc, input_precision="ieee")
        acc = tl.dot(od, tl.trans(hi), acc, input_precision="ieee")
    return acc


@triton.jit
def load_fp4_tile(
    w_ptr,
    s_ptr,
    rn,
    rk,
    k0,
    nmask,
    kmask,
    swn,
    ssn,
    K: tl.constexpr,
    DOT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One ``[BN, BK]`` tile of a packed E2M1 weight ``[out, K/2]`` (even lane in the low
    nibble) with E8M0 row scales ``[out, K/32]``: (operand, per-row scale ``[BN]``) as in
    ``load_a_tile``. Every mode reads the codes as ``e2m1_pair_bytes``' scaled E4M3 bytes and
    takes the factor 64 into the scale (exact: a power of two; a scale field above 247 would
    overflow, and published weights' are far below)."""
    rp = k0 // 2 + tl.arange(0, BK // 2)
    pmask = nmask[:, None] & (rp < K // 2)[None, :]
    p = tl.load(w_ptr + rn[:, None] * swn + rp[None, :], mask=pmask, other=0)
    lo, hi = e2m1_pair_bytes(p)
    codes = tl.interleave(lo, hi)
    if DOT == 2:
        b = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        sw = e8m0_value(tl.load(s_ptr + rn * ssn + k0 // 32, mask=nmask, other=0)) * 64.0
    elif DOT == 1:
        # the tile's BK / 32 scales once, the codes by the E4M3 conversion, the product in bf16
        # (exact: E2M1 times a power of two); one dot per BK lanes, no per-block scaling
        nb: tl.constexpr = BK // 32
        kbi = k0 // 32 + tl.arange(0, nb)
        fmask = nmask[:, None] & (kbi < K // 32)[None, :]
        fld = tl.load(s_ptr + rn[:, None] * ssn + kbi[None, :], mask=fmask, other=0)
        v = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = e8m0_value(fld) * 64.0
        b = tl.reshape(tl.reshape(v, [BN, nb, 32]) * sc[:, :, None], [BN, BK]).to(tl.bfloat16)
        sw = tl.zeros([BN], dtype=tl.float32)
    else:
        bmask = nmask[:, None] & kmask[None, :]
        fld = tl.load(s_ptr + rn[:, None] * ssn + rk[None, :] // 32, mask=bmask, other=0)
        b = decode_e4m3(codes) * (e8m0_value(fld) * 64.0)
        sw = tl.zeros([BN], dtype=tl.float32)
    return b, sw


@triton.jit
def _gate_up_kernel(
    xq_ptr,
    xs_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    row_ptr,
    bexp_ptr,
    rw_ptr,
    act_ptr,
    acts_ptr,
    xb_ptr,
    actb_ptr,
    xd,
    w1d,
    w3d,
    limit,
    sx,
    sxs,
    swe,
    swn,
    sse,
    ssn,
    sa,
    sas,
    sxb,
    sab,
    D: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREFETCH: tl.constexpr,
    PAIRS: tl.constexpr,
    ASM: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rows of one expert x ``BN`` intermediate lanes: ``w1``/``w3`` GEMMs, SwiGLU x routing
    weight, FP8 quantization of the intermediate (E4M3 bytes, E8M0 bytes per 32). ``TMA``
    (``MoEConfig.tma``): ``xd`` the permuted deinterleaved rows ``[R, D]`` in ``[BM, BK/2]``
    blocks, ``w1d``/``w3d`` the codes as ``[El * I, D/2]`` in ``[BN, BK/2]`` blocks."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.load(bexp_ptr + pid_m)
    if g < 0:
        return
    rr = pid_m * BM + tl.arange(0, BM)
    flat = tl.load(row_ptr + rr)
    valid = flat >= 0
    tok = tl.where(valid, flat // TOPK, 0)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < I
    w1 = w1_ptr + g.to(tl.int64) * swe
    w3 = w3_ptr + g.to(tl.int64) * swe
    s1 = s1_ptr + g.to(tl.int64) * sse
    s3 = s3_ptr + g.to(tl.int64) * sse
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    if PAIRS:  # even and odd lanes apart (MoEConfig.pairs)
        OPND: tl.constexpr = tl.bfloat16 if DOT == 1 else tl.float32  # exact either way
        if TMA:
            # rows of a flattened [El * I, D/2]: past this expert's last lane a program reads
            # the next expert's rows, which its store masks off
            m0 = pid_m * BM
            r0 = g * I + pid_n * BN
            f1 = fp4_scales_raw(s1, rn, 0, nmask, ssn, D, BK)
            f3 = fp4_scales_raw(s3, rn, 0, nmask, ssn, D, BK)
            for k0 in range(0, D, BK):
                nf1 = fp4_scales_raw(s1, rn, k0 + BK, nmask, ssn, D, BK)
                nf3 = fp4_scales_raw(s3, rn, k0 + BK, nmask, ssn, D, BK)
                # lanes past D read the odd half or zeros: their codes are zeros (the weight
                # descriptor ends at D/2), so the products are 0
                ev = xd.load([m0, k0 // 2]).to(OPND)
                od = xd.load([m0, D // 2 + k0 // 2]).to(OPND)
                lo, hi = fp4_pairs(w1d.load([r0, k0 // 2]), f1, ASM, OPND, BN, BK)
                acc1 = pair_dot(acc1, ev, od, lo, hi, DOT)
                lo, hi = fp4_pairs(w3d.load([r0, k0 // 2]), f3, ASM, OPND, BN, BK)
                acc3 = pair_dot(acc3, ev, od, lo, hi, DOT)
                f1, f3 = nf1, nf3
        elif PREFETCH:
            ev, od = deinterleaved_rows(xb_ptr, tok, 0, valid, sxb, D, BK)
            p1, f1 = fp4_raw(w1, s1, rn, 0, nmask, swn, ssn, D, BK)
            p3, f3 = fp4_raw(w3, s3, rn, 0, nmask, swn, ssn, D, BK)
            for k0 in range(0, D, BK):
                nev, nod = deinterleaved_rows(xb_ptr, tok, k0 + BK, valid, sxb, D, BK)
                np1, nf1 = fp4_raw(w1, s1, rn, k0 + BK, nmask, swn, ssn, D, BK)
                np3, nf3 = fp4_raw(w3, s3, rn, k0 + BK, nmask, swn, ssn, D, BK)
                lo, hi = fp4_pairs(p1, f1, ASM, OPND, BN, BK)
                acc1 = pair_dot(acc1, ev.to(OPND), od.to(OPND), lo, hi, DOT)
                lo, hi = fp4_pairs(p3, f3, ASM, OPND, BN, BK)
                acc3 = pair_dot(acc3, ev.to(OPND), od.to(OPND), lo, hi, DOT)
                ev, od, p1, f1, p3, f3 = nev, nod, np1, nf1, np3, nf3
        else:
            for k0 in range(0, D, BK):
                ev, od = deinterleaved_rows(xb_ptr, tok, k0, valid, sxb, D, BK)
                p1, f1 = fp4_raw(w1, s1, rn, k0, nmask, swn, ssn, D, BK)
                lo, hi = fp4_pairs(p1, f1, ASM, OPND, BN, BK)
                acc1 = pair_dot(acc1, ev.to(OPND), od.to(OPND), lo, hi, DOT)
                p3, f3 = fp4_raw(w3, s3, rn, k0, nmask, swn, ssn, D, BK)
                lo, hi = fp4_pairs(p3, f3, ASM, OPND, BN, BK)
                acc3 = pair_dot(acc3, ev.to(OPND), od.to(OPND), lo, hi, DOT)
    elif PREFETCH:  # each step's raw tiles loaded one step ahead (MoEConfig.prefetch)
        OPND: tl.constexpr = tl.bfloat16 if DOT == 1 else tl.float32  # exact either way
        none = tl.zeros([BM], dtype=tl.float32)
        ab, af = fp8_rows_raw(xq_ptr, xs_ptr, tok, 0, valid, sx, sxs, D, BK)
        p1, f1 = fp4_raw(w1, s1, rn, 0, nmask, swn, ssn, D, BK)
        p3, f3 = fp4_raw(w3, s3, rn, 0, nmask, swn, ssn, D, BK)
        for k0 in range(0, D, BK):
            nab, naf = fp8_rows_raw(xq_ptr, xs_ptr, tok, k0 + BK, valid, sx, sxs, D, BK)
            np1, nf1 = fp4_raw(w1, s1, rn, k0 + BK, nmask, swn, ssn, D, BK)
            np3, nf3 = fp4_raw(w3, s3, rn, k0 + BK, nmask, swn, ssn, D, BK)
            a = fp8_rows_bf16(ab, af, BM, BK).to(OPND)
            acc1 = qdot(acc1, a, none, fp4_bf16(p1, f1, BN, BK).to(OPND), none, DOT)
            acc3 = qdot(acc3, a, none, fp4_bf16(p3, f3, BN, BK).to(OPND), none, DOT)
            ab, af, p1, f1, p3, f3 = nab, naf, np1, nf1, np3, nf3
    else:
        SUB: tl.constexpr = 32 if DOT == 2 else BK  # see _w8a8_kernel: fp8 walks 32-lane blocks
        for k0 in range(0, D, BK):
            for j in tl.static_range(BK // SUB):
                kb = k0 + j * SUB
                rk = kb + tl.arange(0, SUB)
                kmask = rk < D
                a, sxv = load_a_tile(
                    xq_ptr, xs_ptr, tok, rk, kb, valid, kmask, sx, sxs, False, DOT, BM, SUB
                )
                b1, sw1 = load_fp4_tile(w1, s1, rn, rk, kb, nmask, kmask, swn, ssn, D, DOT, BN, SUB)
                acc1 = qdot(acc1, a, sxv, b1, sw1, DOT)
                b3, sw3 = load_fp4_tile(w3, s3, rn, rk, kb, nmask, kmask, swn, ssn, D, DOT, BN, SUB)
                acc3 = qdot(acc3, a, sxv, b3, sw3, DOT)
    rw = tl.load(rw_ptr + flat, mask=valid, other=0.0)
    q, field = swiglu_fp8(acc1, acc3, limit, rw, ROUND_BF16, BM, BN)
    tl.store(act_ptr + rr[:, None] * sa + rn[None, :], q.to(tl.uint8), mask=nmask[None, :])
    rb = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    bmask = (rb < I // 32)[None, :]
    tl.store(acts_ptr + rr[:, None] * sas + rb[None, :], field.to(tl.uint8), mask=bmask)
    if PAIRS:  # the down GEMM's operand: these codes' values, even lanes then odd ones
        v = q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = tl.reshape(tl.reshape(v, [BM, BN // 32, 32]) * e8m0_value(field)[:, :, None], [BM, BN])
        ev, od = tl.split(tl.reshape(v.to(tl.bfloat16), [BM, BN // 2, 2]))
        rh = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        at = actb_ptr + rr[:, None] * sab + rh[None, :]
        hmask = (rh < I // 2)[None, :]
        tl.store(at, ev, mask=hmask)
        tl.store(at + I // 2, od, mask=hmask)


@triton.jit
def _down_kernel(
    act_ptr,
    acts_ptr,
    w2_ptr,
    s2_ptr,
    bexp_ptr,
    y_ptr,
    actb_ptr,
    ad,
    w2d,
    sa,
    sas,
    swe,
    swn,
    sse,
    ssn,
    sy,
    sab,
    D: tl.constexpr,
    I: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREFETCH: tl.constexpr,
    PAIRS: tl.constexpr,
    ASM: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rows of one expert x ``BN`` output lanes of the ``w2`` GEMM over the FP8 intermediate;
    stored in ``y``'s dtype (the compute dtype's rounding of a linear output). ``TMA``: ``ad``
    the deinterleaved intermediate ``[R, I]`` in ``[BM, BK/2]`` blocks, ``w2d`` the codes as
    ``[El * D, I/2]`` in ``[BN, BK/2]`` blocks."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.load(bexp_ptr + pid_m)
    if g < 0:
        return
    rr = pid_m * BM + tl.arange(0, BM)
    rmask = rr >= 0
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < D
    w2 = w2_ptr + g.to(tl.int64) * swe
    s2 = s2_ptr + g.to(tl.int64) * sse
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if PAIRS:  # even and odd lanes apart (MoEConfig.pairs)
        OPND: tl.constexpr = tl.bfloat16 if DOT == 1 else tl.float32  # exact either way
        if TMA:  # as in _gate_up_kernel
            m0 = pid_m * BM
            r0 = g * D + pid_n * BN
            f2 = fp4_scales_raw(s2, rn, 0, nmask, ssn, I, BK)
            for k0 in range(0, I, BK):
                nf2 = fp4_scales_raw(s2, rn, k0 + BK, nmask, ssn, I, BK)
                ev = ad.load([m0, k0 // 2]).to(OPND)
                od = ad.load([m0, I // 2 + k0 // 2]).to(OPND)
                lo, hi = fp4_pairs(w2d.load([r0, k0 // 2]), f2, ASM, OPND, BN, BK)
                acc = pair_dot(acc, ev, od, lo, hi, DOT)
                f2 = nf2
        elif PREFETCH:
            ev, od = deinterleaved_rows(actb_ptr, rr, 0, rmask, sab, I, BK)
            p2, f2 = fp4_raw(w2, s2, rn, 0, nmask, swn, ssn, I, BK)
            for k0 in range(0, I, BK):
                nev, nod = deinterleaved_rows(actb_ptr, rr, k0 + BK, rmask, sab, I, BK)
                np2, nf2 = fp4_raw(w2, s2, rn, k0 + BK, nmask, swn, ssn, I, BK)
                lo, hi = fp4_pairs(p2, f2, ASM, OPND, BN, BK)
                acc = pair_dot(acc, ev.to(OPND), od.to(OPND), lo, hi, DOT)
                ev, od, p2, f2 = nev, nod, np2, nf2
        else:
            for k0 in range(0, I, BK):
                ev, od = deinterleaved_rows(actb_ptr, rr, k0, rmask, sab, I, BK)
                p2, f2 = fp4_raw(w2, s2, rn, k0, nmask, swn, ssn, I, BK)
                lo, hi = fp4_pairs(p2, f2, ASM, OPND, BN, BK)
                acc = pair_dot(acc, ev.to(OPND), od.to(OPND), lo, hi, DOT)
    elif PREFETCH:  # each step's raw tiles loaded one step ahead (MoEConfig.prefetch)
        OPND: tl.constexpr = tl.bfloat16 if DOT == 1 else tl.float32  # exact either way
        none = tl.zeros([BM], dtype=tl.float32)
        ab, af = fp8_rows_raw(act_ptr, acts_ptr, rr, 0, rmask, sa, sas, I, BK)
        p2, f2 = fp4_raw(w2, s2, rn, 0, nmask, swn, ssn, I, BK)
        for k0 in range(0, I, BK):
            nab, naf = fp8_rows_raw(act_ptr, acts_ptr, rr, k0 + BK, rmask, sa, sas, I, BK)
            np2, nf2 = fp4_raw(w2, s2, rn, k0 + BK, nmask, swn, ssn, I, BK)
            b = fp4_bf16(p2, f2, BN, BK).to(OPND)
            acc = qdot(acc, fp8_rows_bf16(ab, af, BM, BK).to(OPND), none, b, none, DOT)
            ab, af, p2, f2 = nab, naf, np2, nf2
    else:
        SUB: tl.constexpr = 32 if DOT == 2 else BK  # see _w8a8_kernel: fp8 walks 32-lane blocks
        for k0 in range(0, I, BK):
            for j in tl.static_range(BK // SUB):
                kb = k0 + j * SUB
                rk = kb + tl.arange(0, SUB)
                kmask = rk < I
                a, sav = load_a_tile(
                    act_ptr, acts_ptr, rr, rk, kb, rmask, kmask, sa, sas, False, DOT, BM, SUB
                )
                b, sw = load_fp4_tile(w2, s2, rn, rk, kb, nmask, kmask, swn, ssn, I, DOT, BN, SUB)
                acc = qdot(acc, a, sav, b, sw, DOT)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(
        y_ptr + rr[:, None] * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=nmask[None, :]
    )


@triton.jit
def _combine_kernel(
    y_ptr,
    pos_ptr,
    add_ptr,
    out_ptr,
    sy,
    sadd,
    so,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    HAS_ADD: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One token x ``BD`` lanes: its ``TOPK`` rows summed in slot order (+ the addend)."""
    pdl_enter(PDL)
    n = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = rd < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = tl.load(pos_ptr + n * TOPK + j)
        v = tl.load(y_ptr + p * sy + rd, mask=dmask & (p >= 0), other=0.0)
        acc += v.to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + n * sadd + rd, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * so + rd, acc, mask=dmask)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def moe_combine(
    y_rows: torch.Tensor, pos: torch.Tensor, k: int, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, D]`` float32: each token's ``k`` rows of ``y_rows`` (``pos [N*k]``, -1 none) summed
    in slot order, plus ``add [N, D]`` when given. One launch, no atomics."""
    nk, D = pos.shape[0], y_rows.shape[1]
    n = nk // k
    out = torch.empty((n, D), dtype=torch.float32, device=y_rows.device)
    if n == 0:
        return out
    BD = 128 if D >= 128 else triton.next_power_of_2(D)
    a = add if add is not None else out
    grid = (n, triton.cdiv(D, BD))
    _combine_kernel[grid](
        y_rows, pos, a, out, y_rows.stride(0), a.stride(0), out.stride(0), D, k,
        add is not None, BD, **pdl_launch(out.device, n),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class MoEStages:
    """The grouped MoE's intermediates, for checks that force its rounding decisions."""

    rows: MoERows
    """The expert-sorted permutation (``pos`` maps a (token, slot) to its row)."""
    act: torch.Tensor
    """``[R, I]`` uint8: the FP8 intermediate's E4M3 bytes."""
    act_scales: torch.Tensor
    """``[R, I/32]`` uint8: its E8M0 scale bytes."""
    y_rows: torch.Tensor
    """``[R, D]`` in the compute dtype: each row's ``w2`` output."""


def tma_moe_ready(w1: QuantWeight, w3: QuantWeight, w2: QuantWeight, cfg: MoEConfig) -> bool:
    """Whether ``MoEConfig.tma`` can read these experts: a CUDA device of compute capability 9
    or more (or Triton's interpreter), contiguous code tensors with 16-byte aligned bases and
    rows (``D/2`` and ``I/2`` bytes a row), ``block_k`` a multiple of 32."""
    dev = w1.codes.device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    codes = (w1.codes, w3.codes, w2.codes)
    return cfg.block_k % 32 == 0 and all(
        c.is_contiguous() and c.shape[-1] % 16 == 0 and c.data_ptr() % 16 == 0 for c in codes
    )


def grouped_moe_w4a8(
    xq: torch.Tensor,
    xs: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: QuantWeight,
    w3: QuantWeight,
    w2: QuantWeight,
    expert_first: int,
    limit: float,
    dtype: torch.dtype,
    add: torch.Tensor | None = None,
    dot: str | None = None,
    config: MoEConfig | None = None,
    folds: bool = False,
) -> torch.Tensor:
    """The routed experts' sum ``[N, D]`` (float32, plus ``add`` when given) over the selected
    experts only, W4A8.

    ``xq``/``xs``: the FP8 input (``act_quant_fp8``: E4M3 ``[N, D]``, E8M0 ``[N, D/32]``);
    ``ids``/``weights [N, k]`` the routing; ``w1``/``w3`` FP4 ``QuantWeight`` ``[El, I, D]`` and
    ``w2`` ``[El, D, I]``, this rank's experts from ``expert_first``. ``dtype`` is the compute
    dtype the linear outputs and the SwiGLU product round to (bf16 or float32). ``folds``: the
    experts pass ``scales_fold`` (``FOLDED_SCALES``).
    """
    st = grouped_moe_w4a8_stages(
        xq, xs, ids, weights, w1, w3, w2, expert_first, limit, dtype, dot, config, folds
    )
    return moe_combine(st.y_rows, st.rows.pos, ids.shape[1], add)


def grouped_moe_w4a8_stages(
    xq: torch.Tensor,
    xs: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: QuantWeight,
    w3: QuantWeight,
    w2: QuantWeight,
    expert_first: int,
    limit: float,
    dtype: torch.dtype,
    dot: str | None = None,
    config: MoEConfig | None = None,
    folds: bool = False,
) -> MoEStages:
    """``grouped_moe_w4a8`` up to (not including) the combine: the two grouped GEMM launches,
    with their intermediates returned (arguments as there). ``folds``: the caller checked
    ``scales_fold(w1, w3, w2)``, so the asm decode may fold the scales (``FOLDED_SCALES``)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grouped_moe_w4a8 computes in bf16 or float32, not {dtype}")
    n, k = ids.shape
    El, I, D = w1.shape
    dot = dot or default_moe_dot(xq.device)
    cfg = config or default_moe_config(n * k, dot, D, I)
    if config is None and cfg.tma and not tma_moe_ready(w1, w3, w2, cfg):
        cfg = dataclasses.replace(cfg, tma=False)
    if cfg.block_k % QUANT_BLOCK:
        raise ValueError(f"block_k {cfg.block_k}: a multiple of {QUANT_BLOCK} (the scale block)")
    if (cfg.prefetch or cfg.pairs) and dot == "fp8":
        raise ValueError("MoEConfig.prefetch and .pairs run the bf16 and fp32 dot modes, not fp8")
    if cfg.tma and not (cfg.pairs and tma_moe_ready(w1, w3, w2, cfg)):
        raise ValueError(
            "MoEConfig.tma reads the pairs mode's tiles (pairs=True) on a device with TMA "
            "(sm_90+), with 16-byte aligned code rows and block_k a multiple of 32"
        )
    rows: MoERows = align_rows_fused(ids, expert_first, El, cfg.block_m)
    R = rows.rows
    dev = xq.device
    act = torch.empty((R, I), dtype=torch.uint8, device=dev)
    acts = torch.empty((R, I // QUANT_BLOCK), dtype=torch.uint8, device=dev)
    y_rows = torch.empty((R, D), dtype=dtype, device=dev)
    xq8, xs8 = _bytes(xq), _bytes(xs)
    c1, c3, c2 = _bytes(w1.codes), _bytes(w3.codes), _bytes(w2.codes)
    g1, g3, g2 = _bytes(w1.scales), _bytes(w3.scales), _bytes(w2.scales)
    if cfg.pairs:
        xb = deinterleave_rows(xq, xs, rows.row_ids, k) if cfg.tma else deinterleave_fp8(xq, xs)
        actb = torch.empty((R, I), dtype=torch.bfloat16, device=dev)
    else:  # not read
        xb, actb = y_rows, y_rows
    # the descriptors' slots take the code tensors when unused
    xd, w1d, w3d, ad, w2d = c1, c1, c3, c2, c2
    if cfg.tma and R:
        half = cfg.block_k // 2
        xd = TensorDescriptor.from_tensor(xb, [cfg.block_m, half])
        ad = TensorDescriptor.from_tensor(actb, [cfg.block_m, half])
        w1d = TensorDescriptor.from_tensor(c1.view(El * I, D // 2), [cfg.block_n, half])
        w3d = TensorDescriptor.from_tensor(c3.view(El * I, D // 2), [cfg.block_n, half])
        w2d = TensorDescriptor.from_tensor(c2.view(El * D, I // 2), [cfg.block_n_down, half])
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    common = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "PREFETCH": cfg.prefetch}
    if cfg.max_registers is not None and torch.version.hip is None:
        common["maxnreg"] = cfg.max_registers  # an NVIDIA option: Triton's HIP backend refuses it
    asm = int(cfg.pairs and dot == "bf16" and dev.type == "cuda" and PAIRS_ASM)
    common.update(
        PAIRS=cfg.pairs,
        ASM=2 if asm and folds and FOLDED_SCALES else asm,
        TMA=cfg.tma,
        **pdl_launch(dev, n),
    )
    if R:
        nb = R // cfg.block_m
        _gate_up_kernel[(nb, triton.cdiv(I, cfg.block_n))](
            xq8,
            xs8,
            c1,
            g1,
            c3,
            g3,
            rows.row_ids,
            rows.block_expert,
            rw,
            act,
            acts,
            xb,
            actb,
            xd,
            w1d,
            w3d,
            float(limit),
            xq8.stride(0),
            xs8.stride(0),
            c1.stride(0),
            c1.stride(1),
            g1.stride(0),
            g1.stride(1),
            act.stride(0),
            acts.stride(0),
            xb.stride(0),
            actb.stride(0),
            D=D,
            I=I,
            TOPK=k,
            ROUND_BF16=dtype == torch.bfloat16,
            DOT=DOT_MODES[dot],
            BM=cfg.block_m,
            BN=cfg.block_n,
            BK=cfg.block_k,
            **common,
        )
        _down_kernel[(nb, triton.cdiv(D, cfg.block_n_down))](
            act,
            acts,
            c2,
            g2,
            rows.block_expert,
            y_rows,
            actb,
            ad,
            w2d,
            act.stride(0),
            acts.stride(0),
            c2.stride(0),
            c2.stride(1),
            g2.stride(0),
            g2.stride(1),
            y_rows.stride(0),
            actb.stride(0),
            D=D,
            I=I,
            ROUND_BF16=dtype == torch.bfloat16,
            DOT=DOT_MODES[dot],
            BM=cfg.block_m,
            BN=cfg.block_n_down,
            BK=cfg.block_k,
            **common,
        )
    return MoEStages(rows, act, acts, y_rows)
