"""DSpark verification: how many drafted tokens one target forward accepts, and the token
that follows them. Fixed-shape tensor work with no host sync (graph-safe), one row per
request; every row depends only on its own inputs and its ``(seed, output_index)``.

A request drafts ``k`` tokens ``d`` after its anchor; the target's forward over the anchor and
the drafts gives ``k + 1`` rows. ``output_index`` is the output index of ``d[0]``: draft ``i``
and the token after ``a`` accepted drafts take output indices ``output_index + i`` and
``output_index + a``.

- Greedy rows: ``a`` is the longest prefix with ``d[i] == argmax(target row i)``; the next
  token is ``argmax(target row a)`` (a correction, or the bonus token after ``k`` accepts).
- Sampled rows: the standard rejection rule, which emits tokens distributed exactly as the
  target's. Draft ``i`` (drawn from ``q_i``) is accepted when ``u_i * q_i(d_i) < p_i(d_i)``,
  ``u_i`` uniform in ``[0, 1)``; at the first rejection the token is drawn from
  ``max(0, p_a - q_a)`` renormalised, after ``k`` accepts from ``p_k``. ``u_i`` comes from
  ``counter_bits(seed ^ ACCEPT_SALT, output_index + i)`` (its top 24 bits); the token drawn
  is Gumbel-max with ``counter_gumbel(seed, output_index + a)``, the noise the plain sampler
  uses at that output index.
"""

from __future__ import annotations

import torch

from v41plan.runtime.sampler import _shr, counter_bits, counter_gumbel

ACCEPT_SALT = 0x5EC0_DEC0_DE5A_17ED
"""Folded into the seed for the acceptance uniforms: a stream apart from the sampler's
(below 2**63, so it is an int64 as it stands)."""


def acceptance_uniforms(seed: torch.Tensor, output_index: torch.Tensor, k: int) -> torch.Tensor:
    """``[b, k]`` float32 uniforms in ``[0, 1)`` keyed by ``(seed, output_index + i)``."""
    salted = seed.to(torch.int64) ^ ACCEPT_SALT
    cols = [_shr(counter_bits(salted, output_index + i, 1)[:, 0], 40) for i in range(k)]
    return torch.stack(cols, dim=1).to(torch.float32) * (2.0**-24)


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries of bool ``[b, k]`` are true."""
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)


def accept_greedy(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted ``[b]``, next token ``[b]``) from drafts ``[b, k]`` and the target's greedy
    tokens ``[b, k + 1]`` (its argmax at the anchor and at each draft)."""
    k = draft_tokens.shape[1]
    accepted = _leading(draft_tokens == target_tokens[:, :k])
    nxt = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return accepted, nxt


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted ``[b]``, next token ``[b]``) by the rejection rule (module docstring):
    drafts ``[b, k]`` drawn from ``draft_probs`` ``[b, k, V]``, the target's probabilities
    ``[b, k + 1, V]`` (after its own temperature and truncation), float32 or float64."""
    b, k, V = draft_probs.shape
    rows = torch.arange(b, device=draft_tokens.device)
    d = draft_tokens[..., None]
    p_d = target_probs[:, :k].gather(2, d).squeeze(-1)
    q_d = draft_probs.gather(2, d).squeeze(-1)
    u = acceptance_uniforms(seed, output_index, k).to(p_d.dtype)
    accepted = _leading(u * q_d < p_d)
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0)
    dist = torch.cat([residual, target_probs[:, k:]], dim=1)[rows, accepted]
    # p == q at a rejected position has probability 0; draw from p there all the same
    plain = target_probs[rows, accepted]
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, plain)
    score = torch.log(dist.to(torch.float32)) + counter_gumbel(seed, output_index + accepted, V)
    return accepted, torch.argmax(score, dim=1)
