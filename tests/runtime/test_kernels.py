"""Torch backend ops against straightforward dense computations, and the sentinel rule."""

from __future__ import annotations

import pytest
import torch

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model import quant as Q
from v41plan.runtime.kernels import torch_ref as R
from v41plan.runtime.kernels.torch_ref import TorchBackend
from v41plan.runtime.pools import Pools

PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]
K = TorchBackend()


@pytest.fixture(scope="module")
def tiny(specs_dir):
    return load_cache_spec_unchecked(str(specs_dir / "tiny.yaml"))


def _planes(p: Pools, owner: int):
    return (p.index[owner],) if owner in p.index else (p.index_values[owner], p.index_scales[owner])


def test_codecs_store_the_quantizers_grid_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64) * 3
    fp4 = Q.fake_fp4_e4m3(x, 16)
    assert torch.equal(
        R.decode_fp4_e4m3_scales(R.encode_fp4_e4m3_scales(fp4), 64, torch.float64), fp4
    )
    k4 = Q.fake_fp4(x, 32)
    assert torch.equal(R.decode_fp4_e8m0(*R.encode_fp4_e8m0(k4), torch.float64), k4)
    assert torch.equal(R.decode_fp4_e8m0(*R.encode_fp4_e8m0(x), torch.float64), k4)
    w8 = Q.fake_fp8(x, 32)
    assert torch.equal(R.decode_fp8_e8m0(R.encode_fp8_e8m0(w8), 64, torch.float64), w8)
    codes, scale = Q.quant_fp8_rows(x)
    assert torch.equal(
        R.decode_fp8_row(R.encode_fp8_row(x), 64, torch.float64), codes * scale.double()
    )


def _reference_positions():
    # three requests: slots 2, 0, 1; chunk starts 5, 0, 11; lengths 4, 12, 1; two padding rows
    slot = torch.tensor([2] * 4 + [0] * 12 + [1] + [-1, -1])
    pos = torch.tensor(list(range(5, 9)) + list(range(12)) + [11, 0, 0])
    return slot, pos


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp4"])
def test_ring_write_keeps_the_last_rows_and_skips_sentinels(tiny, kv_dtype):
    p = Pools(tiny.geometry(kv_dtype, "fp8"), num_pages=2, num_slots=3)
    slot, pos = _reference_positions()
    x = Q.fake_fp8(torch.randn(len(pos), 64, dtype=torch.float64))
    # write_from: last min(len, W) rows and rows >= cached_until (request 1: cached until 10)
    write_from = torch.tensor([5] * 4 + [10] * 12 + [11] + [0, 0])
    ring = p.ring(3)
    K.ring_write(ring, x, slot, pos, write_from, p.sink_slot)
    got = K.ring_values(ring, 64, torch.float64)
    expect = torch.zeros(4, 8, 64, dtype=torch.float64)
    for i in range(len(pos)):
        if slot[i] >= 0 and pos[i] >= write_from[i]:
            expect[slot[i], pos[i] % 8] = x[i]
    assert torch.equal(got[:3], expect[:3])


def test_every_scatter_bails_on_sentinels(tiny):
    for pair in PAIRS:
        p = Pools(tiny.geometry(*pair), num_pages=3, num_slots=2)
        p.backing.fill_(0xA5)
        before = p.backing.clone()
        n = 6
        none = torch.full((n,), -1)
        pos = torch.arange(n)
        x = torch.randn(n, 64)
        K.ring_write(p.ring(0), x, none, pos, torch.zeros(n, dtype=torch.long), p.sink_slot)
        K.compress_groups(
            x,
            x,
            pos,
            none,
            torch.ones(n, dtype=torch.bool),
            torch.ones(n, dtype=torch.bool),
            p.tail_values[:, 0],
            p.tail_scores[:, 0],
            p.sink_slot,
        )
        addr = p.row_address(8, torch.tensor([[0, 1]]), none, pos)
        K.main_scatter(
            p.main[8], x, addr.page, addr.row, torch.zeros(n, dtype=torch.bool), p.sink_page
        )
        K.index_key_store(
            _planes(p, 8),
            x[:, :32],
            torch.ones(n, 1),
            addr.page,
            addr.row,
            torch.zeros(n, dtype=torch.bool),
            p.sink_page,
        )
        assert torch.equal(p.backing, before), pair


