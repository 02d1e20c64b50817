"""The device sampler on the CPU: its definition, determinism, distribution and the host twin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from v41plan.runtime.sampler import (
    SamplerInputs,
    counter_bits,
    counter_gumbel,
    kept_mask,
    penalty_rows,
    portable_exp,
    portable_log,
    record_tokens,
    reset_penalty_slot,
    sample_tokens,
    to_int64,
)
from v41plan.serving.sampling import (
    SamplingParams,
    sample,
    sampler_columns,
    sampler_inputs,
    token_logprobs,
)

M64 = (1 << 64) - 1
GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix_py(z: int) -> int:
    """SplitMix64's finaliser on Python integers mod 2**64 (the reference for the int64 ops)."""
    z &= M64
    z ^= z >> 30
    z = (z * MIX1) & M64
    z ^= z >> 27
    z = (z * MIX2) & M64
    return z ^ (z >> 31)


def _bits_py(seed: int, index: int, token: int) -> int:
    key = _mix_py(_mix_py(seed) ^ (index & M64))
    return _mix_py(key + (token + 1) * GAMMA)


def _inputs(params, seeds=None, indices=None, **kw):
    seeds = list(range(len(params))) if seeds is None else seeds
    indices = [0] * len(params) if indices is None else indices
    return sampler_inputs(params, seeds, indices, **kw)


def _one(logits_row, params, seed=0, index=0):
    """The device op on a single row."""
    return int(sample_tokens(logits_row[None], _inputs([params], [seed], [index])).token_ids[0])


def test_counter_bits_are_splitmix64_with_wrapping_int64_ops():
    seeds = [0, 1, 7, -1, -(2**63), 2**63 - 1, 123456789012345]
    indices = [0, 3, 2**40, 1, 5, 2**62, 17]
    bits = counter_bits(torch.tensor(seeds), torch.tensor(indices), 50)
    for i, (s, k) in enumerate(zip(seeds, indices, strict=True)):
        for t in (0, 1, 13, 49):
            assert int(bits[i, t]) & M64 == _bits_py(s & M64, k, t)
    assert to_int64(2**64 + 5) == 5 and to_int64(2**63) == -(2**63) and to_int64(-1) == -1


def test_portable_log_and_exp_are_close_to_libm():
    y = torch.cat([torch.rand(20000) * 50 + 2.0**-60, torch.tensor([1.0, 2.0**-100, 3e38])])
    err = (portable_log(y).double() - torch.log(y.double())).abs()
    assert float((err / torch.log(y.double()).abs().clamp(min=1.0)).max()) < 3e-7
    z = -torch.rand(20000) * 30
    rel = (portable_exp(z).double() / torch.exp(z.double()) - 1).abs()
    assert float(rel.max()) < 3e-7 and float(portable_exp(torch.zeros(1))[0]) == 1.0


def test_gumbel_noise_is_standard_gumbel_and_finite():
    g = counter_gumbel(torch.tensor([3, 4]), torch.tensor([0, 9]), 200_000).double()
    assert torch.isfinite(g).all() and float(g.min()) > -3.0 and float(g.max()) < 34.0
    assert abs(float(g.mean()) - 0.5772157) < 0.01
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.02
    # P(g <= 0) = exp(-1) for a standard Gumbel.
    assert abs(float((g <= 0).double().mean()) - math.exp(-1)) < 0.003


def test_greedy_is_first_argmax_and_the_host_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (40, 30), generator=gen).float()  # many ties
    logits[5] = float("-inf")
    logits[6, 3] = float("nan")
    out = sample_tokens(logits, _inputs([SamplingParams()] * 40))
    want = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=1)
    assert torch.equal(out.token_ids, want)
    for i in range(40):
        row = torch.nan_to_num(logits[i], nan=float("-inf")).tolist()
        assert int(out.token_ids[i]) == row.index(max(row))  # the first maximum
        assert int(out.token_ids[i]) == sample(logits[i], SamplingParams(), i, 0)


MODES = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.05),
]


