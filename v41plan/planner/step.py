"""Per-step row plans: ``plan_step(StepInput) -> StepPlan``.

Pure host code (numpy only; no torch, no pydantic): it runs once per scheduler step on the
GPU image, and everything the executor does in that step follows from the frozen
``StepPlan`` it returns. The executor only copies these arrays into fixed-address buffers.

Conventions used by every array below:

- *Flat rows* index the step's token batch ``[0, running_tokens)``; requests' rows are
  contiguous, in request order (``cu_seqlens_q``), followed by padding rows.
- *Request rows* index ``[0, running_bs)``: the real requests first, in input order, then
  padding requests (zero length in ``cu_seqlens_q``, slot -1, batch id never used).
- Padding tokens have batch id -1 and position 0; every writer must skip them.
- Positions are absolute token positions of the request's sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Phase = Literal["prefill", "decode"]
"""A request's phase in a step: a prefill chunk (prompt rows) or decode (sampled rows)."""

SUB_STEPS: tuple[str, ...] = ("ring_write", "compress", "attention", "ffn")
"""Sub-steps of one layer, in execution order of the stage table."""


@dataclass(frozen=True)
class RequestInput:
    """One scheduled request of a step, as the scheduler describes it."""

    slot: int
    """STATE slot (Active Slot index) the request runs in."""
    block_table: tuple[int, ...] | np.ndarray
    """PAGE ids of the request's sequence, in order (page ``k`` holds tokens ``[k*P, (k+1)*P)``)."""
    prompt_len: int
    """Prompt length in tokens."""
    start: int
    """Resume point: the first position the scheduler scheduled, before any replay back-off."""
    chunk_len: int
    """New tokens scheduled from ``start``: the forward ends at ``start + chunk_len``."""
    phase: Phase = "prefill"
    """``prefill`` for prompt chunks, ``decode`` for sampled tokens (``start >= prompt_len``)."""
    prefix_hit: int = 0
    """Prefix-cache hit in tokens (on the hash-block grid), 0 if none; reported, never changed."""
    fresh_slot: bool = False
    """True when the slot holds no state for this request (zeroed). With ``start > 0`` this is an
    encoder-replay rebuild: the forward starts a hash block below ``start`` and rebuilds the rings."""
    token_ids: tuple[int, ...] | np.ndarray | None = None
    """The request's Engram-compressed token ids by position (-1 for DEAD/unknown), at least the
    ``replay_history_tokens`` positions before the forward start; only read when the forward
    starts below the slot's cursor (back-off) or in a fresh slot. None: history ids are -1."""


@dataclass(frozen=True)
class StepInput:
    """A whole step: its requests and the width it runs at."""

    requests: tuple[RequestInput, ...]
    """Scheduled requests, in batch order (batch id = index)."""
    running_bs: int | None = None
    """Request width of the forward (graph bucket); None: the number of requests."""
    running_tokens: int | None = None
    """Token width of the forward (graph bucket); None: the scheduled rows (after back-off)."""
    block_table_width: int | None = None
    """Columns of ``StepPlan.block_tables``; None: the longest request's table."""


@dataclass(frozen=True)
class CompressPlan:
    """The compressed groups of one ratio that close in this forward and are written.

    A group ``j`` of ratio ``r`` covers positions ``[j*r, j*r + r)`` and closes at its last member
    (``(pos + 1) % r == 0``). Groups ending below the request's ``write_from`` are dropped: the
    prefix cache already holds them. Arrays are indexed by plan entry, in flat-row order.
    """

    ratio: int
    """Compression ratio (1 or 2)."""
    rows: np.ndarray
    """int32 flat row of each group's last member (where the group's latent is emitted)."""
    batch_ids: np.ndarray
    """int32 request row of each group."""
    compressed_rows: np.ndarray
    """int64 compressed row id ``pos // r`` (main/index row inside the owner's pages)."""
    rope_positions: np.ndarray
    """int64 first position of the group ``compressed_row * r``: RoPE of the latent and index key."""
    first_from_tail: np.ndarray
    """bool: the group's first member is the slot's FP32 tail (the group began before the forward)."""
    tail_store_rows: np.ndarray
    """int32 flat rows whose group is still open at the forward's end: their projection is stored
    into the slot's FP32 tail (empty for ratio 1)."""
    tail_store_batch_ids: np.ndarray
    """int32 request row of each ``tail_store_rows`` entry."""


