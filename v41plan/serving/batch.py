"""What the scheduler hands a model runner, and what the runner gives back.

A ``ScheduledBatch`` is prefill-only or decode-only. Each ``ScheduledRequest`` names the rows
its forward runs, ``[start, end)``, and where its cached rows end (``resume``): rows below
``resume`` are recomputed without writing what the cache holds (``write_from``), and under
the same slot they read the rings below ``resume`` (``swa_cached_until``). ``fresh_slot`` says the
slot's state is rebuilt from ``start`` (a position-0 reset at ``start == 0``, an encoder replay
with windows starting at ``start`` otherwise). The runner performs ``stores`` then
``restores`` before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from v41plan.serving.block_manager import RestoreOp, StoreOp


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's span in a batch."""

    seq_id: int
    slot: int
    block_table: tuple[int, ...]
    """PAGE ids covering at least ``[0, end)``."""
    token_ids: tuple[int, ...]
    """All token ids of the request up to ``end`` (the forward reads ``[start, end)``)."""
    start: int
    """First position the forward runs (after any back-off)."""
    resume: int
    """Where the cached rows end: rows ``[start, resume)`` are recomputed, not rewritten."""
    end: int
    """One past the last position the forward runs."""
    prompt_len: int
    """Tokens this admission prefills (prompt plus re-forwarded output after a preemption)."""
    prefix_hit: int
    """Reported prefix hit (tokens, on the hash-block grid) of this admission; 0 if none."""
    fresh_slot: bool
    """The slot's state is rebuilt from ``start`` rather than continued."""
    is_final_chunk: bool
    """The forward finishes the prefill (or is a decode): its last row is sampled."""
    all_logits: bool = False
    """Return logits of every row (prompt scoring; decoder replay off)."""

    @property
    def chunk_len(self) -> int:
        """Rows the forward runs."""
        return self.end - self.start

    @property
    def replay_rows(self) -> int:
        """Rows recomputed below the resume point."""
        return self.resume - self.start


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: a prefill-only or decode-only ragged batch plus the state copies before it."""

    step: int
    phase: str
    """``prefill`` or ``decode``."""
    requests: tuple[ScheduledRequest, ...]
    stores: tuple[StoreOp, ...] = ()
    restores: tuple[RestoreOp, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Rows of the whole batch."""
        return sum(r.chunk_len for r in self.requests)


@dataclass
class RunnerOutput:
    """Logits of each sampled request's last row, and every row where asked."""

    last_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """seq_id -> ``[vocab]`` float logits of the last row (final chunks and decodes)."""
    row_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """seq_id -> ``[rows, vocab]`` logits of every row (``all_logits`` requests)."""


def to_step_input(
    batch: ScheduledBatch,
    compress=None,
    running_bs: int | None = None,
    running_tokens: int | None = None,
):
    """The planner's ``StepInput`` for ``batch``.

    ``compress`` maps raw token ids to Engram-compressed ids (``EngramHost.compress``); without
    it the raw ids are passed. ``start`` is the resume point: ``plan_step`` applies the same
    back-off the scheduler counted (``choose_prefill_chunk``), which ``check_plan`` asserts.
    """
    import numpy as np

    from v41plan.planner.step import RequestInput, StepInput

    reqs = []
    decode = batch.phase == "decode"
    for r in batch.requests:
        ids = None
        if not decode:  # only a prefill can back off below the cursor and read plan history
            ids = np.asarray(r.token_ids[: r.end], dtype=np.int64)
            if compress is not None:
                ids = np.asarray(compress(ids), dtype=np.int64)
        reqs.append(
            RequestInput(
                slot=r.slot,
                block_table=tuple(r.block_table),
                prompt_len=r.prompt_len,
                start=r.resume,
                chunk_len=r.end - r.resume,
                phase="decode" if decode else "prefill",
                prefix_hit=r.prefix_hit,
                fresh_slot=r.fresh_slot,
                token_ids=ids,
                full_rows=r.all_logits,
            )
        )
    return StepInput(tuple(reqs), running_bs=running_bs, running_tokens=running_tokens)


def check_plan(batch: ScheduledBatch, plan) -> None:
    """Raise if the planner's forward starts differ from the scheduler's (a contract check)."""
    starts = [int(x) for x in plan.forward_start[: plan.scheduled_bs]]
    want = [r.start for r in batch.requests]
    if starts != want:
        raise RuntimeError(f"step {batch.step}: planner starts {starts} != scheduler starts {want}")


class ModelRunner(Protocol):
    """Executes one scheduled batch: stores, restores, then the forward."""

    vocab_size: int

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run ``batch`` and return the logits the scheduler samples from."""
        ...
