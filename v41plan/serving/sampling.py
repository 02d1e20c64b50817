"""Sampling parameters, the host reference sampler and the device sampler's inputs.

``sample`` is the host reference of ``v41plan.runtime.sampler.sample_tokens``: the same
definition (see that module), written one row at a time with plain Python control flow, over
the same portable ``exp``/``log`` and counter-based noise, so the two pick the same token for
the same logits. A sampled token depends only on the logits, the parameters and
``(seed, output index)``: a preempted, chunked or reordered request draws what an
uninterrupted one draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from v41plan.runtime.sampler import (
    SamplerInputs,
    counter_gumbel,
    portable_exp,
    portable_log,
    to_int64,
)

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for (the device sampler's static ``top_n``)."""
PENALTY_RANGE = 2.0
"""Presence and frequency penalties lie in ``[-PENALTY_RANGE, PENALTY_RANGE]``."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: object) -> bool:
    return v is True or v is False


def _is_sequence(v: object) -> bool:
    return isinstance(v, (tuple, list))


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """How a request generates: the fields users know from other engines."""

    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens and their ties (0 keeps all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p``."""
    min_p: float = 0.0
    """Keep tokens at least ``min_p`` times as likely as the most likely one (0 is off)."""
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
    logprobs: int | None = None
    """Return each generated token's logprob and this many top logprobs (0: only the chosen
    token's; None: none). Raw logprobs: the model's distribution before penalties,
    temperature and truncation."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of tokens in the prompt or output."""

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (sampling then needs the request's token history)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**63:
            raise ValueError(f"top_k={self.top_k!r} must be an integer in [0, 2**63)")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not _is_sequence(self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a tuple of ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids has {t!r}, outside [0, {vocab_size})")
        if not _is_bool(self.ignore_eos):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if not _is_bool(self.prompt_logprobs):
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be a bool")
        most = min(MAX_LOGPROBS, vocab_size)
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= most
        ):
            raise ValueError(
                f"logprobs={self.logprobs!r} must be None or an integer in [0, {most}]"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_real(v) and -PENALTY_RANGE <= v <= PENALTY_RANGE):
                raise ValueError(f"{name}={v!r} must be in [{-PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")
        if not (_is_real(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0"
            )


def _f32(v: float) -> torch.Tensor:
    """A float32 scalar tensor: the host reads each parameter as the device does."""
    return torch.tensor(v, dtype=torch.float32)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    seq_seed: int,
    index: int,
    *,
    prompt_ids: Sequence[int] | None = None,
    output_ids: Sequence[int] | None = None,
) -> int:
    """One token from ``[vocab]`` logits: output token ``index`` of a request seeded
    ``seq_seed``. Penalised requests pass their history (``prompt_ids``, ``output_ids``)."""
    x = logits.to(torch.float32).reshape(-1)
    vocab = x.numel()
    if params.has_penalties:
        if output_ids is None or prompt_ids is None:
            raise ValueError("sampling with penalties needs the request's prompt and output ids")
        counts = torch.bincount(
            torch.as_tensor(list(output_ids), dtype=torch.int64), minlength=vocab
        )
        in_output = counts > 0
        seen = in_output | (
            torch.bincount(torch.as_tensor(list(prompt_ids), dtype=torch.int64), minlength=vocab)
            > 0
        )
        rep = _f32(params.repetition_penalty)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - (
            counts.to(torch.float32) * _f32(params.frequency_penalty)
            + in_output.to(torch.float32) * _f32(params.presence_penalty)
        )
    x = torch.nan_to_num(
        x, nan=float("-inf"), posinf=float(np.finfo(np.float32).max), neginf=float("-inf")
    )
    temp = _f32(params.temperature)
    if not (0 < float(temp) < math.inf):
        return int(torch.argmax(x))
    top = torch.max(x)
    if float(top) == -math.inf:
        top = _f32(0.0)
    z = (x - top) / temp + 0.0
    keep = torch.ones(vocab, dtype=torch.bool)
    top_p = float(_f32(params.top_p))
    if 0 < params.top_k < vocab or 0 < top_p < 1:
        order = torch.sort(z, descending=True, stable=True).indices  # ties: smaller id first
    if 0 < params.top_k < vocab:
        keep &= z >= z[order[params.top_k - 1]]
    min_p = float(_f32(params.min_p))
    if 0 < min_p <= 1:
        keep &= z >= portable_log(_f32(max(min_p, 2.0**-100)).reshape(1))[0]
    if 0 < top_p < 1:
        mass = torch.where(keep, (portable_exp(z) * 2.0**32).to(torch.int64), 0)[order]
        before = torch.cumsum(mass, 0) - mass
        limit = math.ceil(top_p * float(int(mass.sum())))
        n = int((before < limit).sum())
        keep &= z >= z[order[n - 1]]
    seed = torch.tensor([to_int64(seq_seed)], dtype=torch.int64)
    g = counter_gumbel(seed, torch.tensor([index], dtype=torch.int64), vocab)[0]
    return int(torch.argmax(torch.where(keep, z + g, float("-inf"))))


def token_logprobs(
    logits: torch.Tensor, token_id: int, top_n: int = 0
) -> tuple[float, list[tuple[int, float]]]:
    """The raw logprob of ``token_id`` under ``[vocab]`` logits and the ``top_n`` most likely
    ``(id, logprob)`` pairs, larger first, ties by smaller id (the host reference of the
    device sampler's logprobs)."""
    lp = torch.log_softmax(logits.to(torch.float32).reshape(-1), dim=0)
    lp = torch.where(torch.isnan(lp), float("-inf"), lp)
    order = torch.sort(lp + 0.0, descending=True, stable=True).indices[:top_n]
    return float(lp[token_id]), [(int(i), float(lp[i])) for i in order]


def prompt_logprobs(row_logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """Log-probability of ``token_ids[i + 1]`` under row ``i`` for each row but the last."""
    lp = torch.log_softmax(row_logits.double(), dim=-1)
    nxt = torch.tensor(token_ids[1 : row_logits.shape[0]], dtype=torch.long)
    return lp[torch.arange(nxt.numel()), nxt].tolist()


SAMPLER_COLUMNS: dict[str, tuple[np.dtype, float | int, str]] = {
    "temperature": (np.float32, 0.0, "temperature"),
    "top_k": (np.int64, 0, "top_k"),
    "top_p": (np.float32, 1.0, "top_p"),
    "min_p": (np.float32, 0.0, "min_p"),
    "presence_penalty": (np.float32, 0.0, "presence_penalty"),
    "frequency_penalty": (np.float32, 0.0, "frequency_penalty"),
    "repetition_penalty": (np.float32, 1.0, "repetition_penalty"),
}
"""``SamplerInputs`` field -> (numpy dtype, padding value, ``SamplingParams`` field)."""


def sampler_columns(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
    num_rows: int | None = None,
) -> dict[str, np.ndarray]:
    """Every ``[num_rows]`` column of ``SamplerInputs`` (penalties included) as numpy arrays
    for a host staging buffer: row ``i`` samples output ``output_indices[i]`` of a request
    with ``params[i]`` and ``seeds[i]``; rows past ``len(params)`` are greedy padding."""
    n = len(params)
    if len(seeds) != n or len(output_indices) != n:
        raise ValueError(f"{n} params, {len(seeds)} seeds, {len(output_indices)} indices")
    rows = n if num_rows is None else num_rows
    if rows < n:
        raise ValueError(f"num_rows={rows} is fewer than the {n} requests")
    cols = {}
    for name, (dtype, fill, field) in SAMPLER_COLUMNS.items():
        col = np.full(rows, fill, dtype=dtype)
        col[:n] = [getattr(p, field) for p in params]
        cols[name] = col
    cols["seed"] = np.zeros(rows, dtype=np.int64)
    cols["seed"][:n] = [to_int64(s) for s in seeds]
    cols["output_index"] = np.zeros(rows, dtype=np.int64)
    cols["output_index"][:n] = list(output_indices)
    return cols


def sampler_inputs(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
    *,
    num_rows: int | None = None,
    device: torch.device | str = "cpu",
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    vocab_size: int | None = None,
) -> SamplerInputs:
    """Device inputs for a batch (``sampler_columns`` on ``device``). With ``histories``
    (``(prompt_ids, output_ids)`` per request) and ``vocab_size`` the penalty stage is on,
    with ``[b, V]`` count rows built here (eager use and tests; a captured graph gathers them
    from per-slot tables instead)."""
    cols = {
        k: torch.from_numpy(v).to(device)
        for k, v in sampler_columns(params, seeds, output_indices, num_rows).items()
    }
    penalty = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    out = SamplerInputs(**{k: v for k, v in cols.items() if k not in penalty})
    if histories is None:
        return out
    n, rows = len(params), len(cols["seed"])
    if vocab_size is None or len(histories) != n:
        raise ValueError("penalties need one (prompt_ids, output_ids) per request and vocab_size")
    counts = torch.zeros(rows, vocab_size, dtype=torch.int32)
    prompt = torch.zeros(rows, vocab_size, dtype=torch.bool)
    for i, (p_ids, o_ids) in enumerate(histories):
        o = torch.as_tensor(list(o_ids), dtype=torch.int64)
        p = torch.as_tensor(list(p_ids), dtype=torch.int64)
        counts[i] = torch.bincount(o, minlength=vocab_size).to(torch.int32)
        prompt[i] = torch.bincount(p, minlength=vocab_size) > 0
    out.presence_penalty, out.frequency_penalty, out.repetition_penalty = (cols[k] for k in penalty)
    out.output_counts = counts.to(device)
    out.prompt_mask = prompt.to(device)
    return out