@dataclass(frozen=True)
class StageRows:
    """The flat rows one graph stage runs, per sub-step (layers in a stage share them)."""

    name: str
    """``backbone``, ``early``, ``late`` or ``layer<N>`` (a layer run between graphs)."""
    first_layer: int
    """First layer of the stage."""
    last_layer: int
    """Last layer of the stage (inclusive)."""
    rows: dict[str, np.ndarray] = field(hash=False, compare=False)
    """Sub-step (``ring_write``, ``attention``, ``ffn``) -> int32 sorted flat rows; ``compress``
    maps to the rows of the stage's Full owners (empty without one)."""


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward computes, as numpy arrays at the declared width."""

    running_bs: int
    """Request width (rows of every per-request array)."""
    running_tokens: int
    """Token width (rows of every per-token array)."""
    scheduled_bs: int
    """Real requests in the step."""
    scheduled_tokens: int
    """Real rows in the step (after back-off): ``cu_seqlens_q[scheduled_bs]``."""
    graph_key: tuple[str, int, int]
    """``(kind, running_bs, running_tokens)``; kind ``decode`` (every request decoding; one captured
    graph), ``prefill`` (eager, one backbone) or ``prefill_replay`` (eager, staged by the table)."""
    decoder_replay: bool
    """True when decoder SWA bounded replay cuts rows in this step (the spec's rule is on and the
    step holds a prefill request)."""

    # --- per token [running_tokens] ---
    positions: np.ndarray
    """int64 absolute position of each row; 0 for padding."""
    batch_ids: np.ndarray
    """int32 request row of each row; -1 for padding."""
    visible: dict[int, np.ndarray] = field(hash=False, compare=False)
    """ratio -> int64 compressed rows visible to each row, ``(pos + 1) // ratio``; 0 for padding."""

    # --- per request [running_bs] ---
    cu_seqlens_q: np.ndarray = field(compare=False)
    """int32 [running_bs + 1] row offsets; padding requests are zero length."""
    slots: np.ndarray = field(compare=False)
    """int32 STATE slot of each request; -1 for padding."""
    block_tables: np.ndarray = field(compare=False)
    """int32 [running_bs, block_table_width] PAGE ids; -1 past a request's table and for padding."""
    is_final_chunk: np.ndarray = field(compare=False)
    """bool: the forward ends the prompt (prefill) or is a decode step; the request samples."""
    is_decode: np.ndarray = field(compare=False)
    """bool: the request is in its decode phase."""
    prompt_lens: np.ndarray = field(compare=False)
    """int64 prompt length; 0 for padding."""
    resume_points: np.ndarray = field(compare=False)
    """int64 where the scheduler resumed (input ``start``); 0 for padding."""
    prefix_hits: np.ndarray = field(compare=False)
    """int64 reported prefix hit (unchanged by replay); 0 for padding."""
    forward_start: np.ndarray = field(compare=False)
    """int64 first position the forward computes (after ``replay_start``); the cursor steps back
    to it. 0 for padding."""
    forward_end: np.ndarray = field(compare=False)
    """int64 one past the forward's last position (``start + chunk_len``); 0 for padding."""
    write_from: np.ndarray = field(compare=False)
    """int64 compressed groups ending below it are not written (the resume point / hit)."""
    cached_until: np.ndarray = field(compare=False)
    """int64 ring writes skip rows below it (the slot's rings keep the rows they hold)."""
    swa_cached_until: np.ndarray = field(compare=False)
    """int64 rows at or past it read the slot's ring rows below it; rows below it read only this
    forward's rows from ``forward_start`` on."""
    swa_replay_start: np.ndarray = field(compare=False)
    """int64 decoder window floor: a decoder row at ``i`` reads ``[max(s, i - W + 1), i]``. The tail
    start on a replayed final forward, ``encoder_window_floor`` otherwise; 0 in decode."""
    encoder_window_floor: np.ndarray = field(compare=False)
    """int64 encoder window floor: ``forward_start`` on an encoder-replay rebuild, else 0."""
    tail_start: np.ndarray = field(compare=False)
    """int64 first position of the tail ``max(forward_start, forward_end - W)`` on a replayed final
    forward; -1 when the request has no tail (non-final, decode, replay off, padding)."""
    last_rows: np.ndarray = field(compare=False)
    """int32 flat row of each request's last row (LM head / last layer's query); -1 for padding."""
    history_ids: np.ndarray = field(compare=False)
    """int64 [running_bs, replay_history_tokens] Engram history before ``forward_start``, oldest
    first (newest last); -1 for DEAD/missing positions."""
    history_from_plan: np.ndarray = field(compare=False)
    """bool: the forward starts below the slot's cursor or in a fresh slot, so the Engram history
    comes from ``history_ids`` instead of the cursor."""

    # --- gathers and row sets ---
    tail_rows: np.ndarray = field(compare=False)
    """int32 flat rows of every tail (the QueryRows: one gather for all requests), request order.
    A request without a tail contributes its whole forward when its rows run everything."""
    tail_batch_ids: np.ndarray = field(compare=False)
    """int32 request row of each ``tail_rows`` entry."""
    layer_rows: dict[tuple[int, str], np.ndarray] = field(compare=False)
    """(layer, sub_step) -> int32 sorted flat rows running it (empty arrays for none)."""
    stages: tuple[StageRows, ...]
    """Graph stages in layer order, with their rows."""
    compress: dict[int, CompressPlan] = field(compare=False)
    """ratio -> the groups of that ratio closing (and written) in this forward."""


class PlanError(ValueError):
    """An invalid step description (bad numbers, overlapping widths); the message says which."""


def plan_step(
    step: StepInput,
    spec,
    *,
    decoder_replay: bool | None = None,
    encoder_replay: bool | None = None,
    table=None,
) -> StepPlan:
    """Plan one forward of ``step`` under ``spec`` (a ``CacheSpec``).

    ``decoder_replay``/``encoder_replay`` override the spec's replay rules (the runtime flags);
    ``table`` is a ``StageTable`` to use instead of the generated one.
    """
    raise NotImplementedError("plan_step is being written")
