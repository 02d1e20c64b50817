"""Grouped MoE over the selected experts only: the permutation, the torch implementation against
the dense-over-experts ``layers.MoE`` (float64, 1e-12, expert ids equal), TP/EP slices (on
dequantized and on resident quantized weights, and once under gloo), and the W4A8 Triton kernel
against the torch implementation.

Without CUDA the Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
here before the kernel modules are imported) with float32 dot operands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import triton
import triton.language as tl

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.layers import MoE
from v41plan.model.sharding import shard_weights
from v41plan.runtime.collectives import TPGroup
from v41plan.runtime.kernels.moe_torch import align_rows, padded_rows
from v41plan.runtime.kernels.triton_gemm import load_a_tile
from v41plan.runtime.kernels.triton_moe import e2m1_pair_bytes, fp4_pairs, fp4_raw, load_fp4_tile
from v41plan.runtime.resident import GroupedMoE

from .interpreted import patched_interpreter  # noqa: F401 (an autouse fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYER = "layers.3"
REL = 1e-12


@dataclasses.dataclass(frozen=True)
class Partial:
    """Rank ``rank`` of ``size`` whose all-reduce returns its own partial (summed by the test)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture(scope="module")
def tiny():
    cfg = config_from_cache_spec(load_cache_spec("tiny"))
    state = random_state(cfg, 0)
    w64 = LoadedCheckpoint.from_state(cfg, state).process(torch.float64)
    res = LoadedCheckpoint.from_state(cfg, state).process(resident=True)
    return cfg, w64, res


