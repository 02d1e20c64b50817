"""Dense reference model: decode == prefill, sparse attention, causality, selections, speed."""

from __future__ import annotations

import time

import pytest
import torch

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model import quant
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.layers import (
    HcParams,
    MoE,
    candidate_mask,
    hc_predict,
    sparse_attention,
    topk_ids,
)
from v41plan.model.reference import ReferenceModel


@pytest.fixture(scope="module")
def tiny(specs_dir):
    cfg = config_from_cache_spec(load_cache_spec("tiny"))
    return cfg, random_state(cfg, 0)


@pytest.fixture(scope="module")
def tiny40(specs_dir):
    cfg = config_from_cache_spec(load_cache_spec("tiny40"))
    return cfg, random_state(cfg, 1)


_PROCESSED: dict = {}


def _model(pair, dtype=torch.float64, index_cache_dtype=None):
    """A fresh model over weights processed once per (state, dtype) (models never mutate them)."""
    cfg, state = pair
    key = (id(state), dtype)
    if key not in _PROCESSED:
        ckpt = LoadedCheckpoint.from_state(cfg, state)
        _PROCESSED[key] = (ckpt.process(dtype), ckpt.engram_host())
    weights, host = _PROCESSED[key]
    return ReferenceModel(cfg, weights, host, dtype, index_cache_dtype=index_cache_dtype)


def _ids(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "dtype,fake,index_fmt,tol",
    [
        (torch.float64, False, None, 1e-12),
        (torch.float64, True, None, 1e-12),
        (torch.float64, True, "fp8", 1e-12),
        (torch.float32, False, None, 1e-5),
    ],
)
def test_prefill_plus_decode_equals_longer_prefill(tiny, dtype, fake, index_fmt, tol):
    # odd prefill length, then decode steps crossing ratio-2 group boundaries; S > W, S/2 > topk,
    # S > candidate blocks * block size, so the ring wraps and every selection is active.
    # float32 runs with the fake quantizers off: with them on, one rounding flip moves an FP4
    # code and the difference is no longer summation order (parity_under_quantization.md).
    ids = _ids(45, 3)
    with quant.fake_quant(fake):
        inc = _model(tiny, dtype, index_fmt)
        ref = _model(tiny, dtype, index_fmt)
        inc.prefill(ids[:41])
        for t in range(41, 45):
            step = inc.decode(int(ids[t]))
            ref_logits = ref.prefill(ids[: t + 1])  # prefill starts a fresh cache each time
            assert set(inc.selections) == set(ref.selections) == {2, 4, 6, 8, 10, 12}
            for layer, sel in inc.selections.items():
                assert torch.equal(sel[0], ref.selections[layer][-1]), (t, layer)
            for layer, ex in inc.experts.items():
                assert torch.equal(ex[0], ref.experts[layer][-1]), (t, layer)
            assert torch.equal(inc.candidates[0], ref.candidates[-1])
            assert _rel(step, ref_logits[-1]) < tol


