"""The device sampler: rows of logits to token ids and logprobs, with no host sync.

``sample_tokens`` is pure fixed-shape tensor work (no ``.item()``, no data-dependent shape, no
Python branch on device data), so it runs inside ``torch.cuda.graph`` capture. Every row is
independent of the others: a request's token depends only on its own logits row, its own
parameters and ``(seed, output_index)``, never on the batch, its order or its padding.

The definition, row by row (``x`` the float32 logits of one row, ``V`` the vocabulary):

1. Penalties (only when ``output_counts`` is given; vLLM's semantics). ``c`` is the count of
   each token among the request's output tokens, ``seen`` is ``c > 0`` or the token is in the
   prompt. ``x = x / r`` where ``seen and x > 0``, ``x * r`` where ``seen and x <= 0``
   (repetition ``r``); then ``x = x - (c * f + (c > 0) * p)`` (frequency ``f``, presence
   ``p``).
2. ``x = nan_to_num(x, nan=-inf, posinf=FLT_MAX)``.
3. Greedy rows (``temperature`` 0, or not a positive finite number): ``argmax(x)``, the first
   maximum on ties.
4. Sampled rows, ``T`` the temperature: ``z = (x - max(x)) / T`` (a row max of ``-inf`` counts
   as 0), so ``z <= 0`` and the best token has ``z = 0``. A token is kept when ``z >= t``,
   one threshold ``t`` per row:

   - ``t_k``: the ``top_k``-th largest ``z`` (``top_k`` 0 or ``>= V``: the smallest);
     every token tied with it is kept.
   - ``t_min``: ``portable_log(min_p)`` (``min_p`` 0: ``-inf``); ``z >= log(min_p)`` is
     ``p / p_max >= min_p``.
   - ``t_p`` (``top_p < 1``): sort the tokens by ``z`` descending, ties by smaller id; give
     each token with ``z >= max(t_k, t_min)`` the integer mass
     ``q = floor(portable_exp(z) * 2**32)`` (others 0), ``C`` the exclusive prefix sum of
     ``q`` in that order and ``Z`` the total; the ``n``-th token in order is the last one with
     ``C < ceil(float64(top_p) * Z)``; ``t_p`` is its ``z`` (its ties are kept too). This is
     the smallest set whose probability reaches ``top_p`` within the distribution that
     top-k and min-p left, in exact integer arithmetic.

   ``t = max(t_k, t_min, t_p)``, and the token is ``argmax(z + g)`` over the kept tokens,
   first maximum on ties, with ``g`` the Gumbel noise of ``counter_gumbel``. Gumbel-max draws
   exactly from the softmax of ``z`` renormalised over the kept tokens.
5. ``logprobs``: ``log_softmax`` of the raw logits (before penalties, temperature and
   truncation; vLLM's default ``raw_logprobs``) at the chosen token; ``top_n``: the ``top_n``
   largest of the same, larger first, ties by smaller id. ``NaN`` reads as ``-inf``.

Why the token is the same bit for bit on every device: every step that decides it is exact in
IEEE arithmetic or integer arithmetic (``+ - * /``, comparisons, ``max``, ``argmax``, a stable
sort, int64 sums, bit casts); ``exp`` and ``log`` are ``portable_exp`` / ``portable_log``
below, built from those operations rather than the platform's libm; no floating-point sum
decides anything. CPU and CUDA (eager torch, which contracts nothing into FMAs across ops)
therefore pick the same token for the same float32 logits. The logprobs come from
``torch.log_softmax`` and agree to rounding, not bit for bit. Compiling this function with a
code generator that fuses ``a * b + c`` into an FMA would break the guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment (the odd 64-bit golden-ratio constant)."""
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
MAX_VOCAB = 1 << 20
"""Largest vocabulary: keeps every top-p integer sum below 2**52 (exact in float64)."""
_MASS_SCALE = float(2**32)
_FLT_MAX = float(np.finfo(np.float32).max)