def test_seeded_tokens_do_not_depend_on_batch_order_size_or_padding():
    gen = torch.Generator().manual_seed(2)
    n, vocab = len(MODES), 300
    logits = torch.randn(n, vocab, generator=gen) * 4
    seeds, idx = [11 * i + 5 for i in range(n)], [i % 3 for i in range(n)]
    base = sample_tokens(logits, _inputs(MODES, seeds, idx), top_n=4)
    perm = torch.randperm(n, generator=gen).tolist()
    pad = 5
    garbage = torch.randn(pad, vocab, generator=gen) * 1e30
    garbage[0] = float("nan")
    garbage[1] = float("-inf")
    mixed = torch.cat([logits[perm], garbage])
    inp = _inputs([MODES[i] for i in perm], [seeds[i] for i in perm], [idx[i] for i in perm])
    inp = SamplerInputs(
        temperature=torch.cat([inp.temperature, torch.tensor([float("nan"), -1.0, 1e-40, 5, 1])]),
        top_k=torch.cat([inp.top_k, torch.tensor([-4, 10**9, 0, 1, 2**62])]),
        top_p=torch.cat([inp.top_p, torch.tensor([float("nan"), -1.0, 0.0, 2.0, 1e-30])]),
        min_p=torch.cat([inp.min_p, torch.tensor([float("nan"), -1.0, 1e-45, 7.0, 1.0])]),
        seed=torch.cat([inp.seed, torch.tensor([-1, 2**63 - 1, 0, 3, 4])]),
        output_index=torch.cat([inp.output_index, torch.tensor([-7, 2**62, 0, 1, 2])]),
    )
    out = sample_tokens(mixed, inp, top_n=4)
    assert torch.equal(out.token_ids[:n], base.token_ids[perm])
    assert torch.equal(out.logprobs[:n], base.logprobs[perm])
    assert torch.equal(out.top_ids[:n], base.top_ids[perm])
    for t in (out.token_ids, out.top_ids):
        assert bool(((t >= 0) & (t < vocab)).all())
    assert not torch.isnan(out.logprobs).any() and not torch.isnan(out.top_logprobs).any()
    # One request alone, and the other seeds draw other tokens.
    for i in range(n):
        assert _one(logits[i], MODES[i], seeds[i], idx[i]) == int(base.token_ids[i])


def test_cpu_tokens_are_stable_across_runs():
    """A fixed input's tokens are part of the definition: a change here changes every seeded
    request's output."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MODES), 64, generator=gen) * 3
    inp = _inputs(MODES, [1000 + i for i in range(len(MODES))], [7] * len(MODES))
    first = sample_tokens(logits, inp, top_n=2)
    again = sample_tokens(logits.clone(), inp, top_n=2)
    assert torch.equal(first.token_ids, again.token_ids)
    assert first.token_ids.tolist() == GOLDEN


GOLDEN = [30, 20, 2, 28, 32, 26, 37, 50]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.15),
    ],
)
def test_sampled_frequencies_match_the_renormalised_softmax(params):
    """20000 draws over six tokens (seeds 0.. at output 3, and seed 9 at outputs 0..): a
    chi-square below 27 (p < 1e-4 for five degrees of freedom) and masked tokens never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
    n = 20000
    row = logits[None].expand(n, -1)
    keep = kept_mask(logits[None], _inputs([params]))[0]
    probs = torch.softmax(logits.double() / params.temperature, 0) * keep
    probs = probs / probs.sum()
    for seeds, idx in (
        (list(range(n)), [3] * n),
        ([9] * n, list(range(n))),
    ):
        tok = sample_tokens(row, _inputs([params] * n, seeds, idx)).token_ids
        counts = torch.bincount(tok, minlength=6).double()
        assert bool((counts[~keep] == 0).all())
        assert _chi2(counts, probs) < 27.0


def _mask(logits, **kw):
    return kept_mask(torch.tensor([logits]), _inputs([SamplingParams(temperature=1.0, **kw)]))[
        0
    ].tolist()


def test_truncation_masks_on_hand_cases():
    # top-k keeps the k-th value's ties.
    assert _mask([1.0, 2.0, 2.0, 0.0], top_k=1) == [False, True, True, False]
    assert _mask([3.0, 3.0, 3.0, 1.0], top_k=2) == [True, True, True, False]
    assert _mask([0.0, 5.0, 1.0, 4.0], top_k=2) == [False, True, False, True]
    assert _mask([0.0, 5.0, 1.0, 4.0], top_k=4) == [True] * 4
    # top-p: probabilities 1/2, 1/4, 1/8, 1/8.
    lg = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    assert _mask(lg, top_p=0.5) == [True, False, False, False]  # 1/2 reaches 0.5
    assert _mask(lg, top_p=0.6) == [True, True, False, False]
    assert _mask(lg, top_p=0.8) == [True, True, True, True]  # the last member's tie joins
    assert _mask(lg, top_p=1e-9) == [True, False, False, False]
    # top-p applies to what top-k left: 2/3, 1/3 after top_k=2.
    assert _mask(lg, top_k=2, top_p=0.7) == [True, True, False, False]
    assert _mask(lg, top_k=2, top_p=0.6) == [True, False, False, False]
    # min-p relative to the most likely token.
    pm = [math.log(0.5), math.log(0.25), math.log(0.2), math.log(0.05)]
    assert _mask(pm, min_p=0.45) == [True, True, False, False]
    assert _mask(pm, min_p=0.3) == [True, True, True, False]
    assert _mask(pm, min_p=1.0) == [True, False, False, False]
    assert _mask([1.0, 1.0, 0.0], min_p=1.0) == [True, True, False]
    # Temperature sharpens before top-p: at T = 0.5 the probabilities are 16:4:1:1.
    for top_p, want in ((0.7, [True, False, False, False]), (0.75, [True, True, False, False])):
        inp = _inputs([SamplingParams(temperature=0.5, top_p=top_p)])
        assert kept_mask(torch.tensor([lg]), inp)[0].tolist() == want  # 16/22 < 0.75