def test_bad_token_ids_are_refused(tiny):
    m = _model(tiny)
    with pytest.raises(ValueError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        m.prefill([1, 260])
    with pytest.raises(RuntimeError, match="decode needs a prefill first"):
        m.decode(3)


def test_causality(tiny):
    a = _ids(30, 1)
    b = a.clone()
    b[20:] = (b[20:] + 7) % 256
    ma, mb = _model(tiny), _model(tiny)
    la, lb = ma.prefill(a), mb.prefill(b)
    assert torch.equal(la[:20], lb[:20])
    assert not torch.allclose(la[20:], lb[20:])


def test_selections_follow_the_index_rules(tiny):
    m = _model(tiny)
    n = 41
    m.prefill(_ids(n, 5))
    cfg = m.cfg
    cand = m.candidates
    for layer, sel in m.selections.items():
        ratio = cfg.compress_ratios[layer]
        vis = (torch.arange(n) + 1) // ratio
        valid = sel >= 0
        assert (sel[valid] < vis[:, None].expand_as(sel)[valid]).all()
        srt = torch.where(valid, sel, torch.full_like(sel, 10**9))
        assert torch.equal(torch.sort(srt, -1).values, srt)  # ascending, -1 padding at the end
        assert torch.equal(valid.sum(-1), torch.clamp(vis, max=cfg.index_topk))
        if cfg.layers[layer].role == "reindex":  # never outside the candidates
            rows = torch.arange(n)[:, None].expand_as(sel)
            assert cand[rows[valid], sel[valid]].all()
    # the newest visible candidate block is always kept
    vis = torch.arange(n) + 1
    newest = vis - 1
    assert cand[torch.arange(n), newest].all()


def test_sparse_attention_equals_dense_softmax_over_the_listed_keys():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(9, 16, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(9, generator=g) for _ in range(5)])
    sink = torch.full((3,), float("-inf"), dtype=torch.float64)
    out = sparse_attention(q, kv, idx, sink, 0.25)
    p = torch.softmax(torch.einsum("nhd,kd->nhk", q, kv) * 0.25, -1)
    assert torch.allclose(out, torch.einsum("nhk,kd->nhd", p, kv), atol=1e-13)
    # -1 entries are skipped; a huge sink drives the output to 0; no valid key gives 0
    idx2 = torch.cat([idx[:, :4], torch.full((5, 3), -1)], 1)
    p2 = torch.softmax(torch.einsum("nhd,nkd->nhk", q, kv[idx[:, :4]]) * 0.25, -1)
    assert torch.allclose(
        sparse_attention(q, kv, idx2, sink, 0.25), torch.einsum("nhk,nkd->nhd", p2, kv[idx[:, :4]])
    )
    big = torch.full((3,), 1e4, dtype=torch.float64)
    assert sparse_attention(q, kv, idx, big, 0.25).abs().max() < 1e-100
    none = torch.full((5, 4), -1)
    assert torch.equal(sparse_attention(q, kv, none, sink, 0.25), torch.zeros_like(q))
    assert torch.equal(
        sparse_attention(q, kv, none, torch.zeros(3, dtype=torch.float64), 0.25),
        torch.zeros_like(q),
    )


def test_wide_topk_lists_every_visible_row(tiny):
    """With a top-k wider than the sequence, the index covers every visible compressed row, so
    (with the test above) the layer's attention is dense softmax over window + all visible rows."""
    cfg, state = tiny
    import dataclasses

    wide = dataclasses.replace(cfg, index_topk=64, engram_num_embeddings=())
    m = ReferenceModel.from_checkpoint(LoadedCheckpoint.from_state(wide, state), torch.float64)
    n = 30
    m.prefill(_ids(n, 2))
    for layer, sel in m.selections.items():
        vis = (torch.arange(n) + 1) // cfg.compress_ratios[layer]
        if cfg.layers[layer].role == "reindex":
            continue  # restricted to candidates by design
        for i in range(n):
            assert sel[i][sel[i] >= 0].tolist() == list(range(int(vis[i])))


def test_topk_tie_rule_and_padding():
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, float("-inf"), 3.0]])
    assert topk_ids(s, 3).tolist() == [[1, 2, 3]]
    assert topk_ids(s, 8).tolist() == [[0, 1, 2, 3, 5, -1, -1, -1]]
    assert topk_ids(torch.zeros(2, 0), 3).tolist() == [[-1, -1, -1]] * 2


def test_candidate_blocks_force_the_newest_and_prefer_smaller_blocks():
    s = torch.tensor([[5.0, 1.0, 2.0, 2.0, 2.0, 0.0, 0.5, float("-inf")]])
    m = candidate_mask(s, torch.tensor([7]), block_size=2, topk_blocks=2)
    # blocks: [5,1]=5, [2,2]=2, [2,0]=2, [0.5,-inf] newest -> forced; ties between blocks 1 and 2
    assert m.tolist() == [[True, True, False, False, False, False, True, True]]
    m3 = candidate_mask(s, torch.tensor([7]), block_size=2, topk_blocks=3)
    assert m3.tolist() == [[True, True, True, True, False, False, True, True]]