def _x(cfg, n: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# --- the permutation -------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("first,count", [(0, 8), (4, 4), (2, 2)])
def test_rows_are_sorted_by_local_expert_in_whole_blocks(block_m, first, count):
    n, k, E = 23, 3, 8
    g = torch.Generator().manual_seed(block_m * 10 + first)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    rows = align_rows(ids, first, count, block_m)
    flat = ids.reshape(-1)
    local = ((flat >= first) & (flat < first + count)).nonzero().flatten()
    R = padded_rows(n, k, count, block_m)
    assert rows.rows == R and R % block_m == 0 and rows.block_expert.shape == (R // block_m,)
    # every local row exactly once; padding -1; rows routed elsewhere absent, pos -1
    placed = rows.row_ids[rows.row_ids >= 0]
    assert torch.equal(placed.sort().values, local)
    assert torch.equal(rows.row_ids[rows.pos[local]], local)
    assert bool((rows.pos[~torch.isin(torch.arange(n * k), local)] == -1).all())
    # each block holds one expert's rows in (token, slot) order; experts ascend; unused blocks last
    be = rows.block_expert.tolist()
    used = [b for b in be if b >= 0]
    assert used == sorted(used) and be == used + [-1] * (len(be) - len(used))
    for b, e in enumerate(be):
        blk = rows.row_ids[b * block_m : (b + 1) * block_m]
        blk = blk[blk >= 0]
        if e < 0:
            assert blk.numel() == 0
            continue
        assert bool((flat[blk] - first == e).all()) and torch.equal(blk, blk.sort().values)
    ends = rows.group_ends.tolist()
    counts = [int((flat == first + e).sum()) for e in range(count)]
    assert ends == list(torch.tensor([-(-c // block_m) * block_m for c in counts]).cumsum(0))


@pytest.mark.parametrize(
    ("n", "k", "E", "first", "count", "block_m"),
    [(23, 3, 8, 0, 8, 16), (23, 3, 8, 4, 4, 4), (1, 6, 48, 0, 48, 16), (40, 6, 48, 12, 24, 1),
     (300, 6, 48, 0, 48, 16)],
)  # fmt: skip
@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot", "expert_loop"])
def test_fused_permutation_equals_the_torch_one(
    n, k, E, first, count, block_m, one_hot, monkeypatch
):
    """Both forms of the one-program permutation (the ``[experts, rows]`` one-hot prefix sums
    where they fit, else the loop over experts; 300 x 6 rows always loop) give the torch
    permutation's integers, with experts of another rank and empty experts."""
    from v41plan.runtime.kernels import triton_moe
    from v41plan.runtime.kernels.triton_moe import align_rows_fused

    if not one_hot:
        monkeypatch.setattr(triton_moe, "ALIGN_ONE_HOT_ELEMS", 0)
    g = torch.Generator().manual_seed(n + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).to(DEV)
    if n == 40:  # skewed: most rows on a few experts, several experts empty
        ids = torch.stack([torch.randperm(8, generator=g)[:k] * 3 for _ in range(n)]).to(DEV)
    want = align_rows(ids, first, count, block_m)
    got = align_rows_fused(ids, first, count, block_m)
    for name in ("row_ids", "pos", "group_ends", "block_expert"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


# --- torch grouped against the dense reference ---------------------------------------------


@pytest.mark.parametrize("limit", [10.0, 0.5], ids=["published", "clamping"])
def test_grouped_torch_equals_the_dense_moe_in_float64(tiny, limit):
    cfg, w64, _ = tiny
    cfg = dataclasses.replace(cfg, swiglu_limit=limit)
    x = _x(cfg, 40)
    ref, ids = MoE(cfg, w64, LAYER, torch.float64)(x)
    got, gids = GroupedMoE(cfg, w64, LAYER, torch.float64, impl="torch")(x)
    assert torch.equal(gids, ids) and _rel(got, ref) <= REL
    forced = torch.flip(ids, [1])  # forced decisions route the same way in both
    want = MoE(cfg, w64, LAYER, torch.float64)(x, forced)[0]
    assert _rel(GroupedMoE(cfg, w64, LAYER, torch.float64)(x, forced)[0], want) <= REL


def test_grouped_torch_fp32_grouped_mm_rows_match_the_gather_path(tiny):
    """``torch._grouped_mm``'s offsets semantics (rows past the last group undefined, empty
    groups) on the CPU build where it exists; the CUDA bf16 path is the same call."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm absent")
    cfg, w64, _ = tiny
    w32 = {k: v.float() for k, v in w64.items()}
    x = _x(cfg, 17, torch.float32)
    a, ia = GroupedMoE(cfg, w32, LAYER, torch.float32, impl="torch", mm_impl="grouped_mm")(x)
    b, ib = GroupedMoE(cfg, w32, LAYER, torch.float32, impl="torch", mm_impl="gather")(x)
    assert torch.equal(ia, ib) and _rel(a, b) <= 1e-5


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("ep", [True, False], ids=["ep", "sliced"])
def test_tp_and_ep_partials_sum_to_the_whole(tiny, size, ep):
    cfg, w64, res = tiny
    x = _x(cfg, 24)
    whole, ids = MoE(cfg, w64, LAYER, torch.float64)(x)
    parts, qparts = [], []
    for r in range(size):
        shard = shard_weights(w64, cfg, TPGroup(r, size), ep)
        y, gids = GroupedMoE(cfg, shard, LAYER, torch.float64, tp=Partial(r, size))(x)
        assert torch.equal(gids, ids)  # the router is replicated
        parts.append(y)
        # resident weights cut on their codes and scales give the same rank output
        qshard = shard_weights(res, cfg, TPGroup(r, size), ep)
        qparts.append(GroupedMoE(cfg, qshard, LAYER, torch.float64, tp=Partial(r, size))(x)[0])
        assert torch.equal(qparts[-1], parts[-1])
    # the partials are each rounded to the compute dtype here (the real all-reduce sums first)
    assert _rel(torch.stack(parts).sum(0), whole) <= REL


# --- the W4A8 Triton kernel ----------------------------------------------------------------


def test_triton_w4a8_equals_the_torch_grouped_moe(tiny):
    cfg, w64, res = tiny
    dev_res = {k: v.to(DEV) for k, v in res.items() if k.startswith(LAYER + ".ffn.")}
    w32 = {k: v.float() for k, v in w64.items() if k.startswith(LAYER + ".ffn.")}
    x = _x(cfg, 21, torch.float32, seed=5)
    ref, ids = GroupedMoE(cfg, w32, LAYER, torch.float32, impl="torch")(x)
    # dot="fp32": the exact operands on any device (the FP8 tensor-core mode keeps fewer bits in
    # its accumulation; tests/gpu/test_resident_gpu.py holds it to its own bound)
    got, gids = GroupedMoE(cfg, dev_res, LAYER, torch.float32, impl="triton", dot="fp32")(x.to(DEV))
    assert torch.equal(gids.cpu(), ids)
    # float32 summation order only; an FP8 near-tie of the intermediate may take the other side
    assert _rel(got.cpu(), ref) <= 1e-5
    # rank 1 of 2 under whole-expert EP: rows routed to rank 0's experts contribute nothing
    shard = shard_weights(dev_res, cfg, TPGroup(1, 2), expert_parallel=True)
    shard32 = shard_weights(w32, cfg, TPGroup(1, 2), expert_parallel=True)
    p_ref = GroupedMoE(cfg, shard32, LAYER, torch.float32, tp=Partial(1, 2), impl="torch")(x)[0]
    p_got = GroupedMoE(
        cfg, shard, LAYER, torch.float32, tp=Partial(1, 2), impl="triton", dot="fp32"
    )(x.to(DEV))[0]
    assert _rel(p_got.cpu(), p_ref) <= 1e-5


def test_shared_expert_on_a_side_stream_gives_the_same_bits(tiny, monkeypatch):
    """``SHARED_EXPERT_STREAM``: the shared expert forked before the routed stages and joined
    before the combine: the same kernels on the same inputs (a recording stand-in for the
    stream on the CPU; on CUDA the device's side stream, graph-captured in
    tests/gpu/test_shared_stream_gpu.py)."""
    from v41plan.runtime import resident
    from v41plan.runtime.kernels import triton_moe

    cfg, _, res = tiny
    dev_res = {k: v.to(DEV) for k, v in res.items() if k.startswith(LAYER + ".ffn.")}
    moe = GroupedMoE(cfg, dev_res, LAYER, torch.float32, impl="triton", dot="fp32")
    x = _x(cfg, 5, torch.float32, seed=9).to(DEV)
    want, ids = moe(x)
    events = []

    class Recording:
        @contextlib.contextmanager
        def fork(self):
            events.append("fork")
            yield
            events.append("forked")

        def join(self):
            events.append("join")

    shared = moe.shared_expert
    monkeypatch.setattr(
        moe, "shared_expert", lambda *a: events.append("shared") or shared(*a)
    )  # fmt: skip
    combine = triton_moe.moe_combine
    monkeypatch.setattr(
        triton_moe, "moe_combine", lambda *a: events.append("combine") or combine(*a)
    )  # fmt: skip
    monkeypatch.setattr(resident, "shared_expert_stream", lambda device: Recording())
    got, gids = moe(x)
    # launched inside the fork, joined before the combine that adds it
    assert events == ["fork", "shared", "forked", "join", "combine"]
    assert torch.equal(gids, ids) and torch.equal(got, want)
    if DEV == "cpu":  # the flag asks for a stream on CUDA devices only
        monkeypatch.undo()
        monkeypatch.setattr(resident, "SHARED_EXPERT_STREAM", True)
        assert resident.shared_expert_stream(torch.device("cpu")) is None


def test_forced_decision_check_accepts_the_kernel_and_catches_planted_faults(tiny):
    """The check the GPU runs on the FP8-dot kernel (``tests/runtime/moe_forced.py``): here, in
    float32 dots, it accepts the kernel; a lane moved two E4M3 steps, a scale doubled, a
    perturbed ``w2`` row or a perturbed sum each fail it."""
    from tests.runtime.moe_forced import forced_decision_report
    from v41plan.runtime.kernels.triton_moe import grouped_moe_w4a8_stages, moe_combine
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    cfg, _w64, res = tiny
    w1, w3, w2 = (res[f"{LAYER}.ffn.experts.{n}"].to(DEV) for n in ("w1", "w3", "w2"))
    n, k = 12, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, cfg.hidden_size, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(w1.shape[0], generator=g)[:k] for _ in range(n)]).to(DEV)
    wts = torch.rand(n, k, generator=g).to(DEV)
    xq, xs = act_quant_fp8(x)
    lim = 10.0
    st = grouped_moe_w4a8_stages(xq, xs, ids, wts, w1, w3, w2, 0, lim, torch.float32, "fp32")
    out = moe_combine(st.y_rows, st.rows.pos, k)
    acc = cfg.hidden_size * 2.0**-24

    def report(stages, combined):
        return forced_decision_report(xq, xs, ids, wts, w1, w3, w2, lim, stages, combined, acc)

    r = report(st, out)
    assert (r["bad_lanes"], r["bad_scales"]) == (0, 0), r
    assert r["y_rows error/bound"] <= 1.0 and r["combined error/bound"] <= 1.0, r
    row = int(st.rows.pos[0])
    lane = int(st.act[row].view(torch.float8_e4m3fn).float().abs().argmax())
    act = st.act.clone()
    act[row, lane] -= 2  # two E4M3 steps toward zero
    assert report(dataclasses.replace(st, act=act), out)["bad_lanes"] == 1
    scales = st.act_scales.clone()
    scales[row, 0] += 1
    assert report(dataclasses.replace(st, act_scales=scales), out)["bad_scales"] == 1
    y_rows = st.y_rows.clone()
    y_rows[row, 0] += 1e-3 * y_rows[row].abs().max()
    assert report(dataclasses.replace(st, y_rows=y_rows), out)["y_rows error/bound"] > 1.0
    out2 = out.clone()
    out2[0, 0] += 1e-3 * out[0].abs().max()
    assert report(st, out2)["combined error/bound"] > 1.0


def test_triton_w4a8_rounds_like_the_bf16_reference(tiny):
    """bf16 compute: the linear outputs and the SwiGLU product round to bf16 in the kernel as
    in ``layers.MoE``: the layer equals the dense bf16 reference to a bf16 step (without those
    roundings it is 2.4e-2 away; on the interpreter it is exactly equal)."""
    cfg, w64, res = tiny
    dev_res = {k: v.to(DEV) for k, v in res.items() if k.startswith(LAYER + ".ffn.")}
    wbf = {k: v.to(torch.bfloat16) for k, v in w64.items() if k.startswith(LAYER + ".ffn.")}
    wbf[LAYER + ".ffn.gate.bias"] = w64[LAYER + ".ffn.gate.bias"]
    x = _x(cfg, 64, torch.bfloat16, seed=6)
    ref, ids = MoE(cfg, wbf, LAYER, torch.bfloat16)(x)
    got, gids = GroupedMoE(cfg, dev_res, LAYER, torch.bfloat16, impl="triton", dot="fp32")(
        x.to(DEV)
    )
    assert torch.equal(gids.cpu(), ids)
    assert _rel(got.cpu(), ref) <= 2.0**-8


# --- gloo ------------------------------------------------------------------------------------


def _gloo_worker(rank: int, size: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    cfg = config_from_cache_spec(load_cache_spec("tiny"))
    res = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0)).process(resident=True)
    x = _x(cfg, 16)
    result = {}
    for ep in (True, False):
        shard = shard_weights(res, cfg, TPGroup(rank, size), ep)
        y, ids = GroupedMoE(cfg, shard, LAYER, torch.float64, tp=TPGroup(rank, size))(x)
        result[ep] = (y, ids)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def test_gloo_tp2_resident_matches_world_size_1(tiny, tmp_path):
    import torch.multiprocessing as mp

    cfg, w64, _ = tiny
    init = f"file://{tmp_path / 'store'}"
    out = str(tmp_path / "out")
    mp.start_processes(_gloo_worker, args=(2, init, out), nprocs=2, start_method="spawn")
    whole, ids = MoE(cfg, w64, LAYER, torch.float64)(_x(cfg, 16))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for ep in (True, False):
            y, gids = got[ep]
            assert torch.equal(gids, ids) and _rel(y, whole) <= REL


def test_fp4_pair_bytes_are_the_codes_values_over_64():
    """``e2m1_pair_bytes`` on every byte: each nibble's E4M3 byte decodes to its E2M1 value
    times ``2**-6`` (signs and the subnormal 0.5 included), low nibble first."""
    from v41plan.model.quant import E2M1_VALUES

    p = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEV)
    lo, hi = torch.empty_like(p), torch.empty_like(p)
    _pair_bytes_kernel[(1,)](p, lo, hi)
    mag = torch.tensor(E2M1_VALUES)
    table = torch.cat([mag, -mag])  # bit 3 the sign (code 8 is -0.0: equal to 0.0)
    b = torch.arange(256)
    for got, nib in ((lo, b & 15), (hi, b >> 4)):
        assert torch.equal(got.cpu().view(torch.float8_e4m3fn).float() * 64.0, table[nib])


@triton.jit
def _pair_bytes_kernel(p_ptr, lo_ptr, hi_ptr):
    """``e2m1_pair_bytes`` over 256 bytes."""
    i = tl.arange(0, 256)
    lo, hi = e2m1_pair_bytes(tl.load(p_ptr + i))
    tl.store(lo_ptr + i, lo.to(tl.uint8))
    tl.store(hi_ptr + i, hi.to(tl.uint8))


@triton.jit
def _bf16_tiles_kernel(
    w_ptr, s_ptr, x_ptr, xs_ptr, wout_ptr, xout_ptr, swn, ssn, sxm, sxsm,
    K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The bf16 mode's operand tiles at K offset ``program_id(0) * BK``, stored as float32."""
    k0 = tl.program_id(0) * BK
    rn = tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    kmask = rk < K
    b, _ = load_fp4_tile(w_ptr, s_ptr, rn, rk, k0, rn < BN, kmask, swn, ssn, K, 1, BN, BK)
    tl.store(wout_ptr + rn[:, None] * K + rk[None, :], b.to(tl.float32), mask=kmask[None, :])
    rm = tl.arange(0, BM)
    a, _ = load_a_tile(x_ptr, xs_ptr, rm, rk, k0, rm < BM, kmask, sxm, sxsm, False, 1, BM, BK)
    tl.store(xout_ptr + rm[:, None] * K + rk[None, :], a.to(tl.float32), mask=kmask[None, :])


def test_bf16_mode_tiles_are_the_dequantized_operands():
    """The bf16 dot mode's operands (a tile's BK / 32 scales loaded once, codes through the E4M3
    conversion, scaled in float32, then bf16): the dequantized FP4 weight and FP8 activations,
    exactly, a partial last K tile included."""
    from v41plan.model.quant import QuantWeight, e8m0_encode, fake_fp8
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    N, M, K, BK = 32, 16, 96, 64
    g = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    field = torch.randint(-12, 4, (N, K // 32), generator=g)
    scales = e8m0_encode(torch.pow(2.0, field.to(torch.float32)))
    w = QuantWeight(codes.view(torch.int8), scales, "fp4")
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, K)
    xq, xs = act_quant_fp8(x.to(DEV))
    c8, s8 = codes.to(DEV), scales.view(torch.uint8).to(DEV)
    wout = torch.full((N, K), float("nan"), device=DEV)
    xout = torch.full((M, K), float("nan"), device=DEV)
    xq8, xs8 = xq.view(torch.uint8), xs.view(torch.uint8)
    _bf16_tiles_kernel[(triton.cdiv(K, BK),)](
        c8, s8, xq8, xs8, wout, xout, c8.stride(0), s8.stride(0), xq8.stride(0), xs8.stride(0),
        K=K, BN=N, BM=M, BK=BK,
    )  # fmt: skip
    assert torch.equal(wout.cpu(), w.dequantize(torch.float32))
    assert torch.equal(xout.cpu(), fake_fp8(x, 32))


def test_prefetch_gives_the_same_bits(tiny):
    """``MoEConfig.prefetch`` (each step's raw tiles loaded one step ahead, registers carried
    through the K loop) runs the same arithmetic: the intermediate's codes and scales, the rows
    and the combined output equal the plain loop's bit for bit, over several K steps with a
    partial last one; the FP8 mode refuses it."""
    from v41plan.runtime.kernels.triton_moe import MoEConfig, grouped_moe_w4a8_stages
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    cfg, _w64, res = tiny
    w1, w3, w2 = (res[f"{LAYER}.ffn.experts.{n}"].to(DEV) for n in ("w1", "w3", "w2"))
    n, k = 9, cfg.num_experts_per_tok
    D, I = cfg.hidden_size, w1.shape[1]
    bk = 96 if D % 96 and D > 96 else 32  # K steps of 96 lanes leave a partial last step
    g = torch.Generator().manual_seed(31)
    x = torch.randn(n, D, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(w1.shape[0], generator=g)[:k] for _ in range(n)]).to(DEV)
    wts = torch.rand(n, k, generator=g).to(DEV)
    xq, xs = act_quant_fp8(x)
    assert D > bk and I > bk, (D, I, bk)  # several K steps in both GEMMs
    plain = MoEConfig(16, 32, 32, bk, num_warps=1, num_stages=1)
    ahead = dataclasses.replace(plain, prefetch=True)
    args = (xq, xs, ids, wts, w1, w3, w2, 0, 10.0, torch.float32, "fp32")
    a = grouped_moe_w4a8_stages(*args, config=plain)
    b = grouped_moe_w4a8_stages(*args, config=ahead)
    live = a.rows.row_ids >= 0  # padding rows of skipped blocks are never written
    assert torch.equal(a.rows.row_ids, b.rows.row_ids) and int(live.sum()) == n * k
    assert torch.equal(a.act[live], b.act[live])
    assert torch.equal(a.act_scales[live], b.act_scales[live])
    assert torch.equal(a.y_rows[live], b.y_rows[live])
    assert a.y_rows[live].abs().amax() > 0
    with pytest.raises(ValueError, match="prefetch"):
        grouped_moe_w4a8_stages(*args[:-1], "fp8", config=ahead)


@triton.jit
def _pair_tiles_kernel(
    w_ptr, s_ptr, lo_ptr, hi_ptr, swn, ssn,
    K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``fp4_pairs``' operands at K offset ``program_id(0) * BK``: the even lanes' values to
    ``lo [BN, K/2]`` and the odd lanes' to ``hi``, as float32 (the helpers are imported at
    the module's top: a compiled kernel cannot import)."""
    k0 = tl.program_id(0) * BK
    rn = tl.arange(0, BN)
    p, fld = fp4_raw(w_ptr, s_ptr, rn, k0, rn < BN, swn, ssn, K, BK)
    lo, hi = fp4_pairs(p, fld, ASM, tl.bfloat16, BN, BK)
    rh = k0 // 2 + tl.arange(0, BK // 2)
    at = rn[:, None] * (K // 2) + rh[None, :]
    tl.store(lo_ptr + at, lo.to(tl.float32), mask=(rh < K // 2)[None, :])
    tl.store(hi_ptr + at, hi.to(tl.float32), mask=(rh < K // 2)[None, :])


@pytest.mark.parametrize("asm", [False, True] if DEV == "cuda" else [False])
def test_pairs_operands_are_the_dequantized_weight_and_activation(asm):
    """``MoEConfig.pairs``' operands: every byte value's low and high nibble under scale fields
    from 2**-120 to 2**1 (the ``E2M1_PAIRS_ASM`` decode on CUDA, Triton's operations elsewhere) are
    the dequantized weight's even and odd lanes exactly, a partial last K tile included; the
    deinterleaved activation rows are the FP8 activations' values exactly."""
    from v41plan.model.quant import QuantWeight, e8m0_encode, fake_fp8
    from v41plan.runtime.kernels.triton_moe import deinterleave_fp8
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    N, K, BK = 32, 160, 128
    g = torch.Generator().manual_seed(23)
    codes = torch.arange(N * K // 2, dtype=torch.int32).reshape(N, K // 2) % 256
    codes = codes[:, torch.randperm(K // 2, generator=g)].to(torch.uint8)
    field = torch.randint(-40, 2, (N, K // 32), generator=g)
    field[0, 0], field[1, 0] = -120, 1  # the ends (values stay normal floats), and 2
    scales = e8m0_encode(torch.pow(2.0, field.to(torch.float32)))
    want = QuantWeight(codes.view(torch.int8), scales, "fp4").dequantize(torch.float32)
    c8, s8 = codes.to(DEV), scales.view(torch.uint8).to(DEV)
    lo = torch.full((N, K // 2), float("nan"), device=DEV)
    hi = torch.full((N, K // 2), float("nan"), device=DEV)
    _pair_tiles_kernel[(triton.cdiv(K, BK),)](
        c8, s8, lo, hi, c8.stride(0), s8.stride(0), K=K, BN=N, BK=BK, ASM=asm
    )
    assert torch.equal(lo.cpu(), want[:, 0::2]) and torch.equal(hi.cpu(), want[:, 1::2])
    x = torch.randn(5, K, generator=g) * torch.logspace(-3, 3, K)
    xq, xs = act_quant_fp8(x.to(DEV))
    xb = deinterleave_fp8(xq, xs).cpu().float()
    ref = fake_fp8(x, 32)
    assert torch.equal(xb, torch.cat([ref[:, 0::2], ref[:, 1::2]], dim=1))


def test_pairs_mode_matches_the_torch_moe_and_its_prefetch_gives_the_same_bits(tiny):
    """``MoEConfig.pairs`` (each K step as its even and odd lanes' dots) against the torch
    grouped MoE (float32 summation order only) and the forced-decision check; with
    ``prefetch`` too, the same bits."""
    from tests.runtime.moe_forced import forced_decision_report
    from v41plan.runtime.kernels.triton_moe import (
        MoEConfig,
        grouped_moe_w4a8_stages,
        moe_combine,
    )
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    cfg, _w64, res = tiny
    w1, w3, w2 = (res[f"{LAYER}.ffn.experts.{n}"].to(DEV) for n in ("w1", "w3", "w2"))
    n, k = 11, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(37)
    x = torch.randn(n, cfg.hidden_size, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(w1.shape[0], generator=g)[:k] for _ in range(n)]).to(DEV)
    wts = torch.rand(n, k, generator=g).to(DEV)
    xq, xs = act_quant_fp8(x)
    pairs = MoEConfig(16, 32, 32, 32, num_warps=1, num_stages=1, pairs=True)
    args = (xq, xs, ids, wts, w1, w3, w2, 0, 10.0, torch.float32, "fp32")
    st = grouped_moe_w4a8_stages(*args, config=pairs)
    out = moe_combine(st.y_rows, st.rows.pos, k)
    r = forced_decision_report(
        xq, xs, ids, wts, w1, w3, w2, 10.0, st, out, cfg.hidden_size * 2.0**-24
    )
    assert (r["bad_lanes"], r["bad_scales"]) == (0, 0), r
    assert r["y_rows error/bound"] <= 1.0 and r["combined error/bound"] <= 1.0, r
    plain = grouped_moe_w4a8_stages(*args, config=dataclasses.replace(pairs, pairs=False))
    assert _rel(out, moe_combine(plain.y_rows, plain.rows.pos, k)) <= 1e-5
    ahead = grouped_moe_w4a8_stages(*args, config=dataclasses.replace(pairs, prefetch=True))
    live = st.rows.row_ids >= 0
    assert torch.equal(st.act[live], ahead.act[live])
    assert torch.equal(st.y_rows[live], ahead.y_rows[live])
    with pytest.raises(ValueError, match="pairs"):
        grouped_moe_w4a8_stages(*args[:-1], "fp8", config=pairs)


def test_register_cap_gives_the_same_bits(tiny):
    """``MoEConfig.max_registers`` reaches the compiler (``maxnreg``) and changes no arithmetic:
    the pairs mode's intermediate, its scales and the rows equal the uncapped launch's bit for
    bit (on the GPU a cap of 64 makes the decode tiles spill; the interpreter ignores it)."""
    from v41plan.runtime.kernels.triton_moe import MoEConfig, grouped_moe_w4a8_stages
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    cfg, _w64, res = tiny
    w1, w3, w2 = (res[f"{LAYER}.ffn.experts.{n}"].to(DEV) for n in ("w1", "w3", "w2"))
    n, k = 7, cfg.num_experts_per_tok
    D = cfg.hidden_size
    g = torch.Generator().manual_seed(43)
    x = torch.randn(n, D, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(w1.shape[0], generator=g)[:k] for _ in range(n)]).to(DEV)
    wts = torch.rand(n, k, generator=g).to(DEV)
    xq, xs = act_quant_fp8(x)
    cpu = DEV == "cpu"
    free = MoEConfig(16, 32, 32, 64, num_warps=1 if cpu else 4, num_stages=1 if cpu else 3)
    free = dataclasses.replace(free, pairs=True)
    capped = dataclasses.replace(free, max_registers=64)
    args = (xq, xs, ids, wts, w1, w3, w2, 0, 10.0, torch.float32, "fp32" if cpu else "bf16")
    a = grouped_moe_w4a8_stages(*args, config=free)
    b = grouped_moe_w4a8_stages(*args, config=capped)
    live = a.rows.row_ids >= 0
    assert int(live.sum()) == n * k
    assert torch.equal(a.act[live], b.act[live])
    assert torch.equal(a.act_scales[live], b.act_scales[live])
    assert torch.equal(a.y_rows[live], b.y_rows[live])
    assert a.y_rows[live].abs().amax() > 0


def test_tma_mode_gives_the_pairs_modes_bits(tiny):
    """``MoEConfig.tma`` (activation rows written in the kernels' order, code tiles by TMA
    descriptors, scale bytes a step ahead) runs the pairs mode's arithmetic: the intermediate's
    codes, scales and the rows equal the pairs mode's bit for bit, over several K steps with a
    partial last one; the permuted rows are the tokens' deinterleaved values (zeros for
    padding); without pairs it is refused."""
    from v41plan.model.quant import QuantWeight
    from v41plan.runtime.kernels.triton_moe import (
        MoEConfig,
        deinterleave_fp8,
        deinterleave_rows,
        grouped_moe_w4a8_stages,
    )
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    cfg, _w64, res = tiny
    g = torch.Generator().manual_seed(41)

    def varied(w: QuantWeight) -> QuantWeight:
        # every 32-lane block its own scale (the random checkpoint's are all alike)
        fld = torch.randint(118, 127, w.scales.shape, generator=g, dtype=torch.int32)
        return QuantWeight(w.codes, fld.to(torch.uint8).view(w.scales.dtype), "fp4")

    w1, w3, w2 = (varied(res[f"{LAYER}.ffn.experts.{n}"]).to(DEV) for n in ("w1", "w3", "w2"))
    n, k = 13, cfg.num_experts_per_tok
    D, I = cfg.hidden_size, w1.shape[1]
    bk = 96 if D % 96 and D > 96 else 32  # a partial last K step
    assert D > bk and I > bk, (D, I, bk)
    x = torch.randn(n, D, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(w1.shape[0], generator=g)[:k] for _ in range(n)]).to(DEV)
    wts = torch.rand(n, k, generator=g).to(DEV)
    xq, xs = act_quant_fp8(x)
    warps = 1 if DEV == "cpu" else 4
    pairs = MoEConfig(16, 32, 32, bk, num_warps=warps, num_stages=1, pairs=True)
    tma = dataclasses.replace(pairs, tma=True, num_stages=1 if DEV == "cpu" else 3)
    dot = "fp32" if DEV == "cpu" else "bf16"
    args = (xq, xs, ids, wts, w1, w3, w2, 0, 10.0, torch.float32, dot)
    a = grouped_moe_w4a8_stages(*args, config=pairs)
    b = grouped_moe_w4a8_stages(*args, config=tma)
    live = a.rows.row_ids >= 0
    assert torch.equal(a.rows.row_ids, b.rows.row_ids) and int(live.sum()) == n * k
    assert torch.equal(a.act[live], b.act[live])
    assert torch.equal(a.act_scales[live], b.act_scales[live])
    assert torch.equal(a.y_rows[live], b.y_rows[live])
    assert a.y_rows[live].abs().amax() > 0
    rows = deinterleave_rows(xq, xs, a.rows.row_ids, k)
    tok = a.rows.row_ids.clamp_min(0) // k
    want = torch.where(live[:, None], deinterleave_fp8(xq, xs)[tok], torch.zeros_like(rows))
    assert torch.equal(rows, want)
    with pytest.raises(ValueError, match="tma"):
        grouped_moe_w4a8_stages(*args, config=dataclasses.replace(tma, pairs=False))


@pytest.mark.parametrize("hip", [None, "6.2"])
def test_decode_tiles_cap_registers_on_nvidia_only(monkeypatch, hip):
    """The one-token decode tiles (up to 16 routed rows) cap registers at 128 on an NVIDIA GPU
    (four programs an SM); the 64-lane tiles and a ROCm device (whose Triton refuses
    ``maxnreg``) take no cap, and the cap changes no tile."""
    from v41plan.runtime.kernels.triton_moe import default_moe_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    one = default_moe_config(6, "bf16", 5120, 2304)
    wide = default_moe_config(17, "bf16", 5120, 2304)
    assert one.max_registers == (128 if hip is None else None)
    assert wide.max_registers is None
    assert (one.block_n, wide.block_n, one.pairs, wide.pairs) == (32, 64, True, True)


def test_scales_fold_takes_fields_1_to_128_only():
    """``scales_fold``: the asm decode may fold a weight's scales times ``2**126`` into one
    multiply only where every E8M0 field is in ``[1, 128]`` (``2**(field - 1)`` is a bf16
    value; byte 0 is no scale). The runtime's experts are checked at load."""
    from v41plan.model.quant import QuantWeight
    from v41plan.runtime.kernels.triton_moe import FOLD_MAX_FIELD, scales_fold

    def w(fields):
        s = torch.tensor(fields, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return QuantWeight(torch.zeros(1, 1, 16, dtype=torch.int8), s.reshape(1, 1, -1), "fp4")

    assert FOLD_MAX_FIELD == 128
    assert scales_fold(w([1, 100, 128]), w([127]))
    assert not scales_fold(w([1, 100, 128]), w([129]))
    assert not scales_fold(w([0, 100]))
    assert not scales_fold(w([255]))