def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (a constant every device reads the same)."""
    return float(np.float32(v))


_LN2 = _f32(np.log(2.0))
_SQRT2 = _f32(np.sqrt(2.0))
_LOG2E = _f32(1.0 / np.log(2.0))
_LN2_HI = 0.693359375  # 355/512: k * _LN2_HI is exact for |k| < 2**15
_LN2_LO = _f32(np.log(2.0) - 0.693359375)
_ATANH = [_f32(2.0 / (2 * i + 1)) for i in range(5)]  # 2 * atanh(s) = sum 2 s^(2i+1) / (2i+1)
_EXP = [_f32(1.0 / np.prod(np.arange(1, i + 1))) for i in range(8)]  # 1 / i!


def to_int64(value: int) -> int:
    """``value`` mod 2**64 read as a two's-complement int64 (how seeds enter the device)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits: the arithmetic shift with the sign copies masked."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping multiplies, logical shifts)."""
    z = z ^ _shr(z, 30)
    z = z * to_int64(_MIX1)
    z = z ^ _shr(z, 27)
    z = z * to_int64(_MIX2)
    return z ^ _shr(z, 31)


def row_keys(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """``mix64(mix64(seed) ^ output_index)``: one 64-bit stream key per ``(seed, index)``."""
    return mix64(mix64(seed.to(torch.int64)) ^ output_index.to(torch.int64))


def counter_bits(seed: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, vocab_size]`` int64 random bits: token ``t`` of row ``i`` is the ``t``-th output of
    a SplitMix64 generator in state ``row_keys(seed, output_index)[i]``, that is
    ``mix64(key + (t + 1) * GAMMA)`` mod 2**64."""
    key = row_keys(seed, output_index)
    steps = (torch.arange(1, vocab_size + 1, device=key.device) * to_int64(_GAMMA))[None, :]
    return mix64(key[:, None] + steps)


def _log_parts(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = 2**e * m`` with ``m`` in ``[sqrt(1/2), sqrt(2))`` for positive normal float32
    ``y``, from the bits (exact)."""
    bits = y.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > _SQRT2
    return e + big.to(torch.int32), torch.where(big, m * 0.5, m)


def _two_atanh(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``2 * atanh(num / den)`` by its odd series to ``s**9`` (``|s| <= 0.1716``: the first
    term left out is below 1e-9)."""
    s = num / den
    s2 = s * s
    acc = s2 * _ATANH[4] + _ATANH[3]
    for c in reversed(_ATANH[:3]):
        acc = acc * s2 + c
    return acc * s


def portable_log(y: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 ``y`` from IEEE ``+ - * /`` and bit casts only,
    so every device returns the same bits (relative error below 3e-7)."""
    e, m = _log_parts(y)
    return e.to(torch.float32) * _LN2 + _two_atanh(m - 1.0, m + 1.0)


def portable_exp(z: torch.Tensor) -> torch.Tensor:
    """``exp(z)`` for float32 ``z``, clamped to ``[-30, 0]`` first (the sampler's range), from
    IEEE ``+ - * /``, ``round`` and bit casts only (relative error below 3e-7)."""
    z = z.clamp(-30.0, 0.0)
    k = torch.round(z * _LOG2E)
    r = (z - k * _LN2_HI) - k * _LN2_LO
    acc = r * _EXP[7] + _EXP[6]
    for c in reversed(_EXP[:6]):
        acc = acc * r + c
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return acc * scale


def counter_gumbel(seed: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, vocab_size]`` float32 standard Gumbel noise keyed by ``(seed, output_index,
    token)``, the same bits on every device.

    From ``u = counter_bits(...)``: ``W = hi * 2**-24 + lo * 2**-48`` with ``hi`` the top 24
    bits of ``u`` and ``lo`` the next 24 with the lowest bit set (a uniform draw in
    ``[2**-48, 1)``; both halves convert to float32 exactly), ``E = -log(1 - W)`` (an
    Exp(1) draw; for ``1 - W`` in ``[sqrt(1/2), 1)`` the series takes ``-W`` itself, so small
    ``W`` keeps its precision) and ``g = -log(E)``, both logs by ``portable_log``'s
    arithmetic. ``g`` lies in ``[-2.9, 33.3]``: finite, so it never makes a NaN.
    """
    u = counter_bits(seed, output_index, vocab_size)
    hi = _shr(u, 40).to(torch.float32)
    lo = ((_shr(u, 16) & 0xFFFFFF) | 1).to(torch.float32)
    w = (hi * _f32(2.0**-24) + lo * _f32(2.0**-48)).clamp(max=_f32(1.0 - 2.0**-24))
    y = 1.0 - w
    e, m = _log_parts(y)
    near_one = e == 0
    log_y = e.to(torch.float32) * _LN2 + _two_atanh(
        torch.where(near_one, -w, m - 1.0), torch.where(near_one, 2.0 - w, m + 1.0)
    )
    return -portable_log(-log_y)


@dataclass
class SamplerInputs:
    """Per-request sampling parameters of one batch, as device tensors of ``[b]`` (any values
    in padding rows: they give a token nobody reads and never a NaN).

    Penalties are on when ``output_counts`` is given; then all five penalty fields are needed.
    The counts are ``[b, V]`` rows the caller gathers from per-slot tables it keeps in device
    memory (``penalty_rows``) and updates after each sampled token (``record_tokens``).
    """

    temperature: torch.Tensor
    """float32; 0 (or anything not positive and finite) is greedy."""
    top_k: torch.Tensor
    """int64; 0 (or anything outside ``[1, V)``) keeps every token."""
    top_p: torch.Tensor
    """float32; 1 (or anything outside ``(0, 1)``) keeps every token."""
    min_p: torch.Tensor
    """float32; 0 (or anything not in ``(0, 1]``) is off."""
    seed: torch.Tensor
    """int64; the request's seed (``to_int64`` of the host integer)."""
    output_index: torch.Tensor
    """int64; which output token of the request this row samples (0 for the first)."""
    presence_penalty: torch.Tensor | None = None
    """float32; subtracted from every token the output holds (0 is off)."""
    frequency_penalty: torch.Tensor | None = None
    """float32; subtracted once per occurrence in the output (0 is off)."""
    repetition_penalty: torch.Tensor | None = None
    """float32; divides positive and multiplies negative logits of seen tokens (1 is off)."""
    output_counts: torch.Tensor | None = None
    """int32 ``[b, V]``: how often each token occurs in the request's output so far."""
    prompt_mask: torch.Tensor | None = None
    """bool ``[b, V]``: which tokens occur in the request's prompt (repetition penalty)."""

    @property
    def penalties(self) -> bool:
        """Whether the penalty stage runs (a static property of the inputs, not device data)."""
        return self.output_counts is not None


@dataclass
class SamplerOutput:
    """What one step reads back: token ids and the logprobs asked for."""

    token_ids: torch.Tensor
    """int64 ``[b]``, always in ``[0, V)``."""
    logprobs: torch.Tensor
    """float32 ``[b]``: raw log-softmax at the chosen token (``-inf`` at worst, never NaN)."""
    top_ids: torch.Tensor
    """int64 ``[b, top_n]``: the ``top_n`` most likely ids of the raw distribution."""
    top_logprobs: torch.Tensor
    """float32 ``[b, top_n]``: their logprobs, larger first."""


def _valid(x: torch.Tensor, lo_open: float, hi_open: float) -> torch.Tensor:
    """``lo_open < x < hi_open`` (false for NaN)."""
    return (x > lo_open) & (x < hi_open)


def apply_penalties(x: torch.Tensor, params: SamplerInputs) -> torch.Tensor:
    """Step 1 of the definition on ``[b, V]`` float32 logits (a new tensor)."""
    if params.output_counts is None or params.prompt_mask is None:
        raise ValueError("penalties need both output_counts and prompt_mask")
    if (
        params.presence_penalty is None
        or params.frequency_penalty is None
        or params.repetition_penalty is None
    ):
        raise ValueError("penalties need presence_penalty, frequency_penalty, repetition_penalty")
    counts = params.output_counts
    in_output = counts > 0
    seen = in_output | params.prompt_mask
    rep = params.repetition_penalty.to(torch.float32)
    rep = torch.where(_valid(rep, 0.0, float("inf")), rep, 1.0)[:, None]
    freq = params.frequency_penalty.to(torch.float32)
    pres = params.presence_penalty.to(torch.float32)
    freq = torch.where(torch.isfinite(freq), freq, 0.0)[:, None]
    pres = torch.where(torch.isfinite(pres), pres, 0.0)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - (counts.to(torch.float32) * freq + in_output.to(torch.float32) * pres)


def _keep_threshold(z: torch.Tensor, params: SamplerInputs) -> torch.Tensor:
    """``[b, 1]`` threshold ``t`` of step 4 (keep ``z >= t``)."""
    b, vocab = z.shape
    z_sorted = torch.sort(z, dim=1, descending=True, stable=True).values
    top_k = params.top_k.to(torch.int64)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    t_k = z_sorted.gather(1, (k - 1)[:, None])
    min_p = params.min_p.to(torch.float32)
    on = (min_p > 0) & (min_p <= 1)
    t_min = torch.where(on, portable_log(min_p.clamp(_f32(2.0**-100), 1.0)), float("-inf")).reshape(
        b, 1
    )
    t_km = torch.maximum(t_k, t_min)
    kept = z_sorted >= t_km
    mass = torch.where(kept, (portable_exp(z_sorted) * _MASS_SCALE).to(torch.int64), 0)
    before = torch.cumsum(mass, dim=1) - mass
    total = before[:, -1:] + mass[:, -1:]
    top_p = params.top_p.to(torch.float32)
    p_on = _valid(top_p, 0.0, 1.0)
    top_p = torch.where(p_on, top_p, 1.0)
    limit = torch.ceil(top_p.to(torch.float64)[:, None] * total.to(torch.float64))
    n_p = (before < limit.to(torch.int64)).sum(dim=1)
    n = torch.where(p_on, n_p, kept.sum(dim=1)).clamp(1, vocab)
    return z_sorted.gather(1, (n - 1)[:, None])


def _order_keys(lp: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering ``[b, V]`` float32 ``lp`` (no NaN, no -0.0) by value descending,
    then id ascending, all distinct: the float's order-preserving int32 in the high half,
    ``2**32 - 1 - id`` in the low half."""
    bits = lp.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    ids = torch.arange(lp.shape[1], device=lp.device, dtype=torch.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def _check(logits: torch.Tensor, top_n: int = 0) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [b, V], not {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary {vocab} exceeds the sampler's {MAX_VOCAB}")
    if not 0 <= top_n <= vocab:
        raise ValueError(f"top_n={top_n} must be in [0, {vocab}]")


def processed_logits(logits: torch.Tensor, params: SamplerInputs) -> torch.Tensor:
    """Steps 1 and 2 of the definition: float32 ``[b, V]`` logits after penalties, with no
    NaN and no ``+inf`` (greedy takes their argmax)."""
    x = logits.to(torch.float32)
    if params.penalties:
        x = apply_penalties(x, params)
    return torch.nan_to_num(x, nan=float("-inf"), posinf=_FLT_MAX, neginf=float("-inf"))


def scaled_logits(x: torch.Tensor, params: SamplerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, hot)`` of step 4 from processed logits: ``z = (x - max x) / T`` (``z <= 0``, no
    ``-0.0``) and ``hot`` ``[b]`` the rows that sample (``T`` positive and finite)."""
    temp = params.temperature.to(torch.float32)
    hot = _valid(temp, 0.0, float("inf"))
    row_max = x.amax(dim=1, keepdim=True)
    row_max = torch.where(row_max > float("-inf"), row_max, 0.0)
    return (x - row_max) / torch.where(hot, temp, 1.0)[:, None] + 0.0, hot


def kept_mask(logits: torch.Tensor, params: SamplerInputs) -> torch.Tensor:
    """``[b, V]`` bool: the tokens top-k, top-p and min-p keep in each row (step 4)."""
    _check(logits)
    z, _ = scaled_logits(processed_logits(logits, params), params)
    return z >= _keep_threshold(z, params)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplerInputs,
    *,
    top_n: int = 0,
    sampled: bool = True,
    truncate: bool = True,
) -> SamplerOutput:
    """Pick one token per row of ``[b, V]`` logits (float32; float64 is cast) as the module
    docstring defines, returning the token ids, their raw logprobs and the ``top_n`` most
    likely ids with their logprobs.

    ``sampled`` and ``truncate`` are static shortcuts for graphs whose whole batch allows them
    (the host knows): ``sampled=False`` computes only the greedy token (every row must be
    greedy), ``truncate=False`` skips the top-k/top-p/min-p stage and its sort (every row
    must keep every token). Under those conditions the tokens equal the full computation's.
    """
    _check(logits, top_n)
    b, vocab = logits.shape
    x = processed_logits(logits, params)
    token = torch.argmax(x, dim=1)
    if sampled:
        z, hot = scaled_logits(x, params)
        score = z + counter_gumbel(params.seed, params.output_index, vocab)
        if truncate:
            score = torch.where(z >= _keep_threshold(z, params), score, float("-inf"))
        token = torch.where(hot, torch.argmax(score, dim=1), token)
    lp = torch.log_softmax(logits.to(torch.float32), dim=1)
    lp = torch.where(torch.isnan(lp), float("-inf"), lp)
    chosen = lp.gather(1, token[:, None]).squeeze(1)
    if top_n:
        keys = torch.topk(_order_keys(lp + 0.0), top_n, dim=1).values
        top_ids = ((1 << 32) - 1) - (keys & 0xFFFFFFFF)
        top_lp = lp.gather(1, top_ids)
    else:
        top_ids = torch.zeros(b, 0, dtype=torch.int64, device=logits.device)
        top_lp = torch.zeros(b, 0, dtype=torch.float32, device=logits.device)
    return SamplerOutput(token, chosen, top_ids, top_lp)


def penalty_rows(
    output_counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[b, V]`` rows of per-slot tables (``[num_slots, V]`` int32 counts and bool prompt
    mask) for a batch's ``slots`` ``[b]`` (negative for padding: row 0, unread). Capturable."""
    rows = slots.clamp(min=0)
    return output_counts.index_select(0, rows), prompt_mask.index_select(0, rows)


def record_tokens(
    output_counts: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """Count each row's sampled token in its slot's row of the ``[num_slots, V]`` int32 table,
    in place (integer adds: deterministic); padding rows (negative slot) add nothing.
    Capturable; call it only for rows that really emit their token."""
    vocab = output_counts.shape[1]
    flat = slots.clamp(min=0).to(torch.int64) * vocab + token_ids.to(torch.int64)
    output_counts.view(-1).scatter_add_(0, flat, (slots >= 0).to(output_counts.dtype))


def reset_penalty_slot(
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    slot: int,
    prompt_ids: list[int],
    output_ids: list[int],
) -> None:
    """Rebuild one slot's rows from a request's token history (at admission or resumption, on
    the host's stream; not captured)."""
    vocab = output_counts.shape[1]
    dev = output_counts.device
    out = torch.as_tensor(list(output_ids), dtype=torch.int64).reshape(-1)
    prm = torch.as_tensor(list(prompt_ids), dtype=torch.int64).reshape(-1)
    output_counts[slot] = torch.bincount(out, minlength=vocab).to(output_counts.dtype).to(dev)
    prompt_mask[slot] = (torch.bincount(prm, minlength=vocab) > 0).to(dev)
