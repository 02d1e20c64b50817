"""A deterministic stand-in for the model runner, for scheduler tests and fuzzing.

It keeps real bookkeeping in place of tensors: each PAGE row holds the token id a forward
wrote there, each STATE slot holds a cursor position and a window ring of the last ``window``
(position, token) rows, and checkpoint images are split across the PAGE units a store names.
A forward checks everything a wrong schedule would get wrong: a continued slot must sit at the
resume point, recomputed rows must already be in the pages the block table names, reads of
unwritten rows and restores of overwritten units raise. Logits of a row are a pseudo-random
vector seeded by a digest of every token read through the block table, the ring and the
position, so a wrong restore, replay or page shows up as different tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from v41plan.serving.batch import RunnerOutput, ScheduledBatch, ScheduledRequest, SlotTables


@dataclass(frozen=True)
class FakeState:
    """One STATE entry: the committed position and the window ring."""

    position: int
    ring: tuple[tuple[int, int], ...]


class FakeRunner:
    """Executes scheduled batches over host-side pages and slots."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_tokens: int,
        num_slots: int,
        vocab_size: int,
        window: int,
        plan_spec=None,
        encoder_replay: bool = True,
        decoder_replay: bool = True,
        max_pages: int = 512,
    ) -> None:
        self.page_tokens = page_tokens
        self.vocab_size = vocab_size
        self.window = window
        self.kv: list[list[int]] = [[-1] * page_tokens for _ in range(num_pages)]
        self.unit_payload: dict[int, tuple[int, int, FakeState]] = {}
        self.slots: list[FakeState | None] = [None] * num_slots
        self.forwards = 0
        self.rows = 0
        self.stores = 0
        self.restores = 0
        self._image_serial = 0
        # With a spec, every batch is also planned by ``plan_step`` and its starts checked.
        self.plan_spec = plan_spec
        self.tables = SlotTables(num_slots, max_pages)
        """Each slot's token ids and block table, from the batches' deltas (as the real runner)."""
        self.flags = {"encoder_replay": encoder_replay, "decoder_replay": decoder_replay}
        self.plans = 0
        self.pending_rows = 0
        """Decode rows that read a token the previous launch sampled."""
        self._params: dict = {}  # slot -> (params, seed, prompt length), from reset deltas
        self._sampled: dict[int, int] = {}  # the last launch's tokens by request

    # ---- state copies --------------------------------------------------------------------
    def _store(self, op) -> None:
        state = self.slots[op.slot]
        if state is None or state.position != op.position:
            found = None if state is None else state.position
            raise RuntimeError(
                f"store of slot {op.slot} expects position {op.position}, found {found}"
            )
        self._image_serial += 1
        for i, u in enumerate(op.units):
            self.kv[u] = [-1] * self.page_tokens
            self.unit_payload[u] = (self._image_serial, i, state)
        self.stores += 1

    def _restore(self, op) -> None:
        parts = [self.unit_payload.get(u) for u in op.units]
        if (
            any(p is None for p in parts)
            or len({p[0] for p in parts}) != 1
            or [p[1] for p in parts] != list(range(len(parts)))
        ):
            raise RuntimeError(
                f"restore into slot {op.slot} reads units {op.units} that hold no intact image"
            )
        state = parts[0][2]
        if state.position != op.position:
            raise RuntimeError(f"image at {state.position} restored as {op.position}")
        self.slots[op.slot] = state
        self.restores += 1

    # ---- forward -------------------------------------------------------------------------
    def _page_row(self, req: ScheduledRequest, pos: int) -> tuple[int, int]:
        b = pos // self.page_tokens
        if b >= self.tables.num_blocks[req.slot]:
            raise RuntimeError(f"request {req.seq_id}: position {pos} beyond its block table")
        return int(self.tables.blocks[req.slot, b]), pos % self.page_tokens

    def _logits(self, req: ScheduledRequest, pos: int, ring: tuple) -> torch.Tensor:
        h = hashlib.sha256()
        for p in range(pos + 1):
            page, row = self._page_row(req, p)
            t = self.kv[page][row]
            if t < 0:
                raise RuntimeError(f"request {req.seq_id} reads unwritten KV at position {p}")
            h.update(t.to_bytes(4, "little"))
        h.update(repr(ring).encode())
        seed = int.from_bytes(h.digest()[:8], "little") & (2**62 - 1)
        return torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed))

    def _forward(
        self, req: ScheduledRequest, out: RunnerOutput, pending: int | None = None
    ) -> None:
        if req.fresh_slot:
            ring: tuple = ()
        else:
            state = self.slots[req.slot]
            found = None if state is None else state.position
            if found != req.resume:
                raise RuntimeError(
                    f"request {req.seq_id} needs state at {req.resume}, found {found} in slot "
                    f"{req.slot}"
                )
            ring = state.ring
        rows = []
        if pending is None:
            tokens = self.tables.tokens(req.slot, 0, req.end)
        else:  # a decode row's token the previous launch sampled (the device's hand-off)
            tokens = [*self.tables.tokens(req.slot, 0, req.end - 1).tolist(), pending]
        for pos in range(req.start, req.end):
            token = int(tokens[pos])
            page, row = self._page_row(req, pos)
            if pos < req.resume:
                if self.kv[page][row] != token:
                    raise RuntimeError(
                        f"request {req.seq_id}: recomputed row {pos} not in its cached page"
                    )
            else:
                self.kv[page][row] = token
                self.unit_payload.pop(page, None)
            if req.fresh_slot or pos >= req.resume:
                ring = (ring + ((pos, token),))[-self.window :]
            if req.all_logits:
                rows.append(self._logits(req, pos, ring))
        self.slots[req.slot] = FakeState(req.end, ring)
        if req.all_logits:
            out.row_logits[req.seq_id] = torch.stack(rows)
        if req.is_final_chunk:
            out.last_logits[req.seq_id] = self._logits(req, req.end - 1, ring)

    def _apply(self, batch: ScheduledBatch) -> None:
        """The batch's deltas into the slot tables; each new request's sampling record."""
        from v41plan.serving.sampling import SamplingParams

        for d in batch.deltas:
            if d.reset:
                self._params[d.slot] = (d.params or SamplingParams(), d.seed, d.num_prompt_tokens)
        self.tables.apply(batch)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Stores, restores, then every request's forward."""
        self._apply(batch)
        self._sampled = {}  # (nothing launched feeds the next batch)
        return self._run(batch, {})

    def _run(self, batch: ScheduledBatch, pending: dict[int, int]) -> RunnerOutput:
        """The batch's plan check, stores, restores and forwards (``pending``: the tokens of
        decode rows the slot tables lack, by request)."""
        if self.plan_spec is not None and batch.requests:
            from v41plan.planner.step import plan_step
            from v41plan.serving.batch import check_plan, to_step_input

            step = to_step_input(batch, self.tables)
            check_plan(batch, plan_step(step, self.plan_spec, **self.flags))
            self.plans += 1
        for op in batch.stores:
            self._store(op)
        for op in batch.restores:
            self._restore(op)
        out = RunnerOutput()
        for req in batch.requests:
            self._forward(req, out, pending.get(req.seq_id))
            self.rows += req.chunk_len
        self.forwards += 1
        return out

    # ---- overlapped stepping (the engine's ``async_scheduling``) ---------------------------
    def launch(self, batch: ScheduledBatch):
        """``execute``, with each sampled row's token drawn here (as a device sampler does)
        and kept for the next launch: a decode row whose token its slot tables lack takes it
        from there, as the paged runner's device hand-off does."""
        from v41plan.serving.sampling import sample

        self._apply(batch)
        prev, self._sampled = self._sampled, {}
        pending = {}
        for req in batch.requests:
            if req.is_decode and self.tables.num_tokens[req.slot] == req.start:
                if req.seq_id not in prev:
                    raise RuntimeError(f"request {req.seq_id}: no launch sampled its token")
                pending[req.seq_id] = prev[req.seq_id]
        self.pending_rows += len(pending)
        out = self._run(batch, pending)
        rows = batch.requests
        tokens = np.full(len(rows), -1, dtype=np.int64)
        for i, req in enumerate(rows):
            logits = out.last_logits.pop(req.seq_id, None)
            if logits is None:
                continue
            params, seed, n_prompt = self._params[req.slot]
            held = int(self.tables.num_tokens[req.slot]) + (req.seq_id in pending)
            tokens[i] = sample(logits, params, seed, held - n_prompt)
            self._sampled[req.seq_id] = int(tokens[i])
        out.set_rows(rows.seq_id, tokens, np.zeros(len(rows)))
        return _FakeLaunched(batch, out)

    def collect(self, launched) -> RunnerOutput:
        """The launch's results (computed at launch: nothing runs behind the host here)."""
        return launched.out

    def can_overlap(self, launched) -> bool:
        """A decode batch may stay in flight."""
        return launched.batch.phase == "decode" and len(launched.batch.requests) > 0


@dataclass
class _FakeLaunched:
    batch: ScheduledBatch
    out: RunnerOutput
