"""The Triton backend's kernels under ``TRITON_INTERPRET=1`` on CPU, against ``TorchBackend``.

Scatters and packing must write the reference's bytes; the top-k of a score matrix must pick
the reference's ids (ties to the smaller position); the scorer's scores match to fp32 rounding
(and exactly where every sum is exact, so its top-k does too); attention matches within the
stated float32 tolerance. Tiny shapes: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

_PREV = os.environ.get("TRITON_INTERPRET")


def _interpret(on: bool) -> None:
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    elif _PREV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV


# The flag is read when a kernel is decorated (at import) and by triton at launch time: it is
# set here for the imports and, by the fixture below, while this module's tests run.
_interpret(True)
try:
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from v41plan.runtime.kernels import triton_common

    if not triton_common.interpreted(triton_common.rint):  # imported earlier without it
        for name in ("common", "scatter", "scorer", "attention", "backend"):
            mod = sys.modules.get(f"v41plan.runtime.kernels.triton_{name}")
            if mod is not None:
                importlib.reload(mod)
    from v41plan.runtime.kernels.triton_backend import TritonBackend
finally:
    _interpret(False)


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    from triton.runtime import interpreter

    _interpret(True)
    real = triton_common.patch_interpreter()
    yield
    interpreter._patch_lang = real
    _interpret(False)


from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model import quant as Q
from v41plan.runtime.kernels.torch_ref import TorchBackend
from v41plan.runtime.pools import Pools

PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]
REF = TorchBackend()
NEG = float("-inf")


@pytest.fixture(scope="module")
def tiny(specs_dir):
    return load_cache_spec_unchecked(str(specs_dir / "tiny.yaml"))


def _tk(**attrs) -> TritonBackend:
    kb = TritonBackend(num_sms=2)
    for k, v in attrs.items():
        setattr(kb, k, v)
    return kb


def _planes(p: Pools, owner: int):
    return (p.index[owner],) if owner in p.index else (p.index_values[owner], p.index_scales[owner])


def _twin_pools(tiny, pair, **kw):
    """Two identical pools, their bytes random (so a write of the wrong byte shows)."""
    a = Pools(tiny.geometry(*pair), **kw)
    g = torch.Generator().manual_seed(7)
    a.backing.copy_(torch.randint(0, 256, a.backing.shape, generator=g, dtype=torch.uint8))
    b = Pools(tiny.geometry(*pair), **kw)
    b.backing.copy_(a.backing)
    return a, b


def _hard_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Rows that exercise the rounding: wide magnitudes, exact zeros and negative zeros, values
    half-way between grid points, a row of one value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.pow(2.0, torch.randint(-12, 8, (n, 1), generator=g))
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 448.0, 1e-30, -3.0])
    x[1] = 448.0 * 2.0**-4  # scale 2**-4 exactly
    x[1, 1::2] = torch.arange(d // 2) * 2.0**-4 * 1.0625  # 17/16: half-way between E4M3 codes
    x[2] = 6.0
    x[2, 1:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] + [-5.0] * 7)
    return x


# -- scatters -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pair", PAIRS)
def test_scatters_write_the_reference_bytes(tiny, pair):
    pr, pt = _twin_pools(tiny, pair, num_pages=4, num_slots=3)
    kb = _tk()
    n = 19
    slot = torch.tensor([2] * 4 + [0] * 12 + [1] + [-1, -1])
    pos = torch.tensor(list(range(5, 9)) + list(range(12)) + [11, 0, 0])
    write_from = torch.tensor([5] * 4 + [10] * 12 + [11] + [0, 0])
    x = _hard_rows(n, 64, 1)
    for b, p in ((REF, pr), (kb, pt)):
        b.ring_write(p.ring(3), x, slot, pos, write_from, p.sink_slot)
    assert torch.equal(pr.backing, pt.backing), "ring_write"

    table = torch.tensor([[3, 1, -1], [0, 2, -1]])
    batch = torch.tensor([0] * 9 + [1] * 8 + [-1, 0])
    crow = torch.tensor(list(range(9)) + list(range(10, 18)) + [0, 40])
    lat = _hard_rows(n, 64, 2)
    if pair[0] == "fp4":
        lat[3:] = Q.fake_fp4_e4m3(lat[3:], 16)
    keep = batch >= 0
    keep[5] = False
    for b, p in ((REF, pr), (kb, pt)):
        addr = p.row_address(8, table, batch, crow)
        b.main_scatter(p.main[8], lat, addr.page, addr.row, keep, p.sink_page)
    assert torch.equal(pr.backing, pt.backing), "main_scatter"

    key = _hard_rows(n, 32, 3)
    scale = None
    if pair[1] == "fp8":
        key, scale = Q.quant_fp8_rows(key)
    for b, p in ((REF, pr), (kb, pt)):
        addr = p.row_address(8, table, batch, crow)
        b.index_key_store(_planes(p, 8), key, scale, addr.page, addr.row, keep, p.sink_page)
    assert torch.equal(pr.backing, pt.backing), "index_key_store"

    vals = torch.tensor([[12, 3, -1, 7], [5, 1, 2, 3], [9, 9, 9, 9]])
    cur_slot = torch.tensor([1, -1, 0])
    for b, p in ((REF, pr), (kb, pt)):
        b.cursor_write(p.cursor, cur_slot, vals, p.sink_slot)
    assert torch.equal(pr.backing, pt.backing), "cursor_write"


def test_bf16_inputs_store_the_same_bytes(tiny):
    pr, pt = _twin_pools(tiny, ("bf16", "fp8"), num_pages=2, num_slots=2)
    x = _hard_rows(6, 64, 4).to(torch.bfloat16)
    slot, pos = torch.tensor([0, 0, 1, 1, -1, 0]), torch.tensor([0, 1, 0, 1, 2, 2])
    zero = torch.zeros(6, dtype=torch.long)
    for b, p in ((REF, pr), (_tk(), pt)):
        b.ring_write(p.ring(0), x, slot, pos, zero, p.sink_slot)
        addr = p.row_address(2, torch.tensor([[1, 0]]), torch.zeros(6, dtype=torch.long), pos)
        b.main_scatter(p.main[2], x, addr.page, addr.row, slot >= 0, p.sink_page)
    assert torch.equal(pr.backing, pt.backing)


def test_compress_groups_pairs_and_tails_match(tiny):
    pr, pt = _twin_pools(tiny, ("bf16", "fp8"), num_pages=2, num_slots=3)
    for p in (pr, pt):  # finite tails (the random bytes may hold NaNs, which never compare)
        p.tail_values.copy_(torch.arange(p.tail_values.numel()).view_as(p.tail_values) * 0.5)
        p.tail_scores.copy_(-p.tail_values)
    # slot 1 starts odd (its first pair reads the tail, its last row opens a new one), slot 0
    # starts at 0 and ends even, a padding row
    slot = torch.tensor([1, 1, 1, 1, 0, 0, 0, -1])
    pos = torch.tensor([3, 4, 5, 6, 0, 1, 2, 0])
    first = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    last = torch.tensor([0, 0, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    v, s = torch.randn(8, 64), torch.randn(8, 64)
    out = []
    for b, p in ((REF, pr), (_tk(), pt)):
        out.append(
            b.compress_groups(
                v, s, pos, slot, first, last, p.tail_values[:, 1], p.tail_scores[:, 1], p.sink_slot
            )
        )
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert torch.equal(pr.backing, pt.backing)
    assert torch.equal(pt.tail_values[1, 1], v[3]) and torch.equal(pt.tail_values[0, 1], v[6])


@pytest.mark.parametrize("pair", PAIRS)
def test_every_scatter_skips_sentinels_and_never_writes_the_sink(tiny, pair):
    p = Pools(tiny.geometry(*pair), num_pages=3, num_slots=2)
    p.backing.fill_(0xA5)
    before = p.backing.clone()
    kb = _tk()
    n = 6
    none = torch.full((n,), -1)
    pos = torch.arange(n)
    x = torch.randn(n, 64)
    keep = torch.ones(n, dtype=torch.bool)
    kb.ring_write(p.ring(0), x, none, pos, torch.zeros(n, dtype=torch.long), p.sink_slot)
    # a position below its write bound writes nothing either
    kb.ring_write(p.ring(1), x, torch.zeros(n, dtype=torch.long), pos, pos + 1, p.sink_slot)
    kb.compress_groups(
        x, x, pos, none, keep, keep, p.tail_values[:, 0], p.tail_scores[:, 0], p.sink_slot
    )
    # rows addressed to a missing page land on the sink page, which no kernel writes
    addr = p.row_address(8, torch.tensor([[0, 1]]), none, pos)
    assert addr.page.eq(p.sink_page).all()
    kb.main_scatter(p.main[8], x, addr.page, addr.row, keep, p.sink_page)
    kb.main_scatter(p.main[8], x, torch.full((n,), -1), addr.row, keep, p.sink_page)
    kb.index_key_store(_planes(p, 8), x[:, :32], torch.ones(n, 1), addr.page, addr.row, keep, 3)
    kb.index_key_store(_planes(p, 8), x[:, :32], torch.ones(n, 1), pos % 2, pos, ~keep, p.sink_page)
    kb.cursor_write(p.cursor, torch.full((2,), -1), torch.ones(2, 4, dtype=torch.long), 2)
    assert torch.equal(p.backing, before)
    assert not kb.fallbacks


# -- scorer and select ----------------------------------------------------------------------------
def _fill_index(p: Pools, owner: int, table, n_rows, keys):
    """Store each request's keys (``keys[b]`` = (values, scale or None)) through its table."""
    batch, rows = [], []
    for b, n in enumerate(n_rows):
        batch += [b] * n
        rows += list(range(n))
    key = torch.cat([k for k, _ in keys])
    scale = torch.cat([s for _, s in keys]) if keys[0][1] is not None else None
    addr = p.row_address(owner, table, torch.tensor(batch), torch.tensor(rows))
    ones = torch.ones(len(batch), dtype=torch.bool)
    REF.index_key_store(_planes(p, owner), key, scale, addr.page, addr.row, ones, p.sink_page)


