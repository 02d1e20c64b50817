"""The dense DSpark draft (float64, the TINY draft): taps, rings seeded at target positions
only, the bidirectional block, the Markov bias picked position by position, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.model.test_dspark_checkpoint import TINY_DRAFT
from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.dspark import DraftReference
from v41plan.model.reference import ReferenceModel

F64 = torch.float64
PROMPT = [40 + (7 * i) % 200 for i in range(20)]


@pytest.fixture(scope="module")
def model(specs_dir):
    base = config_from_cache_spec(load_cache_spec("tiny"))
    cfg = replace(base, extra={**base.extra, **TINY_DRAFT})
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 21, draft=True))
    weights = ckpt.process(F64)
    return cfg, weights, ckpt.engram_host()


def _target(model):
    cfg, weights, engram = model
    return ReferenceModel(cfg, weights, engram, F64)


def _draft(model, **changes):
    cfg, weights, _ = model
    if changes:
        cfg = replace(cfg, extra={**cfg.extra, **changes})
    return DraftReference(cfg, weights, F64)


def test_taps_are_the_stream_means_entering_the_tap_layers(model):
    t = _target(model)
    t.trace = True
    t.prefill(PROMPT)
    want = torch.cat([t.layer_inputs[L].mean(1) for L in (11, 12, 13)], dim=1)
    assert t.taps.shape == (len(PROMPT), 3 * 64) and torch.equal(t.taps, want)
    t.decode(5)
    assert t.taps.shape == (1, 3 * 64)
    cfg, weights, engram = model
    plain = ReferenceModel(replace(cfg, extra={}), weights, engram, F64)
    plain.prefill(PROMPT)
    assert plain.taps is None


def test_rings_seeded_whole_or_row_by_row_draft_alike(model):
    t = _target(model)
    t.prefill(PROMPT)
    whole, rows = _draft(model), _draft(model)
    n = len(PROMPT)
    whole.observe(t.taps, torch.arange(n))
    for i in range(n):
        rows.observe(t.taps[i : i + 1], [i])
    for k in range(3):
        assert torch.equal(whole.ring[k], rows.ring[k])
        assert torch.equal(whole.ring_pos[k], rows.ring_pos[k])
        # a ring of W + block rows holds the last W + block positions
        assert sorted(whole.ring_pos[k].tolist()) == list(range(n - 13, n))
    a, b = whole.propose(9, n), rows.propose(9, n)
    assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)
    assert len(a.tokens) == 5 and a.confidence.shape == (5,)
    assert torch.isfinite(a.confidence).all()


def test_rows_at_or_after_the_anchor_are_not_context(model):
    t = _target(model)
    t.prefill(PROMPT)
    ahead, exact = _draft(model), _draft(model)
    ahead.observe(t.taps[:17], torch.arange(17))  # rows 12..16 sit at or after the anchor
    exact.observe(t.taps[:12], torch.arange(12))
    a, b = ahead.propose(3, 12), exact.propose(3, 12)
    # the rings differ in their newest rows, which the block must not read
    assert not torch.equal(ahead.ring[0], exact.ring[0])
    assert a.tokens == b.tokens and torch.allclose(a.logits, b.logits, rtol=0, atol=1e-12)


def test_the_block_is_bidirectional(model):
    t = _target(model)
    t.prefill(PROMPT)
    one, other = _draft(model), _draft(model, dspark_noise_token_id=254)
    for d in (one, other):
        d.observe(t.taps, torch.arange(len(PROMPT)))
    a, b = one.propose(9, len(PROMPT)), other.propose(9, len(PROMPT))
    # row 0 holds the anchor in both blocks: it differs only through the later rows it reads
    assert not torch.allclose(a.logits[0], b.logits[0], rtol=0, atol=1e-9)


def test_markov_bias_follows_the_drafted_tokens(model):
    t = _target(model)
    t.prefill(PROMPT)
    d = _draft(model)
    d.observe(t.taps, torch.arange(len(PROMPT)))
    out = d.propose(17, len(PROMPT))
    flat = _draft(model)
    flat.markov_head = torch.zeros_like(flat.markov_head)
    flat.observe(t.taps, torch.arange(len(PROMPT)))
    base = flat.propose(17, len(PROMPT)).logits
    prev = [17, *out.tokens[:-1]]
    for i in range(5):
        bias = d.markov_head @ d.markov_embed[prev[i]]
        assert torch.allclose(out.logits[i], base[i] + bias, rtol=0, atol=1e-12)
        assert out.tokens[i] == int(torch.argmax(out.logits[i]))


def test_temperature_zero_is_deterministic_and_sampling_follows_its_generator(model):
    t = _target(model)
    t.prefill(PROMPT)
    d = _draft(model)
    d.observe(t.taps, torch.arange(len(PROMPT)))
    n = len(PROMPT)
    assert d.propose(4, n).tokens == d.propose(4, n).tokens
    one = d.propose(4, n, 1.0, torch.Generator().manual_seed(3)).tokens
    two = d.propose(4, n, 1.0, torch.Generator().manual_seed(3)).tokens
    assert one == two
    draws = {tuple(d.propose(4, n, 5.0, torch.Generator().manual_seed(s)).tokens) for s in range(8)}
    assert len(draws) > 1  # a high temperature does sample


def test_a_model_without_a_draft_is_refused(model):
    cfg, weights, _ = model
    with pytest.raises(ValueError, match="declares no DSpark draft"):
        DraftReference(replace(cfg, extra={}), weights, F64)


def test_the_context_is_the_window_before_the_anchor(model):
    t = _target(model)
    t.prefill(PROMPT)
    n, W = len(PROMPT), 8
    full, window = _draft(model), _draft(model)
    full.observe(t.taps, torch.arange(n))  # its ring also holds 5 rows older than the window
    window.observe(t.taps[n - W :], torch.arange(n - W, n))
    a, b = full.propose(6, n), window.propose(6, n)
    assert a.tokens == b.tokens and torch.allclose(a.logits, b.logits, rtol=0, atol=1e-12)


def _greedy(t, prompt, n):
    logits = t.prefill(prompt)
    out = [int(torch.argmax(logits[-1]))]
    while len(out) < n:
        out.append(int(torch.argmax(t.decode(out[-1]))))
    return out


def test_speculative_greedy_gives_the_targets_tokens_and_counts_acceptance(model):
    from v41plan.model.dspark import speculative_greedy

    want = _greedy(_target(model), PROMPT, 24)
    got, stats = speculative_greedy(_target(model), _draft(model), PROMPT, 24)
    assert got == want
    assert sum(stats.histogram) * 5 == stats.drafted
    assert stats.accepted == sum(a * c for a, c in enumerate(stats.histogram))

    # a draft that proposes the target's own continuation is accepted whole
    oracle = _draft(model)
    real = oracle.propose

    def propose(anchor, anchor_pos, *args):
        out = real(anchor, anchor_pos, *args)
        at = anchor_pos - len(PROMPT)  # the anchor is want[at]
        out.tokens = (want[at + 1 :] + [0] * 6)[:5]
        return out

    oracle.propose = propose
    got, stats = speculative_greedy(_target(model), oracle, PROMPT, 24)
    assert got == want
    # 1 + 3 * 6 tokens, then 5 accepted drafts reach 24
    assert stats.histogram == [0, 0, 0, 0, 0, 4] and stats.accepted == 20
