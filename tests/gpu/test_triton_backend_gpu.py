"""``TritonBackend`` against ``TorchBackend`` op by op on the GPU, at tiny40 and medium widths.

Exact where the op is exact (scatters and packing: every byte of the pool; the top-k of one
score matrix; the scorer's top-k where every score is an exact sum); attention within
``1e-5 + 1e-5 |ref|`` in float32 and ``2e-2 + 2e-2 |ref|`` in bfloat16 (bf16 operands, fp32
accumulation, probabilities rounded to bf16 for the second product). Also: a CUDA graph of the
ops replays what eager runs computed. Skipped without CUDA or Triton.

    python -m pytest -q tests/gpu/test_triton_backend_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]
SPECS = ["tiny40", "medium"]
NEG = float("-inf")


@functools.cache
def _spec(name: str):
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec

    spec = resolve_spec(name)
    return spec, config_from_cache_spec(spec)


def _backends():
    pytest.importorskip("triton")
    # imported here: importing at collection would decorate the kernels before the CPU tests
    # set TRITON_INTERPRET
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    return TorchBackend(), TritonBackend()


def _pools(name: str, pair, num_pages=40, num_slots=6):
    """Two identical CUDA pools with random bytes."""
    from v41plan.runtime.pools import Pools

    spec, _ = _spec(name)
    g = torch.Generator(device="cuda").manual_seed(3)
    a = Pools(spec.geometry(*pair), num_pages, num_slots, device="cuda")
    a.backing.copy_(
        torch.randint(0, 256, a.backing.shape, generator=g, device="cuda", dtype=torch.uint8)
    )
    b = Pools(spec.geometry(*pair), num_pages, num_slots, device="cuda")
    b.backing.copy_(a.backing)
    return a, b


def _planes(p, owner):
    return (p.index[owner],) if owner in p.index else (p.index_values[owner], p.index_scales[owner])


def _rows(n, d, seed, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, generator=g, device="cuda")
    scale = torch.pow(2.0, torch.randint(-10, 8, (n, 1), generator=g, device="cuda").float())
    x = x * scale
    x[0, :4] = torch.tensor([0.0, -0.0, 448.0, -1e-30])
    return x.to(dtype)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatters_are_bit_exact(name, pair, dtype):
    from v41plan.model import quant as Q

    ref, tri = _backends()
    _, cfg = _spec(name)
    pr, pt = _pools(name, pair)
    d, dih, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    owner = min(pr.main)
    t = 96
    i = torch.arange(t, device="cuda")
    # distinct (slot, ring row) for every row that writes (two writes of one row would race in
    # either backend); the rest padding, or below their write bound
    slot = torch.where(i < 3 * W, i % 6, -1)
    pos = i // 6 + W
    write_from = torch.where(i % 5 == 4, 1 << 40, 0)
    kv = Q.fake_fp8(_rows(t, d, 1)).to(dtype)
    table = torch.randperm(40, device="cuda")[:24].view(3, 8)
    table[1, 5:] = -1
    batch = i % 4 - 1  # -1 padding rows
    crow = i // 4
    lat = Q.fake_fp4_e4m3(_rows(t, d, 2), 16).to(dtype)
    key = _rows(t, dih, 3)
    key, key_scale = Q.quant_fp8_rows(key) if pair[1] == "fp8" else (Q.fake_fp4(key, 32), None)
    for kb, p in ((ref, pr), (tri, pt)):
        kb.ring_write(p.ring(5), kv, slot, pos, write_from, p.sink_slot)
        addr = p.row_address(owner, table, batch, crow)
        # keep only real rows: the reference would write a kept sink-bound row into the sink
        keep = (addr.page != p.sink_page) & (i % 7 != 3)
        kb.main_scatter(p.main[owner], lat, addr.page, addr.row, keep, p.sink_page)
        kb.index_key_store(
            _planes(p, owner), key.to(dtype), key_scale, addr.page, addr.row, keep, p.sink_page
        )
    assert torch.equal(pr.backing, pt.backing)
    assert not tri.fallbacks, tri.fallbacks


@pytest.mark.parametrize("name", SPECS)
def test_compressor_tails_and_cursor_are_exact(name):
    ref, tri = _backends()
    _, cfg = _spec(name)
    pr, pt = _pools(name, ("bf16", "fp8"))
    pr.tail_values.normal_()
    pr.tail_scores.normal_()
    pt.backing.copy_(pr.backing)
    t, d = 64, cfg.head_dim
    slot = torch.arange(t, device="cuda") // 16 - 1  # slots -1, 0, 1, 2
    pos = torch.arange(t, device="cuda") % 16 + 3
    first = pos == 3
    last = pos == 18
    v, s = torch.randn(t, d, device="cuda"), torch.randn(t, d, device="cuda")
    outs = [
        kb.compress_groups(
            v, s, pos, slot, first, last, p.tail_values[:, 0], p.tail_scores[:, 0], p.sink_slot
        )
        for kb, p in ((ref, pr), (tri, pt))
    ]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    vals = torch.randint(-1, 1000, (4, pr.cursor.shape[1]), device="cuda")
    for kb, p in ((ref, pr), (tri, pt)):
        kb.cursor_write(p.cursor, torch.tensor([2, -1, 0, 5], device="cuda"), vals, p.sink_slot)
    assert torch.equal(pr.backing, pt.backing)


def _score_case(name, ix, exact, t=48, seed=0):
    """An index plane of 3 requests, query rows with ragged bounds (0, page edges, past the table)
    and a padding row; exact: integer codes and power-of-two scales, so every score is exact."""
    from v41plan.model import quant as Q

    ref, _ = _backends()
    _, cfg = _spec(name)
    p, _ = _pools(name, ("bf16", ix), num_pages=64)
    owner = min(p.main)
    rpp, dih, hi = p.rows_per_page[owner], cfg.index_head_dim, cfg.index_n_heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = max(6, -(-2 * cfg.index_topk // rpp))  # more rows than the top-k takes
    table = torch.randperm(64, generator=g, device="cuda")[: 3 * n_pages].view(3, n_pages)
    table[2, 3] = -1
    n = n_pages * rpp
    batch = torch.arange(3 * n, device="cuda") // n
    crow = torch.arange(3 * n, device="cuda") % n
    if exact and ix == "fp8":
        key = torch.randint(-3, 4, (3 * n, dih), generator=g, device="cuda").float()
        key_scale = torch.full((3 * n, 1), 0.125, device="cuda")
    elif exact:
        e2m1 = torch.tensor(Q.E2M1_VALUES, device="cuda")
        key = e2m1[torch.randint(0, 5, (3 * n, dih), generator=g, device="cuda")]
        key[:, ::32] = 6.0
        key_scale = None
    else:
        raw = torch.randn(3 * n, dih, generator=g, device="cuda")
        key, key_scale = Q.quant_fp8_rows(raw) if ix == "fp8" else (Q.fake_fp4(raw, 32), None)
    addr = p.row_address(owner, table, batch, crow)
    ok = torch.ones(3 * n, dtype=torch.bool, device="cuda")
    ref.index_key_store(_planes(p, owner), key, key_scale, addr.page, addr.row, ok, p.sink_page)
    qb = torch.randint(0, 3, (t,), generator=g, device="cuda")
    qb[-1] = -1
    bound = torch.randint(0, n + rpp, (t,), generator=g, device="cuda")
    bound[:4] = torch.tensor([0, rpp, rpp + 1, n], device="cuda")
    if exact and ix == "fp8":
        q = torch.randint(-4, 5, (t, hi, dih), generator=g, device="cuda").float()
        q[..., 0] = 448.0
        q = q * 2.0**-4
    elif exact:
        e2m1 = torch.tensor(Q.E2M1_VALUES, device="cuda")
        q = e2m1[torch.randint(0, 8, (t, hi, dih), generator=g, device="cuda")]
        q[..., ::32] = 6.0
    else:
        q = torch.randn(t, hi, dih, generator=g, device="cuda")
    w = torch.randint(-2, 3, (t, hi), generator=g, device="cuda").float() * 0.5
    if not exact:
        w = torch.randn(t, hi, generator=g, device="cuda")
    pages = torch.where(qb[:, None] >= 0, table[qb.clamp(min=0)], -1)
    return cfg, _planes(p, owner), q, w, bound, pages


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("ix", ["fp8", "fp4"])
def test_scorer_top_k_is_exact_on_exact_scores(name, ix):
    ref, tri = _backends()
    cfg, planes, q, w, bound, pages = _score_case(name, ix, exact=True)
    k = cfg.index_topk
    assert torch.equal(
        tri.scores(planes, q, w, bound, pages), ref.scores(planes, q, w, bound, pages)
    )
    assert torch.equal(
        tri.score_topk(planes, q, w, bound, pages, k, None),
        ref.score_topk(planes, q, w, bound, pages, k, None),
    )
    got = tri.score_candidates_topk(
        planes, q, w, bound, pages, k, cfg.candidate_block_size, cfg.candidate_topk_blocks
    )
    want = ref.score_candidates_topk(
        planes, q, w, bound, pages, k, cfg.candidate_block_size, cfg.candidate_topk_blocks
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(
        tri.score_topk(planes, q, w, bound, pages, k, want[1]),
        ref.score_topk(planes, q, w, bound, pages, k, want[1]),
    )
    assert not tri.fallbacks, tri.fallbacks


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("ix", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_within_rounding_and_select_exact_on_one_matrix(name, ix, dtype):
    ref, tri = _backends()
    cfg, planes, q, w, bound, pages = _score_case(name, ix, exact=False, seed=1)
    q, w = q.to(dtype), w.to(dtype)
    s_ref = ref.scores(planes, q, w, bound, pages)
    s_tri = tri.scores(planes, q, w, bound, pages)
    assert torch.equal(s_tri == NEG, s_ref == NEG)
    fin = s_ref > NEG
    tol = 1e-4 if s_ref.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(s_tri[fin].float(), s_ref[fin].float(), rtol=tol, atol=tol)
    k = cfg.index_topk
    assert torch.equal(tri.topk_ids(s_ref, k), ref.topk_ids(s_ref, k))
    br, bk = cfg.candidate_block_size, cfg.candidate_topk_blocks
    assert torch.equal(
        tri.candidate_blocks(s_ref, bound, br, bk), ref.candidate_blocks(s_ref, bound, br, bk)
    )
    # the scorer's own top-k against the reference's set: equal up to near-ties (bf16 scores
    # tie often, and a last-bit difference moves a tied row across the cut)
    a = tri.score_topk(planes, q, w, bound, pages, k, None)
    b = ref.score_topk(planes, q, w, bound, pages, k, None)
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b))
    least = 0.98 if s_ref.dtype == torch.float32 else 0.95
    assert same >= least * sum(len(set(y.tolist())) for y in b)


@pytest.mark.parametrize("programs", [0, 8, 64])
def test_segment_select_is_the_references_at_decode_sizes(programs):
    # 64 rows of 32K scores (a 64K context at ratio 2): random, tied in steps, some rows
    # bounded short or empty; the segment select (auto: enough programs to fill the device)
    g = torch.Generator(device="cuda").manual_seed(12)
    s = torch.randn(64, 32768, generator=g, device="cuda")
    s[::3] = torch.round(s[::3] * 4) / 4  # many ties at the cut
    bound = torch.full((64,), 32768, device="cuda")
    bound[1], bound[2], bound[5] = 0, 300, 20000
    s = s.masked_fill(torch.arange(32768, device="cuda") >= bound[:, None], NEG)
    ref, tri = _backends()
    tri.select_programs = programs
    assert tri.select_segments_for(64, 32768, s.device) > 1
    for k in (512, 2048):
        want = ref.topk_ids(s, k)
        assert torch.equal(tri.topk_ids(s, k), want), k
        got = torch.empty_like(want)  # with the row bounds, as score_topk selects
        tri._select(s, bound, k, got)
        assert torch.equal(got, want), k


@pytest.mark.parametrize(
    "loose,ternary,held,pack_max",
    [(False, False, True, 4096), (True, False, True, 4096), (True, True, True, 4096),
     (True, True, False, 4096), (True, True, True, 0)],
    ids=["kth-bounds", "loose-bounds", "loose-ternary", "lists-written", "two-scans"],
)  # fmt: skip
@pytest.mark.parametrize("n", [4096, 32768], ids=["resident", "long-row"])
def test_early_exit_select_is_the_references_at_decode_sizes(n, loose, ternary, held, pack_max):
    # select_early_exit (and the long-row select's loose bounds, the ternary search): 64 rows,
    # random and tied in steps, some bounded short or empty
    g = torch.Generator(device="cuda").manual_seed(14)
    s = torch.randn(64, n, generator=g, device="cuda")
    s[::3] = torch.round(s[::3] * 4) / 4  # many ties at the cut: the search runs to the end
    bound = torch.full((64,), n, device="cuda")
    bound[1], bound[2], bound[5] = 0, 300, n // 2 + 7
    s = s.masked_fill(torch.arange(n, device="cuda") >= bound[:, None], NEG)
    ref, tri = _backends()
    tri.select_early_exit = True
    tri.select_loose_bounds, tri.select_ternary, tri.select_lists_held = loose, ternary, held
    tri.select_packed_scan_max = pack_max
    for k in (512, 2048):
        want = ref.topk_ids(s, k)
        assert torch.equal(tri.topk_ids(s, k), want), k
        got = torch.empty_like(want)
        tri._select(s, bound, k, got)
        assert torch.equal(got, want), k


def _attention_case(name, kv, dtype, heads=None, t=40, seed=0):
    """Query rows of 4 requests (decode rows reading the ring, prefill rows reading this
    forward's rows above a ring cut, an empty window, a padding row) over random pools."""
    from v41plan.model import quant as Q

    ref, _ = _backends()
    _, cfg = _spec(name)
    p, _ = _pools(name, (kv, "fp8"), num_pages=64)
    owner = min(p.main)
    rpp, d, W, K = p.rows_per_page[owner], cfg.head_dim, cfg.sliding_window, cfg.index_topk
    h = heads or cfg.num_attention_heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    ring = p.ring(3)
    n_hist = 3 * W
    for s in range(4):
        hist = Q.fake_fp8(torch.randn(n_hist, d, generator=g, device="cuda"))
        zero = torch.zeros(n_hist, dtype=torch.long, device="cuda")
        pos = torch.arange(n_hist, device="cuda")
        ref.ring_write(ring, hist, torch.full_like(pos, s), pos, zero, p.sink_slot)
    n_pages = 6
    table = torch.randperm(64, generator=g, device="cuda")[: 4 * n_pages].view(4, n_pages)
    table[3, 2] = -1
    lat = Q.fake_fp4_e4m3(torch.randn(4 * n_pages * rpp, d, generator=g, device="cuda"), 16)
    b = torch.arange(lat.shape[0], device="cuda") // (n_pages * rpp)
    c = torch.arange(lat.shape[0], device="cuda") % (n_pages * rpp)
    addr = p.row_address(owner, table, b, c)
    ones = torch.ones(lat.shape[0], dtype=torch.bool, device="cuda")
    ref.main_scatter(p.main[owner], lat, addr.page, addr.row, ones, p.sink_page)
    kvf = Q.fake_fp8(torch.randn(t, d, generator=g, device="cuda")).to(dtype)
    rows = torch.arange(t, device="cuda")
    slot = rows * 4 // t  # four requests, each a contiguous run of rows
    start = (torch.arange(4, device="cuda") * t + 3) // 4
    position = 2 * W + rows - start[slot]
    # the first half of the rows read their whole window from the ring, the rest cut it 3 rows
    # below themselves (this forward's rows above)
    ring_until = torch.where(rows < t // 2, position + 1, position - 3)
    window_lo = torch.zeros(t, dtype=torch.long, device="cuda")
    window_lo[1] = position[1] + 1  # an empty window
    ids = torch.randint(0, n_pages * rpp, (t, K), generator=g, device="cuda").sort(1).values
    ids[:, K - K // 4 :] = -1
    ids[2] = -1  # no selected row
    slot[-1] = -1  # a padding row
    pages = table[slot.clamp(min=0)]
    q = torch.randn(t, h, d, generator=g, device="cuda").to(dtype)
    sink = torch.randn(h, generator=g, device="cuda")
    args = (q, sink, d**-0.5, ring, kvf, rows, slot, position, window_lo, ring_until, W)
    return args, (p.main[owner], ids, pages, rpp)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("kv", ["bf16", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4, 40])
def test_sparse_attention_within_tolerance(name, kv, dtype, rows):
    ref, tri = _backends()
    args, sel = _attention_case(name, kv, dtype, t=rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in (sel, (None, None, None, sel[3])):
        out_ref = torch.full_like(args[0], float("nan"))
        out = torch.full_like(args[0], float("nan"))
        ref.sparse_attention(*args, *s, out_ref)
        tri.sparse_attention(*args, *s, out)
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=tol, atol=tol)
    assert not tri.fallbacks, tri.fallbacks


def test_v41_flash_widths_attention(name="medium"):
    """64 heads (V4.1-Flash) over medium's pools: the head-blocked launch."""
    ref, tri = _backends()
    for rows in (8, 64):
        args, sel = _attention_case(name, "bf16", torch.bfloat16, heads=64, t=rows)
        out_ref = torch.empty_like(args[0])
        out = torch.empty_like(args[0])
        ref.sparse_attention(*args, *sel, out_ref)
        tri.sparse_attention(*args, *sel, out)
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv", ["bf16", "fp4"])
@pytest.mark.parametrize("override", [{"DV": 256}, {"DV": 128, "SPLITS": 2, "HB": 32}])
def test_column_split_attention_within_tolerance(kv, override):
    """Programs that accumulate a part of the latent's columns (``DV``) at 64 heads, with and
    without key splits, bf16 and packed pools: the default launch's tolerance."""
    ref, tri = _backends()
    tri.attention_override = override
    args, sel = _attention_case("medium", kv, torch.bfloat16, heads=64, t=64)
    out_ref = torch.empty_like(args[0])
    out = torch.empty_like(args[0])
    ref.sparse_attention(*args, *sel, out_ref)
    tri.sparse_attention(*args, *sel, out)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    assert not tri.fallbacks, tri.fallbacks


def test_ops_replay_in_a_cuda_graph():
    """One capture of attention, scorer and scatters; replays after the inputs change on the
    device compute what eager runs compute."""
    _, tri = _backends()
    args, sel = _attention_case("medium", "bf16", torch.bfloat16, t=16)
    cfg, planes, q, w, bound, pages = _score_case("medium", "fp8", exact=True, t=16)
    out = torch.empty_like(args[0])
    ids_out = torch.empty(16, cfg.index_topk, dtype=torch.long, device="cuda")

    def step():
        tri.sparse_attention(*args, *sel, out)
        ids_out.copy_(tri.score_topk(planes, q, w, bound, pages, cfg.index_topk, None))

    step()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        # new bounds, positions and queries, written in place
        bound.copy_(torch.randint(0, int(bound.max()) + 1, bound.shape, device="cuda"))
        args[7].add_(trial)
        args[0].normal_()
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone(), ids_out.clone()
        step()
        assert torch.equal(got[0], out) and torch.equal(got[1], ids_out)