def test_mhc_invariants():
    hc, D = 4, 8
    X = torch.randn(6, hc, D, dtype=torch.float64)
    zero = HcParams(
        torch.zeros(24, hc * D, dtype=torch.float64),
        torch.zeros(24, dtype=torch.float64),
        torch.zeros(3, dtype=torch.float64),
    )
    pre, post, C = hc_predict(X, zero, hc, 20, 1e-6, 1e-20)
    assert torch.allclose(pre, torch.full_like(pre, 0.5 + 1e-6)) and torch.allclose(
        post, torch.ones_like(post)
    )
    assert torch.allclose(C, torch.full_like(C, 1 / hc), atol=1e-5)
    # moderate mixing logits (as the random checkpoints give): doubly stochastic to about 1e-4;
    # the schedule ends on a column normalization, so columns are tighter than rows
    rnd = HcParams(
        torch.randn(24, hc * D, dtype=torch.float64) * (hc * D) ** -0.5,
        torch.randn(24, dtype=torch.float64) * 0.1,
        torch.full((3,), 0.5, dtype=torch.float64),
    )
    pre, post, C = hc_predict(X, rnd, hc, 20, 1e-6, 1e-20)
    assert torch.allclose(C.sum(-2), torch.ones(6, hc, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(C.sum(-1), torch.ones(6, hc, dtype=torch.float64), atol=1e-4)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()


def test_moe_routing_tie_rule_and_weights(tiny):
    m = _model(tiny)
    moe: MoE = m.moe[0]
    x = torch.zeros(3, m.cfg.hidden_size, dtype=torch.float64)
    saved = moe.gate_bias
    moe.gate_bias = torch.zeros_like(saved)
    try:
        weights, ids = moe.route(x)  # all scores equal: smaller expert ids win
    finally:
        moe.gate_bias = saved
    assert ids.tolist() == [[0, 1]] * 3
    assert torch.allclose(
        weights.sum(-1), torch.full((3,), m.cfg.routed_scaling_factor, dtype=torch.float64)
    )
    assert (weights[:, 2:] == 0).all()


def test_bf16_runs_and_stays_finite(tiny):
    m = _model(tiny, torch.bfloat16)
    logits = m.prefill(_ids(40, 4))
    m.decode(9)
    assert torch.isfinite(logits).all() and logits.dtype == torch.float32


def test_tiny40_300_token_prefill_is_fast_and_well_scaled(tiny40):
    m = _model(tiny40, torch.float32)
    m.trace = True
    # CPU time of this thread with one torch thread, so a shared, loaded machine does not fail
    # it (about 3 s when the machine is idle)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.thread_time()
        logits = m.prefill(_ids(300, 6))
        elapsed = time.thread_time() - t0
    finally:
        torch.set_num_threads(threads)
    assert elapsed < 30, f"300-token tiny40 prefill took {elapsed:.1f} s of CPU"
    assert torch.isfinite(logits).all()
    rms = [float(x.float().pow(2).mean().sqrt()) for x in m.layer_inputs]
    assert len(rms) == 40 and all(0.5 < r < 50 for r in rms)
    p = torch.softmax(logits.double(), -1)
    top = p.max(-1).values
    assert float(logits.std(-1).min()) > 0.3  # not flat
    assert float(top.max()) < 0.99 and float(top.mean()) > 2.0 / m.cfg.vocab_size  # not one-hot


def test_forced_decisions_replace_the_computed_ones(tiny):
    ids = _ids(20, 8)
    free = _model(tiny)
    base = free.prefill(ids)
    m = _model(tiny)
    sel = torch.full((20, 4), -1, dtype=torch.long)
    sel[:, 0] = 0
    experts = torch.tensor([[6, 7]] * 20)
    m.forced_selections = {2: sel}
    m.forced_experts = {5: experts}
    forced = m.prefill(ids)
    assert torch.equal(m.selections[2], sel) and torch.equal(m.experts[5], experts)
    assert not torch.allclose(forced, base)
