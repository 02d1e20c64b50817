"""Sampling parameters and the per-token sampler (greedy or seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request generates: the fields users know from other engines."""

    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens (0 keeps all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p``."""
    seed: int | None = None
    """Seed of a sampled request; equal seeds give equal tokens whatever the schedule."""
    max_tokens: int = 16
    """Tokens to generate at most."""
    stop_token_ids: tuple[int, ...] = ()
    """Finishing tokens (kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token."""
    prompt_logprobs: bool = False
    """Return the log-probability of every prompt token after the first (scoring)."""

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids has {t!r}, outside [0, {vocab_size})")


def sample(logits: torch.Tensor, params: SamplingParams, seq_seed: int, index: int) -> int:
    """One token from ``[vocab]`` logits.

    A sampled token draws from a generator seeded by (seed, output index), so a preempted or
    reordered request draws the same token as an uninterrupted one.
    """
    logits = logits.float()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    gen = torch.Generator().manual_seed((seq_seed * 1_000_003 + index) % (2**63 - 1))
    return int(torch.multinomial(probs, 1, generator=gen))


def prompt_logprobs(row_logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """Log-probability of ``token_ids[i + 1]`` under row ``i`` for each row but the last."""
    lp = torch.log_softmax(row_logits.double(), dim=-1)
    nxt = torch.tensor(token_ids[1 : row_logits.shape[0]], dtype=torch.long)
    return lp[torch.arange(nxt.numel()), nxt].tolist()