def test_compress_groups_pairs_with_the_previous_row_or_the_tail(tiny):
    p = Pools(tiny.geometry(), num_pages=2, num_slots=3)
    p.tail_values[1, 0] = 1.0
    p.tail_scores[1, 0] = -2.0
    # request A (slot 1) starts at odd position 3 (first group's first member is in the tail),
    # request B (slot 0) starts at 0 and ends on an even position (its last row opens a tail)
    slot = torch.tensor([1, 1, 1, 0, 0, 0, -1])
    pos = torch.tensor([3, 4, 5, 0, 1, 2, 0])
    first = torch.tensor([1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    last = torch.tensor([0, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    v = torch.randn(7, 64)
    s = torch.randn(7, 64)
    pv, ps = K.compress_groups(
        v, s, pos, slot, first, last, p.tail_values[:, 0], p.tail_scores[:, 0], p.sink_slot
    )
    assert torch.equal(pv[0, 0], torch.ones(64)) and torch.equal(ps[0, 0], torch.full((64,), -2.0))
    assert torch.equal(pv[2], torch.stack((v[1], v[2]))) and torch.equal(
        ps[4], torch.stack((s[3], s[4]))
    )
    assert torch.equal(p.tail_values[0, 0], v[5]) and torch.equal(p.tail_scores[0, 0], s[5])
    assert torch.equal(p.tail_values[1, 0], torch.ones(64))  # slot 1 ended on an odd position


@pytest.mark.parametrize("pair", PAIRS)
def test_main_rows_round_trip_through_a_descending_block_table(tiny, pair):
    p = Pools(tiny.geometry(*pair), num_pages=6, num_slots=1)
    table = torch.tensor([[5, 2, 4, -1], [3, 1, -1, -1]])
    batch = torch.tensor([0] * 40 + [1] * 20 + [-1])
    rows = torch.tensor(list(range(40)) + list(range(10, 30)) + [0])
    lat = Q.fake_fp4_e4m3(torch.randn(len(rows), 64, dtype=torch.float64), 16)
    addr = p.row_address(6, table, batch, rows)
    K.main_scatter(p.main[6], lat, addr.page, addr.row, batch >= 0, p.sink_page)
    ids = torch.tensor([[0, 17, 39, -1], [10, 29, 15, -1]])
    got, valid = K.gather_selected(p.main[6], ids, table, 16, 64, torch.float64)
    assert valid.tolist() == [[True, True, True, False], [True, True, True, False]]
    assert torch.equal(got[0, :3], lat[[0, 17, 39]])
    assert torch.equal(got[1, :3], lat[[40, 59, 45]])


def _dense_topk(score: torch.Tensor, bound: int, k: int) -> list[int]:
    cand = [(float(score[i]), i) for i in range(bound) if score[i] > float("-inf")]
    cand.sort(key=lambda t: (-t[0], t[1]))
    ids = sorted(i for _, i in cand[:k])
    return ids + [-1] * (k - len(ids))


@pytest.mark.parametrize("index_dtype", ["fp8", "fp4"])
def test_scorer_matches_the_models_dense_scores_and_tie_rule(tiny, index_dtype):
    from v41plan.model.layers import Attention, topk_ids

    torch.manual_seed(1)
    p = Pools(tiny.geometry("bf16", index_dtype), num_pages=6, num_slots=1)
    table = torch.tensor([[4, 0, 2], [5, 1, -1]])
    n_rows = [48, 20]
    keys, batch, rows = [], [], []
    for b, n in enumerate(n_rows):
        k = torch.randn(n, 32, dtype=torch.float64)
        k[5:9] = 0.0  # exact ties (all-zero keys score 0)
        keys.append(Q.quant_fp8_rows(k) if index_dtype == "fp8" else (Q.fake_fp4(k, 32), None))
        batch += [b] * n
        rows += list(range(n))
    key = torch.cat([k for k, _ in keys])
    scale = torch.cat([s for _, s in keys]) if index_dtype == "fp8" else None
    addr = p.row_address(2, table, torch.tensor(batch), torch.tensor(rows))
    K.index_key_store(
        _planes(p, 2),
        key,
        scale,
        addr.page,
        addr.row,
        torch.ones(len(batch), dtype=torch.bool),
        p.sink_page,
    )
    # query rows: request 0 at bounds 48, 7, 0 and request 1 at 20, one padding row
    qb = torch.tensor([0, 0, 0, 1, -1])
    bound = torch.tensor([48, 7, 0, 20, 0])
    q = torch.randn(5, 4, 32, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)
    pages = torch.where(qb.unsqueeze(1) >= 0, table[qb.clamp(min=0)], -1)
    ids = K.score_topk(_planes(p, 2), q, w, bound, pages, 4, None)
    for t in range(5):
        b = int(qb[t])
        if b < 0:
            assert ids[t].tolist() == [-1] * 4
            continue
        if index_dtype == "fp8":
            qc, qs = Q.quant_fp8_rows(q[t : t + 1])
        else:
            qc, qs = Q.fake_fp4(q[t : t + 1], 32), None
        kc, ks = keys[b]
        score = Attention.index_scores(qc, qs, w[t : t + 1], kc, ks)
        score[:, int(bound[t]) :] = float("-inf")
        assert ids[t].tolist() == topk_ids(score, 4)[0].tolist()
        assert ids[t].tolist() == _dense_topk(score[0], int(bound[t]), 4)


def test_candidate_blocks_match_a_dense_loop():
    torch.manual_seed(2)
    score = torch.randn(4, 16, dtype=torch.float64).round()  # rounding makes block ties
    bound = torch.tensor([16, 9, 1, 0])
    score = score.masked_fill(torch.arange(16).unsqueeze(0) >= bound.unsqueeze(1), float("-inf"))
    mask = K.candidate_blocks(score, bound, 2, 3)
    for t in range(4):
        nb = 8
        bs = [float(score[t, 2 * j : 2 * j + 2].max()) for j in range(nb)]
        if bound[t] > 0:
            bs[(int(bound[t]) - 1) // 2] = float("inf")
        order = sorted(range(nb), key=lambda j: (-bs[j], j))[:3]
        keep = [j for j in order if bs[j] > float("-inf")]
        expect = [(i // 2 in keep) and i < bound[t] for i in range(16)]
        assert mask[t].tolist() == expect


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp4"])
def test_window_gather_reads_ring_below_the_cut_and_forward_rows_above(tiny, kv_dtype):
    p = Pools(tiny.geometry(kv_dtype, "fp8"), num_pages=1, num_slots=2)
    hist = Q.fake_fp8(torch.randn(20, 64, dtype=torch.float64))
    ring = p.ring(0)
    # ring of slot 1 holds positions 2..9 (a previous chunk ended at 10)
    K.ring_write(
        ring, hist[:10], torch.full((10,), 1), torch.arange(10), torch.full((10,), 2), p.sink_slot
    )
    fwd = Q.fake_fp8(torch.randn(5, 64, dtype=torch.float64))  # positions 10..14
    pos = torch.tensor([10, 11, 12, 13, 14])
    slot = torch.full((5,), 1)
    keys, valid = K.gather_window(
        ring,
        fwd,
        torch.arange(5),
        slot,
        pos,
        torch.zeros(5, dtype=torch.long),
        torch.full((5,), 10),
        8,
    )
    for t in range(5):
        for j in range(8):
            kp = int(pos[t]) - 7 + j
            assert bool(valid[t, j]) == (kp >= 0)
            expect = hist[kp] if kp < 10 else fwd[kp - 10]
            assert torch.equal(keys[t, j], expect)