def _scorer_case(tiny, index_dtype, exact: bool, seed: int):
    """Pools with two requests' keys and ragged query rows: bounds 0, at and around page edges
    (16 rows a page), past the last page; a missing page mid-table; a padding row."""
    g = torch.Generator().manual_seed(seed)
    p = Pools(tiny.geometry("bf16", index_dtype), num_pages=7, num_slots=1)
    table = torch.tensor([[4, 0, -1, 2], [5, 1, 6, -1]])
    n_rows = [64, 40]
    keys = []
    for n in n_rows:
        if exact:
            if index_dtype == "fp8":  # integer codes, power-of-two scales: every sum exact
                k = torch.randint(-3, 4, (n, 32), generator=g).float()
                k[::5] = k[1::5][: len(k[::5])]  # duplicate rows tie exactly
                keys.append((k, torch.full((n, 1), 0.125)))
            else:
                v = torch.tensor(Q.E2M1_VALUES)[torch.randint(0, 5, (n, 32), generator=g)]
                v[:, 0] = 6.0  # E8M0 scale 1
                keys.append((v * torch.where(torch.rand(n, 32, generator=g) < 0.5, -1, 1), None))
        else:
            k = torch.randn(n, 32, generator=g)
            k[5:9] = 0.0
            keys.append(Q.quant_fp8_rows(k) if index_dtype == "fp8" else (Q.fake_fp4(k, 32), None))
    _fill_index(p, 2, table, n_rows, keys)
    qb = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1])
    bound = torch.tensor([64, 33, 32, 16, 0, 40, 31, 100, 0])
    t = len(qb)
    if exact:
        if index_dtype == "fp8":  # amax 448 * 2**-4: the fp32 scale is 2**-4 exactly
            q = torch.randint(-4, 5, (t, 4, 32), generator=g).float()
            q[..., 0] = 448.0
            q = q * 2.0**-4
        else:
            q = torch.tensor(Q.E2M1_VALUES)[torch.randint(0, 8, (t, 4, 32), generator=g)]
            q[..., 0] = 6.0
        w = torch.randint(-2, 3, (t, 4), generator=g).float() * 0.5
    else:
        q = torch.randn(t, 4, 32, generator=g)
        w = torch.randn(t, 4, generator=g)
    pages = torch.where(qb.unsqueeze(1) >= 0, table[qb.clamp(min=0)], -1)
    return _planes(p, 2), q, w, bound, pages


