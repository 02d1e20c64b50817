"""DSpark verification rules: greedy acceptance, and the rejection rule emitting tokens
distributed as the target's (counter-based randomness, so every count here is fixed)."""

from __future__ import annotations

import torch

from v41plan.runtime.sampler import counter_gumbel
from v41plan.runtime.speculative import accept_greedy, accept_sampled, acceptance_uniforms


def test_greedy_takes_the_longest_agreeing_prefix_then_the_targets_token():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    target = torch.tensor([[5, 6, 7, 9], [5, 6, 8, 9], [4, 6, 7, 9], [5, 6, 7, 9]])
    accepted, nxt = accept_greedy(draft, target)
    assert accepted.tolist() == [3, 2, 0, 0]
    assert nxt.tolist() == [9, 8, 4, 5]


def test_uniforms_are_keyed_by_seed_and_output_index():
    seed = torch.tensor([7, 7, 8])
    idx = torch.tensor([0, 1, 0])
    u = acceptance_uniforms(seed, idx, 3)
    assert u.shape == (3, 3) and (u >= 0).all() and (u < 1).all()
    assert torch.equal(u[0, 1], u[1, 0])  # (7, 1) either way
    assert not torch.equal(u[0], u[2])
    again = acceptance_uniforms(seed[:1], idx[:1], 3)
    assert torch.equal(again[0], u[0])  # a row does not depend on the batch


def _probs(logits):
    return torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)


def test_the_rejection_rule_emits_the_target_distribution():
    n, V, k = 60000, 5, 2
    p = _probs([[1.0, 0.2, -0.5, 0.0, 2.0], [0.0, 0.0, 1.0, -1.0, 0.5], [0.3, 0.1, 0.0, 0.0, 0.0]])
    q = _probs([[0.0, 1.5, 0.0, -1.0, 0.5], [1.0, -0.5, 0.0, 0.0, 0.2]])
    seed = torch.arange(n, dtype=torch.int64) * 7919 + 11
    base = torch.full((n,), 3, dtype=torch.int64)
    # drafts drawn from q with a stream of their own (the draft's sampler: another seed)
    draft = torch.stack(
        [
            torch.argmax(torch.log(q[i]).float() + counter_gumbel(seed + 1, base + i, V), dim=1)
            for i in range(k)
        ],
        dim=1,
    )
    accepted, nxt = accept_sampled(draft, q.expand(n, k, V), p.expand(n, k + 1, V), seed, base)
    assert set(accepted.tolist()) == {0, 1, 2}
    first = torch.where(accepted > 0, draft[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / n
    tol = 5 * torch.sqrt(p[0] * (1 - p[0]) / n)
    assert (freq - p[0]).abs().le(tol).all(), (freq, p[0])
    # given one accept, the second token follows p[1]
    sel = accepted >= 1
    second = torch.where(accepted[sel] > 1, draft[sel, 1], nxt[sel])
    m = int(sel.sum())
    freq2 = torch.bincount(second, minlength=V).double() / m
    assert (freq2 - p[1]).abs().le(5 * torch.sqrt(p[1] * (1 - p[1]) / m)).all(), (freq2, p[1])
    # the acceptance rate of the first draft is sum(min(p, q))
    rate = float((accepted > 0).double().mean())
    want = float(torch.minimum(p[0], q[0]).sum())
    assert abs(rate - want) < 5 * (want * (1 - want) / n) ** 0.5


def test_an_exact_draft_is_always_accepted_and_the_bonus_follows_the_last_row():
    k = 3
    p = _probs([[0.0, 3.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.5], [9.0, 0, 0, 0]])
    draft = torch.tensor([[1, 0, 3]])
    accepted, nxt = accept_sampled(
        draft, p[None, :k], p[None], torch.tensor([4]), torch.tensor([0])
    )
    assert accepted.tolist() == [3] and nxt.tolist() == [0]  # p[3] puts ~all its mass on 0