def test_logprobs_and_top_n_against_log_softmax():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=gen)
    logits[0, 7] = logits[0, 3] = logits[0, 20] = 9.0  # a three-way tie at the top
    logits[1, :10] = float("-inf")
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(6)]
    out = sample_tokens(logits, _inputs(params), top_n=5)
    lp = torch.log_softmax(logits, dim=1)
    assert torch.equal(out.logprobs, lp.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids[0, :3].tolist() == [3, 7, 20]
    assert torch.equal(out.top_logprobs, torch.topk(lp, 5, dim=1).values)
    assert torch.equal(out.top_logprobs, lp.gather(1, out.top_ids))
    for i in range(6):
        want, top = token_logprobs(logits[i], int(out.token_ids[i]), 5)
        assert float(out.logprobs[i]) == want
        assert out.top_ids[i].tolist() == [t for t, _ in top]
    empty = sample_tokens(logits, _inputs(params))
    assert empty.top_ids.shape == (6, 0) and empty.top_logprobs.shape == (6, 0)
    assert torch.equal(empty.token_ids, out.token_ids)


def test_float64_logits_are_cast():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 40, generator=gen, dtype=torch.float64)
    inp = _inputs([SamplingParams(temperature=1.0, top_p=0.9)] * 8)
    a = sample_tokens(logits, inp, top_n=3)
    b = sample_tokens(logits.float(), inp, top_n=3)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e-5, 1.0, 1e30])
def test_extreme_logits_and_temperatures_make_no_nan(temperature):
    vocab = 16
    rows = [
        [float("-inf")] * vocab,
        [float("inf")] + [0.0] * (vocab - 1),
        [float("nan")] * 3 + [1.0] * (vocab - 3),
        [3e38, -3e38] + [float("-inf")] * (vocab - 2),
        [1e30 * (i % 3) for i in range(vocab)],
        [float(i) for i in range(vocab)],
    ]
    logits = torch.tensor(rows)
    params = [
        SamplingParams(temperature=temperature, top_k=3, top_p=0.9, min_p=0.01, seed=i)
        for i in range(len(rows))
    ]
    out = sample_tokens(logits, _inputs(params), top_n=4)
    assert bool(((out.token_ids >= 0) & (out.token_ids < vocab)).all())
    assert not torch.isnan(out.logprobs).any() and not torch.isnan(out.top_logprobs).any()
    if temperature <= 1e-5:
        assert int(out.token_ids[5]) == vocab - 1  # near zero is greedy
    assert int(out.token_ids[3]) == 0
    for i in range(len(rows)):
        assert sample(logits[i], params[i], i, 0) == int(out.token_ids[i])


def _histories(gen, n, vocab):
    out = []
    for _ in range(n):
        p = torch.randint(
            0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen
        )
        o = torch.randint(
            0, vocab // 4, (int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen
        )
        out.append((p.tolist(), o.tolist()))
    return out


def test_host_sample_and_device_op_agree_for_every_mode():
    gen = torch.Generator().manual_seed(6)
    vocab = 257
    penal = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.9, presence_penalty=1.5, top_k=20),
        SamplingParams(temperature=1.1, frequency_penalty=-0.7, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.7, repetition_penalty=0.8, presence_penalty=-2.0),
    ]
    params = (MODES + penal) * 5
    n = len(params)
    logits = torch.randn(n, vocab, generator=gen) * 3
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen).tolist()
    idx = torch.randint(0, 1000, (n,), generator=gen).tolist()
    hist = _histories(gen, n, vocab)
    plain = sample_tokens(logits, _inputs(params, seeds, idx)).token_ids
    pen = sample_tokens(
        logits, _inputs(params, seeds, idx, histories=hist, vocab_size=vocab)
    ).token_ids
    for i, p in enumerate(params):
        host = sample(logits[i], p, seeds[i], idx[i], prompt_ids=hist[i][0], output_ids=hist[i][1])
        assert int(pen[i]) == host, (i, p)
        if not p.has_penalties:
            assert int(plain[i]) == host == sample(logits[i], p, seeds[i], idx[i])
    # Penalties move tokens somewhere in this batch (the test can see a missing stage).
    assert not torch.equal(plain, pen)
    with pytest.raises(ValueError, match="penalties"):
        sample(logits[0], penal[0], 0, 0)