@pytest.mark.parametrize("index_dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_the_reference(tiny, index_dtype, dtype):
    planes, q, w, bound, pages = _scorer_case(tiny, index_dtype, exact=False, seed=3)
    q, w = q.to(dtype), w.to(dtype)
    kb = _tk(score_chunk=32, score_block=16, score_rows=2 if dtype == torch.bfloat16 else 1)
    ref = REF.scores(planes, q, w, bound, pages)
    got = kb.scores(planes, q, w, bound, pages)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got == NEG, ref == NEG)
    fin = ref > NEG
    # fp32 sums in another order; in bf16 (fp4) the reference rounds each step to bf16
    tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[fin].float(), ref[fin].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "index_dtype, small, prefetch, select_programs",
    [
        ("fp8", True, 0, 1),
        ("fp4", False, 0, 1),
        ("fp8", True, 1, 3),
        ("fp4", True, 1, 1),
        ("fp8", True, 0, 0),
        ("fp4", True, 0, 0),
    ],
    ids=[
        "fp8-small-tiles",
        "fp4",
        "fp8-small-tiles-prefetch-segments",
        "fp4-small-tiles-prefetch",
        "fp8-chunk-pages-long-select",
        "fp4-chunk-pages-long-select",
    ],
)
def test_score_topk_is_exact_where_the_scores_are(
    tiny, index_dtype, small, prefetch, select_programs
):
    planes, q, w, bound, pages = _scorer_case(tiny, index_dtype, exact=True, seed=4)
    # small tiles: a row's keys span several programs, tiles and select steps; programs of 4
    # rows: one of rows of one request (a shared key tile), one of two requests (row by row),
    # one past the last row. Prefetch: 4-key tiles over 64-key programs, so a program's tiles
    # cross pages (16 rows a page). Select asked for 3 programs a row: two segments of 32 of the
    # 64 rows (the bounds 33 and 40 end in the second, 16 in the first). Select programs 0 here:
    # the staged forms, the chunk's pages loaded first (score_chunk_pages) and the long-row
    # select over 16-element segments (select_resident_max 16)
    staged = select_programs == 0
    kb = (
        _tk(
            score_chunk=64 if prefetch else 32 if staged else 16,
            score_block=4 if prefetch else 16,
            select_chunk=16,
            score_rows=4,
            score_prefetch=prefetch,
            select_programs=select_programs,
            score_chunk_pages=staged,
            select_resident_max=16 if staged else 0,
        )
        if small
        else _tk()
    )
    if staged:
        assert kb.chunk_pages_for(32, planes[0].shape[1]) == 2
    s_ref = REF.scores(planes, q, w, bound, pages)
    assert torch.equal(kb.scores(planes, q, w, bound, pages), s_ref)
    for topk in (4, 64):
        ids = kb.score_topk(planes, q, w, bound, pages, topk, None)
        assert torch.equal(ids, REF.score_topk(planes, q, w, bound, pages, topk, None))
    # Reindex: restricted to the candidate rows
    cand = torch.rand(s_ref.shape, generator=torch.Generator().manual_seed(5)) < 0.4
    ids = kb.score_topk(planes, q, w, bound, pages, 8, cand)
    assert torch.equal(ids, REF.score_topk(planes, q, w, bound, pages, 8, cand))
    got = kb.score_candidates_topk(planes, q, w, bound, pages, 8, 2, 3)
    ref = REF.score_candidates_topk(planes, q, w, bound, pages, 8, 2, 3)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert not kb.fallbacks


def _tied_scores(t: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (t, n), generator=g).float()
    s[torch.rand(t, n, generator=g) < 0.2] = NEG
    s[0] = NEG  # nothing visible
    s[1, : n // 2] = NEG  # fewer visible than most k
    s[2] = torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)  # -0.0 and 0.0 tie
    s[3, 5] = float("inf")
    return s


@pytest.mark.parametrize(
    "chunk, programs, resident",
    [(16, 1, 0), (2048, 1, 0), (16, 3, 0), (16, 1, 8192)],
    ids=["digits-16", "digits-2048", "segments", "resident"],
)
def test_topk_ids_of_a_given_score_matrix_are_the_references(chunk, programs, resident):
    # programs 3: rows of 40, 96 and 200 split in three segments (whole 16s: 16, 32, 80; the
    # half-masked row's last ones lie past its visible part); resident: each row held in
    # registers (select_resident_kernel), the digit select's rows otherwise
    kb = _tk(select_chunk=chunk, select_programs=programs, select_resident_max=resident)
    for n, topk, dtype in (
        (40, 4, torch.float32),
        (12, 16, torch.float32),
        (96, 33, torch.bfloat16),
        (200, 70, torch.float32),
    ):
        s = _tied_scores(6, n, n + topk).to(dtype)
        assert torch.equal(kb.topk_ids(s, topk), REF.topk_ids(s, topk)), (n, topk)


@pytest.mark.parametrize(("chunk", "warps"), [(16, 4), (2048, 4), (64, 16)])
def test_select_ends_where_a_bin_holds_the_elements_still_wanted(chunk, warps):
    # the one-program select stops its digit passes once the chosen bin holds exactly the
    # elements still wanted: after the first digit (five scores in [1024, 2048) share the top
    # byte, k = 5), after a later one (distinct random scores), or never (k inside a bin of
    # equal scores: ties by position)
    kb = _tk(
        select_chunk=chunk,
        select_programs=1,
        select_warps=warps,
        select_warps_from=0,
        select_resident_max=0,  # the digit select (a resident row is the test below's)
    )
    g = torch.Generator().manual_seed(13)
    s = torch.rand(4, 300, generator=g) * 0.5
    big = torch.randperm(300, generator=g)[:5]
    s[0, big] = 1024.0 + torch.rand(5, generator=g) * 1000.0
    s[1, 40:60] = NEG
    s[2, ::3] = 0.25  # 100 equal scores
    s[3] = -s[3]  # negative scores: the sign digit
    for topk in (0, 1, 3, 5, 6, 120, 299, 300, 400):
        assert torch.equal(kb.topk_ids(s, topk), REF.topk_ids(s, topk)), (chunk, topk)
    got = kb.topk_ids(s, 5)[0]
    assert torch.equal(got, big.sort().values)


@pytest.mark.parametrize(
    "early,ternary,pack_max", [(False, False, 4096), (True, False, 4096), (True, True, 4096),
                               (True, True, 0)],
    ids=["32-bits", "early-exit", "ternary", "ternary-two-scans"],
)  # fmt: skip
def test_resident_select_finds_the_kth_key_a_bit_at_a_time(early, ternary, pack_max):
    """``select_resident_kernel``: the k-th key built a bit at a time over the held row, with
    keys of both signs and every magnitude (the sign step), ties at the k-th key taken from the
    smallest position, -0.0 tied with 0.0, -inf never taken, infinities, k of 0 and past the
    visible keys (-1 padded), and a row's bound (``score_topk``'s)."""
    kb = _tk(select_resident_max=8192, select_early_exit=early, select_ternary=ternary)
    kb.select_packed_scan_max = pack_max  # 0: the ids placed by two scans, as past 4,096 keys
    g = torch.Generator().manual_seed(17)
    n = 300
    s = torch.randn(8, n, generator=g)
    s[0] *= 1e30  # exponents far apart
    s[1] = -torch.rand(n, generator=g) - 1e-30  # all negative
    s[2, ::3] = 0.25  # 100 ties
    s[3] = torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)  # every key +0
    s[4, 10:200] = NEG
    s[4, 5], s[4, 7] = float("inf"), -float("inf")
    s[5] = NEG  # nothing visible
    s[6] = torch.randint(-2, 3, (n,), generator=g).float() * 2.0**-140  # subnormals, ties
    s[7] = torch.tensor([3.4e38, -3.4e38] * (n // 2))  # the largest finite keys of both signs
    for topk in (0, 1, 2, 5, 99, 100, 101, 150, 299, 300, 301, 512):
        assert torch.equal(kb.topk_ids(s, topk), REF.topk_ids(s, topk)), topk
    assert kb.topk_ids(s, 5).shape == (8, 5) and not kb.fallbacks


_LONG_ROW_FORMS = {  # (early, loose, ternary, held)
    "32-bits": (False, False, False, True),
    "early-exit": (True, False, False, True),
    "loose-bounds": (True, True, False, True),
    "loose-ternary": (True, True, True, True),  # the default
    "lists-written": (True, True, True, False),
}


@pytest.mark.parametrize(
    "resident_max,early,loose,ternary,held",
    [pytest.param(16, *f, id=f"16-{name}") for name, f in _LONG_ROW_FORMS.items()]
    # at 64 (fewer, longer segments) the default and the exact 32-step search (CPU time)
    + [pytest.param(64, *_LONG_ROW_FORMS[n], id=f"64-{n}") for n in ("32-bits", "loose-ternary")],
)
def test_long_row_select_takes_the_keys_above_its_segments_bounds(
    resident_max, early, loose, ternary, held
):
    """Rows longer than ``select_resident_max``: each segment's own k-th key (or, loose, a key
    with k to 2k keys at or above it) bounds the row's from below, and the keys at or above the
    largest bound are selected from the segments' lists (held at once, or written into the
    row's list first; distinct scores: at most 2k a segment); many ties at the bound overflow
    a list and take the row (then the digit select). Both give the reference's ids:
    ties from the smallest position, -1 padding past the visible keys, a row with no segment of
    k valid keys (no bound), rows of one segment."""
    kb = _tk(select_resident_max=resident_max, select_chunk=32, select_early_exit=early)
    kb.select_loose_bounds, kb.select_ternary, kb.select_lists_held = loose, ternary, held
    g = torch.Generator().manual_seed(19)
    for n in (resident_max // 2, 200, 300):
        s = torch.randn(6, n, generator=g)  # distinct: the list
        s[1] = torch.randint(-1, 2, (n,), generator=g).float()  # ties: the overflow
        s[2, : n - 7] = NEG  # 7 visible keys
        s[3] = torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)
        s[4, ::5] = float("inf")
        s[5] = -s[5].abs() * 1e-30
        for topk in (0, 1, 3, 8, 40, n, n + 3):
            assert torch.equal(kb.topk_ids(s, topk), REF.topk_ids(s, topk)), (n, topk)
    bound = torch.tensor([300, 150, 17, 0, 299, 5])
    s = torch.randn(6, 300, generator=g)
    work = s.masked_fill(torch.arange(300) >= bound[:, None], NEG)
    out = torch.empty(6, 8, dtype=torch.long)
    kb._select(s.contiguous(), bound, 8, out)  # score_topk's form: each row's bound
    assert torch.equal(out, REF.topk_ids(work, 8))
    assert not kb.fallbacks


@pytest.mark.parametrize(
    "early,loose", [(False, False), (True, False), (True, True)], ids=["kth", "early", "loose"]
)
def test_segment_lists_hold_each_segments_keys_at_or_above_its_bound(early, loose):
    """``select_bound_kernel``: each segment's bound (``NEG_INF_KEY`` with fewer than k valid
    keys), how many valid keys lie at or above it, and the first ``LC`` of them (positions
    ascending, their ordered keys): distinct scores, ties past the list (the count says so), a
    segment with fewer than k valid keys, a short last segment. The bound is the k-th key;
    ``EARLY``: a threshold at or below it with the same keys at or above; ``LOOSE``: one with
    k to ``LC`` valid keys at or above it (or, tied, those at or above the k-th)."""
    from v41plan.runtime.kernels import triton_scorer as SC

    g = torch.Generator().manual_seed(23)
    t, n, seg, k, lc, sp = 3, 40, 16, 4, 8, 4
    s = torch.randn(t, n, generator=g)
    s[1] = torch.randint(-1, 2, (n,), generator=g).float()  # ties
    s[1, :16] = 0.5  # segment 0: sixteen ties at its bound, past its list
    s[2, 16:29] = NEG  # segment 1: three valid keys
    ws = torch.full((t, 2 * sp), -7, dtype=torch.int32)
    lists = torch.full((t, 3 * 2 * lc), -7, dtype=torch.int32)
    bound = torch.full((t,), n)
    SC.select_bound_kernel[(t, 3)](
        s, s.stride(0), bound, ws, ws.stride(0), lists, lists.stride(0), k, n, seg,
        HAS_BOUND=True, NP=seg, SP=sp, LC=lc, EARLY=early, LOOSE=loose,
    )  # fmt: skip
    bits = s.view(torch.int32)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    neg_key = int(keys[2, 16])  # -inf's key lies below every valid key
    for r in range(t):
        for sg in range(3):
            pos = torch.arange(sg * seg, min(n, (sg + 1) * seg))
            kk = keys[r, pos]
            valid = kk > neg_key
            kth = kk[valid].sort(descending=True).values[k - 1] if valid.sum() >= k else neg_key
            if early and valid.sum() >= k:
                bound = int(ws[r, sg])
                n_at = int((kk[valid] >= bound).sum())
                n_kth = int((kk[valid] >= kth).sum())
                assert bound <= kth and n_at >= k, (r, sg)
                if loose:  # at most LC keys at or above it unless tied
                    assert n_at <= lc or n_at == n_kth, (r, sg)
                else:  # no key between it and the k-th
                    assert n_at == n_kth, (r, sg)
                kth = bound
            assert ws[r, sg] == kth, (r, sg)
            at = pos[valid & (kk >= kth)]
            assert ws[r, sp + sg] == len(at), (r, sg)
            held = min(len(at), lc)
            got = lists[r, sg * 2 * lc : sg * 2 * lc + 2 * lc]
            assert torch.equal(got[:held].long(), at[:held]), (r, sg)
            assert torch.equal(got[lc : lc + held], keys[r, at[:held]]), (r, sg)
    assert ws[1, sp] == 16 and ws[2, 1] == neg_key


def test_segment_select_finds_the_kth_key_among_close_scores():
    # every score in one coarse bin (the top 11 bits equal), so the k-th key comes from the
    # gathered list alone; distinct low bits, ties and both signs across rows
    g = torch.Generator().manual_seed(11)
    base = torch.tensor([1.0, -1.0, 3.0e-3])
    s = base[:, None] * (1 + torch.randint(0, 4000, (3, 512), generator=g) * 2.0**-23)
    s[2, 100:140] = NEG
    # four segments of 128 in 64-element steps; by the device (2 SMs, 3 rows): two of 256
    for kb, segments in (
        (_tk(select_chunk=64, select_programs=4), 4),
        (_tk(select_programs=0, select_segment_min=64, select_segment_from=512), 2),
    ):
        assert kb.select_segments_for(3, 512, torch.device("cpu")) == segments
        for topk in (1, 17, 300, 600):
            assert torch.equal(kb.topk_ids(s, topk), REF.topk_ids(s, topk)), (segments, topk)


def test_select_splits_only_long_rows_by_default():
    # the shipped rule: one program a row below select_segment_from (measured faster at 4,096
    # keys), segments above it while the rows leave the device idle (2 SMs on the CPU)
    kb = _tk()
    cpu = torch.device("cpu")
    assert kb.select_programs == 0
    assert kb.select_segments_for(1, kb.select_segment_from - 16, cpu) == 1
    assert kb.select_segments_for(1, kb.select_segment_from, cpu) == 4
    assert kb.select_segments_for(1, 2 * kb.select_segment_from, cpu) == 4
    assert kb.select_segments_for(64, 2 * kb.select_segment_from, cpu) == 1  # rows fill it
    assert _tk(select_programs=1).select_segments_for(1, 32768, cpu) == 1


@pytest.mark.parametrize("chunk", [8, 2048])
def test_candidate_blocks_are_the_references(chunk):
    kb = _tk(select_chunk=chunk)
    s = _tied_scores(6, 48, 9)
    # bounds: the whole table, mid-block, 1, 0, past the table (no block forced), one block
    bound = torch.tensor([48, 9, 1, 0, 60, 8])
    s = s.masked_fill(torch.arange(48).unsqueeze(0) >= bound.unsqueeze(1), NEG)
    for rows, blocks in ((2, 3), (8, 4), (2, 30)):
        got = kb.candidate_blocks(s, bound, rows, blocks)
        assert torch.equal(got, REF.candidate_blocks(s, bound, rows, blocks)), (rows, blocks)


def test_tensor_parallel_path_scores_then_selects(tiny):
    from v41plan.runtime.collectives import TPGroup, tp_score_candidates_topk, tp_score_topk

    class Doubling(TPGroup):
        """Two ranks holding the same heads: the reduction doubles every score."""

        def all_reduce(self, x):
            return x * 2

    tp = Doubling(0, 2)
    planes, q, w, bound, pages = _scorer_case(tiny, "fp8", exact=True, seed=6)
    kb = _tk()
    ids = tp_score_topk(kb, tp, planes, q, w, bound, pages, 8, None)
    assert torch.equal(ids, tp_score_topk(REF, tp, planes, q, w, bound, pages, 8, None))
    got = tp_score_candidates_topk(kb, tp, planes, q, w, bound, pages, 8, 2, 3)
    ref = tp_score_candidates_topk(REF, tp, planes, q, w, bound, pages, 8, 2, 3)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_float64_falls_back_to_the_reference(tiny):
    planes, q, w, bound, pages = _scorer_case(tiny, "fp8", exact=False, seed=8)
    kb = _tk()
    ids = kb.score_topk(planes, q.double(), w.double(), bound, pages, 4, None)
    assert torch.equal(ids, REF.score_topk(planes, q.double(), w.double(), bound, pages, 4, None))
    assert "score_topk" in kb.fallbacks


# -- sparse attention -----------------------------------------------------------------------------
def _attention_case(tiny, kv_dtype: str, window_only: bool, seed: int):
    """Three requests and padding: slot 1 decodes at 21 (ring holds 14..21, window floor 16),
    slot 0 prefills 4 rows from 5 (ring below 5), slot 2 a 3-row chunk at 0 with an empty window
    floor past its rows; the selected ids mix -1 padding, a missing page and the last row."""
    g = torch.Generator().manual_seed(seed)
    p = Pools(tiny.geometry(kv_dtype, "fp8"), num_pages=6, num_slots=3)
    W = 8
    ring = p.ring(8)
    hist = Q.fake_fp8(torch.randn(3, 24, 64, generator=g))
    for s in range(3):
        n = 24
        REF.ring_write(
            ring,
            hist[s],
            torch.full((n,), s),
            torch.arange(n),
            torch.zeros(n, dtype=torch.long),
            p.sink_slot,
        )
    kv = Q.fake_fp8(torch.randn(10, 64, generator=g))  # this forward's rows
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    slot = torch.tensor([1, 0, 0, 0, 0, 2, 2, 2, -1])
    position = torch.tensor([21, 5, 6, 7, 8, 0, 1, 2, 0])
    window_lo = torch.tensor([16, 0, 0, 0, 0, 0, 0, 3, 0])
    ring_until = torch.tensor([22, 5, 5, 5, 5, 0, 0, 0, 0])
    plane = ids = pages = None
    if not window_only:
        plane = p.main[2]
        table = torch.tensor([[3, 0, 5], [1, -1, 4], [2, 4, 0]])
        lat = Q.fake_fp4_e4m3(torch.randn(48, 64, generator=g), 16)
        for b in range(3):
            addr = p.row_address(2, table, torch.full((48,), b), torch.arange(48))
            REF.main_scatter(plane, lat, addr.page, addr.row, torch.ones(48, dtype=torch.bool), 6)
        bid = torch.tensor([1, 0, 0, 0, 0, 2, 2, 2, 0])
        pages = table[bid]
        pages[-1] = -1
        ids = torch.randint(0, 48, (9, 12), generator=g)
        ids[:, -3:] = -1
        ids[0, :4] = torch.tensor([16, 17, 47, 0])  # page -1 (rows 16..31 of request 1)
        ids[4] = -1
    q = torch.randn(9, 4, 64, generator=g)
    sink = torch.randn(4, generator=g)
    args = (q, sink, 64**-0.5, ring, kv, rows, slot, position, window_lo, ring_until, W)
    return args, (plane, ids, pages, 16)


@pytest.mark.parametrize(
    "kv_dtype,window_only,num_sms,prefetch,dv",
    [(kv, wo, sms, 0, 0) for kv in ("bf16", "fp4") for wo in (False, True) for sms in (1, 64)]
    # the software-pipelined selected blocks, in 4-key blocks so the 12 ids span three (the
    # interpreter takes tiles below the GPU's 16)
    + [(kv, False, sms, pf, 0) for kv in ("bf16", "fp4") for sms in (1, 64) for pf in (1, 2)]
    # each program accumulating 16 of the 64 output columns (four programs a head block; with
    # splits, only the first writes the partial max and sum; window-only rows never split)
    + [(kv, False, sms, 0, 16) for kv in ("bf16", "fp4") for sms in (1, 64)]
    + [(kv, True, 1, 0, 16) for kv in ("bf16", "fp4")],
)
def test_sparse_attention_matches_the_reference(tiny, kv_dtype, window_only, num_sms, prefetch, dv):
    args, sel = _attention_case(tiny, kv_dtype, window_only, seed=10)
    kb = TritonBackend(num_sms=num_sms)  # 64 SMs: the rows split over keys; 1: one pass
    kb.combine_columns = 16  # the merge in four column programs a head block
    kb.attention_override = (
        {"PREFETCH": prefetch, "BN": 4} if prefetch else {"DV": dv} if dv else None
    )
    out_ref = torch.full_like(args[0], float("nan"))
    out = torch.full_like(args[0], float("nan"))
    REF.sparse_attention(*args, *sel, out_ref)
    kb.sparse_attention(*args, *sel, out)
    cfg = kb.attention_config(9, 4, 64, 8, 0 if window_only else 12, out.device, out.dtype)
    splits = cfg["SPLITS"]
    assert (splits > 1) == (num_sms > 1 and not window_only)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the padding row sees no key
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    assert not kb.fallbacks


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp4"])
def test_several_head_blocks_with_a_split_a_key_block_match_the_reference(tiny, kv_dtype):
    """32 query heads in two 16-head blocks, every 4-key block its own split (the form
    ``few_rows`` takes at flash widths): each head block reads the same keys and merges its own
    splits; the reference's output within float32 rounding."""
    args, sel = _attention_case(tiny, kv_dtype, False, seed=17)
    g = torch.Generator().manual_seed(18)
    q = torch.randn(9, 32, 64, generator=g)
    sink = torch.randn(32, generator=g)
    args = (q, sink, *args[2:])
    kb = TritonBackend(num_sms=64)
    n_blocks = 2 + 3  # 8 window keys and 12 selected ids in 4-key blocks
    kb.attention_override = {"HB": 16, "SPLITS": n_blocks, "BN": 4, "num_warps": 4}
    assert kb.attention_config(9, 32, 64, 8, 12, "cpu", torch.float32)["n_hb"] == 2
    out_ref = torch.full_like(q, float("nan"))
    out = torch.full_like(q, float("nan"))
    REF.sparse_attention(*args, *sel, out_ref)
    kb.sparse_attention(*args, *sel, out)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    assert not kb.fallbacks


@pytest.mark.parametrize("num_sms,dv", [(1, 0), (64, 0), (64, 16)])
def test_bf16_rows_read_the_window_as_one_tile(tiny, num_sms, dv):
    """bf16 queries and rows over a bf16 ring: each window key's row is read from the ring or
    this forward's rows as one tile (with key splits, with a column share); the same sums as
    the two masked tiles that fp32 rows take (the output is their float32 result rounded to
    bf16), and the reference within bf16."""
    args, sel = _attention_case(tiny, "bf16", False, seed=16)
    q, kv = args[0].to(torch.bfloat16), args[4].to(torch.bfloat16)
    a16 = (q, *args[1:4], kv, *args[5:])
    a32 = (q.float(), *args[1:4], kv.float(), *args[5:])
    assert args[3].dtype == torch.bfloat16  # the ring
    kb = TritonBackend(num_sms=num_sms)
    kb.attention_override = {"DV": dv} if dv else None  # 16 of the 64 columns a program
    out16 = torch.full_like(q, float("nan"))
    out32 = torch.full_like(q, float("nan"), dtype=torch.float32)
    kb.sparse_attention(*a16, *sel, out16)
    kb.sparse_attention(*a32, *sel, out32)
    assert not kb.fallbacks
    assert torch.equal(out16, out32.to(torch.bfloat16))
    ref = torch.full_like(q, float("nan"))
    REF.sparse_attention(*a16, *sel, ref)
    torch.testing.assert_close(out16.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_attention_splits_leave_no_split_without_keys(tiny):
    """Key splits are as many as keep the programs one wave and as ``cdiv(blocks, splits)``
    blocks a split fills: V4.1-Flash's decode of 4 rows (20 blocks of 32 keys) takes 10 splits
    of two, not 16 with 6 empty; one or two bf16 rows (``few_rows``) take 16-head blocks and a
    split a key block (packed or float32 keys keep the rule). In the fixed shares (without
    ``BALANCE``) an empty split's partial adds exact zeros to the merge: 4 splits of 5 blocks
    (one empty) and 3 give the same bits."""
    kb = TritonBackend(num_sms=132)
    cfg = kb.attention_config(4, 64, 512, 128, 512, torch.device("cpu"), torch.bfloat16)
    assert (cfg["BN"], cfg["HB"], cfg["SPLITS"]) == (32, 64, 10)
    for t in (1, 2):
        cfg = kb.attention_config(t, 64, 512, 128, 512, "cpu", torch.bfloat16)
        assert (cfg["HB"], cfg["n_hb"], cfg["SPLITS"], cfg["num_warps"]) == (16, 4, 20, 4)
    packed = kb.attention_config(1, 64, 512, 128, 512, "cpu", torch.bfloat16, packed=True)
    assert packed["HB"] == 64
    assert kb.attention_config(1, 64, 512, 128, 512, "cpu", torch.float32)["HB"] == 16
    assert kb.attention_config(1, 64, 512, 128, 512, "cpu", torch.float32)["SPLITS"] < 20
    # 64 rows: as many splits as keep one wave (one 64-head program an SM), not two waves
    assert kb.attention_config(64, 64, 512, 128, 512, "cpu", torch.bfloat16)["SPLITS"] == 2
    assert kb.attention_config(32, 64, 512, 128, 512, "cpu", torch.bfloat16)["SPLITS"] == 4
    assert kb.attention_config(96, 64, 512, 128, 512, "cpu", torch.bfloat16)["SPLITS"] == 1
    # 16 heads (medium): two programs an SM
    assert kb.attention_config(64, 16, 512, 128, 512, "cpu", torch.bfloat16)["SPLITS"] == 4
    args, sel = _attention_case(tiny, "bf16", False, seed=12)
    outs = []
    for splits in (4, 3):
        kb = TritonBackend(num_sms=64)
        # 2 window + 3 selected blocks, in the fixed shares (BALANCE spreads each row's own)
        kb.attention_override = {"BN": 4, "SPLITS": splits, "BALANCE": False}
        out = torch.full_like(args[0], float("nan"))
        kb.sparse_attention(*args, *sel, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp4"])
@pytest.mark.parametrize("num_sms,heads", [(1, 4), (64, 4), (64, 32)])
def test_resolved_selected_rows_give_the_launch_s_bits(tiny, kv_dtype, num_sms, heads):
    """``RESOLVE``: each program turning its row's selected ids into plane offsets before the
    block loop (a register gather a block) reads the same keys in the same blocks and order, so
    the output is the unresolved launch's bit for bit (one pass, key splits, two head blocks;
    ids with -1 padding and a missing page), and the reference's within float32 rounding. The
    FP4 plane's 36-byte rows are laid in 48-byte ones (the path needs strides in multiples of
    16 elements, as every V4.1-Flash plane has)."""
    import v41plan.runtime.kernels.triton_backend as tb

    args, (plane, ids, pages, rpp) = _attention_case(tiny, kv_dtype, False, seed=23)
    if plane.stride(1) % 16:  # copy the rows into a wider buffer: same values, 16-unit strides
        wide = torch.zeros(*plane.shape[:2], 48, dtype=plane.dtype)
        wide[..., : plane.shape[2]] = plane
        assert not tb.resolves_selected({"RESOLVE": True}, plane)
        plane = wide[..., : plane.shape[2]]
    sel = (plane, ids, pages, rpp)
    if heads != args[0].shape[1]:
        g = torch.Generator().manual_seed(24)
        args = (torch.randn(9, heads, 64, generator=g), torch.randn(heads, generator=g), *args[2:])
    base = {"BN": 4} | ({"HB": 16, "num_warps": 4} if heads > 16 else {})
    assert tb.resolves_selected(base | {"RESOLVE": True}, plane)
    assert not tb.resolves_selected(base, plane)
    outs = []
    for resolve in (False, True):
        kb = TritonBackend(num_sms=num_sms)
        kb.attention_override = base | {"RESOLVE": resolve}
        out = torch.full_like(args[0], float("nan"))
        kb.sparse_attention(*args, *sel, out)
        assert not kb.fallbacks
        outs.append(out)
    cfg = kb.attention_config(9, heads, 64, 8, 12, "cpu", torch.float32)
    assert (cfg["SPLITS"] > 1) == (num_sms > 1) and cfg["n_hb"] == (2 if heads > 16 else 1)
    assert torch.equal(outs[0], outs[1])
    ref = torch.full_like(args[0], float("nan"))
    REF.sparse_attention(*args, *sel, ref)
    torch.testing.assert_close(outs[1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype,window_only", [("bf16", False), ("fp4", False), ("bf16", True)])
@pytest.mark.parametrize("splits", [2, 3])
def test_balanced_splits_share_each_row_s_own_blocks(tiny, kv_dtype, window_only, splits):
    """``BALANCE``: the splits share each row's own key blocks (its visible window's, then its
    selected ids'), so rows with few blocks (a decode row at 21 with a window floor, prefill rows
    near the start, a row whose ids are all padding) spread them, and splits past them stay
    empty; every key counted once: the reference's output within float32 rounding, with and
    without the resolved offsets."""
    args, sel = _attention_case(tiny, kv_dtype, window_only, seed=29)
    ref = torch.full_like(args[0], float("nan"))
    REF.sparse_attention(*args, *sel, ref)
    outs = []
    for extra in ({}, {"BALANCE": True}, {"BALANCE": True, "RESOLVE": True}):
        kb = TritonBackend(num_sms=64)
        kb.attention_override = {"BN": 4, "SPLITS": splits} | extra
        out = torch.full_like(args[0], float("nan"))
        kb.sparse_attention(*args, *sel, out)
        assert not kb.fallbacks
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        outs.append(out)
    if kv_dtype == "bf16":  # RESOLVE needs 16-element strides (tiny's FP4 rows are 36 bytes)
        assert torch.equal(outs[1], outs[2])
    assert TritonBackend(num_sms=64).attention_config(9, 4, 64, 8, 12, "cpu")["BALANCE"] is True


def test_resolve_selected_takes_three_stages_every_column_and_no_prefetch(monkeypatch):
    """``RESOLVE_SELECTED`` (the default): bf16 launches resolve and take three stages (the form
    whose loops keep a block's keys in flight) where the shared memory holds them, two where it
    does not (an sm_80 part at flash widths), fp32 ones keep their one stage; ``RESOLVE`` with a
    column share or the manual prefetch is refused."""
    import v41plan.runtime.kernels.triton_backend as tb

    kb = TritonBackend(num_sms=132)
    shape = (64, 512, 128, 512, "cpu")
    on = kb.attention_config(64, *shape, torch.bfloat16)
    assert on["RESOLVE"] is True and on["num_stages"] == 3
    monkeypatch.setattr(tb, "RESOLVE_SELECTED", False)
    off = kb.attention_config(64, *shape, torch.bfloat16)
    assert off["RESOLVE"] is False and off["num_stages"] == 2
    assert {k: v for k, v in on.items() if k not in ("RESOLVE", "num_stages")} == {
        k: v for k, v in off.items() if k not in ("RESOLVE", "num_stages")
    }
    monkeypatch.setattr(tb, "RESOLVE_SELECTED", True)
    # 64 heads x 512 lanes, 32-key blocks: 64 KB of queries, 32 KB a stage, 4 KB of the rest
    for limit, stages in ((227 * 1024, 3), (168 * 1024, 3), (163 * 1024, 2)):
        monkeypatch.setattr(kb, "shared_bytes", lambda device, limit=limit: limit)
        assert kb.attention_config(64, *shape, torch.bfloat16)["num_stages"] == stages
    assert kb.attention_config(64, *shape, torch.float32)["num_stages"] == 1
    for bad in ({"DV": 256}, {"PREFETCH": 1}):
        kb.attention_override = {"RESOLVE": True} | bad
        with pytest.raises(ValueError, match="RESOLVE"):
            kb.attention_config(64, *shape, torch.bfloat16)


def test_the_default_backend_is_the_reference_off_cuda():
    from v41plan.runtime.kernels import default_backend

    assert default_backend("cpu").name == "torch"


def test_scorer_chunks_grow_with_the_row_once_the_device_is_full():
    # a decode batch's long rows take at most score_row_programs programs each (longer chunks),
    # an 8K context's rows the default chunk; a batch of one still splits to fill the device
    kb = TritonBackend(num_sms=132)
    cpu = torch.device("cpu")
    assert (kb.score_chunk, kb.score_row_programs) == (512, 16)
    assert kb.score_chunk_for(64, 4096, 1, cpu) == 512
    assert kb.score_chunk_for(64, 32768, 1, cpu) == 2048
    assert kb.score_chunk_for(64, 65536, 1, cpu) == 4096
    assert kb.score_chunk_for(1, 32768, 1, cpu) == 128  # 256 programs, the first past 132
    kb.score_row_programs = 0
    assert kb.score_chunk_for(64, 32768, 1, cpu) == 512


def test_scorer_splits_a_short_row_over_the_multiprocessors(tiny):
    # one query row: its keys halve per program until the programs cover the 8 SMs (or a
    # program holds one tile); every split scores and selects as the reference
    planes, q, w, bound, pages = _scorer_case(tiny, "fp8", exact=True, seed=6)
    n = pages.shape[1] * planes[0].shape[1]
    kb = TritonBackend(num_sms=8)
    kb.score_block = 8
    cpu = torch.device("cpu")
    chunk = kb.score_chunk_for(1, n, 1, cpu)
    assert chunk < min(kb.score_chunk, n) and (-(-n // chunk) >= 8 or chunk == 8), (n, chunk)
    assert kb.score_chunk_for(64, n, 1, cpu) == min(kb.score_chunk, n)  # rows fill the SMs
    kb.score_fill_sms = False
    assert kb.score_chunk_for(1, n, 1, cpu) == min(kb.score_chunk, n)
    kb.score_fill_sms = True
    for r in range(q.shape[0]):
        one = (planes, q[r : r + 1], w[r : r + 1], bound[r : r + 1], pages[r : r + 1])
        assert torch.equal(kb.scores(*one), REF.scores(*one)), r
        for topk in (1, 5):
            got = kb.score_topk(*one, topk, None)
            assert torch.equal(got, REF.score_topk(*one, topk, None)), (r, topk)
    assert not kb.fallbacks


def test_scorer_loads_a_chunk_s_pages_first_where_its_tiles_lie_in_one_page():
    """``chunk_pages_for``: the page ids a program loads before its tile loop, a power of two
    covering its chunk (one more where chunks do not start on a page), and none where a tile
    can straddle a page, with the prefetch, or when turned off."""
    assert _tk(score_block=32).chunk_pages_for(512, 64) == 0  # off below 2,048 keys
    assert _tk(score_block=64).chunk_pages_for(2048, 64) == 32  # a long row's chunks: on
    assert _tk(score_block=64, score_chunk_pages_from=0).chunk_pages_for(2048, 64) == 0
    kb = _tk(score_block=32, score_chunk_pages=True)
    assert kb.chunk_pages_for(512, 64) == 8  # chunks start on a page
    assert kb.chunk_pages_for(32, 64) == 1  # within one page
    assert kb.chunk_pages_for(64, 96) == 2  # 96-row pages: a chunk may cross one edge
    assert kb.chunk_pages_for(512, 96) == 8  # cdiv(512, 96) + 1 = 7 pages
    assert kb.chunk_pages_for(512, 48) == 0  # 32-key tiles straddle 48-row pages
    assert (
        _tk(score_block=32, score_chunk_pages=True, score_prefetch=1).chunk_pages_for(512, 64) == 0
    )


def test_interpreter_block_types_are_one_object_per_value():
    """``patch_interpreter``'s shared block types: one object per (element type, shape), the
    shape given as ints or constexprs, distinct where element type or shape differ (the
    kernels' bits against the reference, every test of this module, run with them)."""
    import triton.language as tl

    a = tl.block_type(tl.float32, [4, 8])
    assert tl.block_type(tl.float32, (4, 8)) is a
    assert tl.block_type(tl.float32, [tl.constexpr(4), tl.constexpr(8)]) is a
    assert a.shape == (4, 8) and a.numel == 32 and a.element_ty == tl.float32
    for other in (tl.block_type(tl.float32, [8, 4]), tl.block_type(tl.int32, [4, 8])):
        assert other is not a and other != a
    assert a.with_element_ty(tl.int32) is tl.block_type(tl.int32, [4, 8])
    assert a.with_element_ty(tl.int32).scalar == tl.int32 and a.scalar == tl.float32


def test_interpreter_overflow_checks_run_where_they_can_assert():
    """``patch_interpreter`` skips the integer overflow check only where its assert is off: an
    int32 product that overflows passes with the interpreter's options as they are (the check's
    ``device_assert`` returns without asserting) and still fails with ``debug`` on."""
    import dataclasses

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def square(x_ptr, out_ptr):
        x = tl.load(x_ptr + tl.arange(0, 4))
        tl.store(out_ptr + tl.arange(0, 4), x * x)

    x = torch.tensor([1, 2, 3, 1 << 20], dtype=torch.int32)
    out = torch.empty_like(x)
    square[(1,)](x, out)
    assert out[:3].tolist() == [1, 4, 9]  # the last one wraps, unchecked, as compiled code does
    builder = interpreter.interpreter_builder
    opts = builder.options
    try:
        builder.options = dataclasses.replace(opts, debug=True)
        with pytest.raises(Exception, match="overflow"):
            square[(1,)](x, out)
    finally:
        builder.options = opts