def test_penalty_arithmetic_on_a_hand_case():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    inp = _inputs([p], histories=[([1], [0, 0, 2])], vocab_size=4)
    from v41plan.runtime.sampler import processed_logits

    # seen: 0, 1 (prompt), 2; counts 2, 0, 1, 0.
    want = [2.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0]
    assert processed_logits(logits, inp)[0].tolist() == want


def test_static_shortcuts_equal_the_full_computation():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 90, generator=gen)
    greedy = _inputs([SamplingParams()] * 12)
    a = sample_tokens(logits, greedy, sampled=False).token_ids
    assert torch.equal(a, sample_tokens(logits, greedy).token_ids)
    plain = _inputs([SamplingParams(temperature=0.8)] * 6 + [SamplingParams()] * 6)
    b = sample_tokens(logits, plain, truncate=False).token_ids
    assert torch.equal(b, sample_tokens(logits, plain).token_ids)


def test_slot_tables_feed_the_penalties():
    vocab, slots = 30, 4
    counts = torch.zeros(slots, vocab, dtype=torch.int32)
    prompt = torch.zeros(slots, vocab, dtype=torch.bool)
    reset_penalty_slot(counts, prompt, 2, [5, 6, 6], [7, 7, 1])
    reset_penalty_slot(counts, prompt, 0, [9], [])
    record_tokens(counts, torch.tensor([2, -1, 0, 2]), torch.tensor([7, 3, 4, 1]))
    assert counts[2, 7] == 3 and counts[2, 1] == 2 and counts[0, 4] == 1
    assert int(counts.sum()) == 3 + 3 and prompt[2].nonzero().flatten().tolist() == [5, 6]
    c_rows, p_rows = penalty_rows(counts, prompt, torch.tensor([2, 0, -1]))
    assert torch.equal(c_rows[0], counts[2]) and torch.equal(p_rows[1], prompt[0])
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, vocab, generator=gen)
    p = SamplingParams(temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.3, seed=1)
    inp = _inputs([p] * 3)
    inp.presence_penalty = torch.zeros(3)
    inp.frequency_penalty = torch.full((3,), 0.3)
    inp.repetition_penalty = torch.full((3,), 1.4)
    inp.output_counts, inp.prompt_mask = c_rows, p_rows
    built = _inputs(
        [p] * 3, histories=[([5, 6, 6], [7, 7, 1, 7, 1]), ([9], [4]), ([9], [4])], vocab_size=30
    )
    assert torch.equal(sample_tokens(logits, inp).token_ids, sample_tokens(logits, built).token_ids)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_k", True),
        ("top_k", 2**63),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("stop_token_ids", 5),
        ("stop_token_ids", (300,)),
        ("ignore_eos", 1),
        ("prompt_logprobs", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
    ],
)
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(260)


def test_sampler_columns_pad_with_neutral_rows():
    cols = sampler_columns(
        [SamplingParams(temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=1.5)],
        [2**64 - 1],
        [4],
        num_rows=3,
    )
    assert cols["seed"].tolist() == [-1, 0, 0] and cols["output_index"].tolist() == [4, 0, 0]
    assert cols["temperature"].tolist() == [0.5, 0.0, 0.0] and cols["top_k"].tolist() == [3, 0, 0]
    assert cols["top_p"].tolist() == [1.0] * 3 and cols["repetition_penalty"][1:].tolist() == [1, 1]
    assert cols["min_p"].dtype == np.float32 and abs(float(cols["min_p"][0]) - 0.1) < 1e-8


def test_validate_accepts_the_edges():
    SamplingParams(
        temperature=0.0,
        top_k=10**6,
        top_p=1.0,
        min_p=1.0,
        seed=-(2**70),
        logprobs=20,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=5.0,
        stop_token_ids=(0, 259),
    ).validate(260)
    SamplingParams(logprobs=0, min_p=0.0).validate(260)
