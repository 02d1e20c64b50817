"""Continuous-batching scheduler: chunked prefill, decode, prefix reuse, preemption, cancellation.

A step mixes decode and prefill under one token budget: every running request past its
prefill decodes one row (phase 0, first, so no decoding request stalls behind a long prefill),
then partial prefills resume (phase 1) and waiting requests are admitted in order (phase 2)
with what the budget has left. A step whose requests all decode is a ``decode`` batch (the
shape CUDA graphs capture). Where a forward starts:

- a fresh admission with a prefix hit ``h`` under the ``replay`` transfer starts at
  ``grid_back_off(h)`` in a fresh slot (encoder bounded replay rebuilds the windows);
- under ``copy`` the hit is gated to the largest boundary with a READY image, restored into a
  fresh slot before the forward; no image means recompute from a recoverable boundary;
- with decoder bounded replay, a prefill forward that resumes fewer than
  ``min_final_prefill_rows`` rows before the prompt's end starts at ``grid_back_off(resume)``
  keeping its slot (the cursor steps back; cached rows are recomputed, not rewritten); the
  decision is on the resume point, so a chunk the budget cuts short backs off too (and the next
  pass backs off again: the specification's wait rule makes such a chunk rare).

The long-prefill cap counts from the resume point; a forward the budget cannot carry past its
resume point waits for a step that can. A cancelled request finishes with reason ``aborted``
and frees its pages and slot wherever it is: at the top of ``postprocess`` for every running
request whether or not the batch gave it a row (a middle chunk, a deferred step, a final chunk
whose token is not delivered yet), and at the next ``schedule`` for waiting or idle ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from v41plan.planner.replay import choose_prefill_chunk, grid_back_off
from v41plan.serving.batch import (
    KVLoad,
    KVSave,
    RequestColumns,
    RunnerOutput,
    ScheduledBatch,
    ScheduledRequest,
    SlotDelta,
)
from v41plan.serving.block_manager import READY, BlockManager
from v41plan.serving.decode_rows import DecodeRows
from v41plan.serving.sampling import sample, token_logprobs
from v41plan.serving.sequence import SeqStatus, Sequence


class Queue(deque):
    """A request queue that counts its changes (``version``), so what is derived from its order
    (the decode rows' order) is rebuilt only after one, whoever made it."""

    version = 0


def _counted(base):
    def method(self, *args):
        self.version += 1
        return base(self, *args)

    method.__name__, method.__doc__ = base.__name__, base.__doc__
    return method


_CHANGES = ("append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove")
for _name in (*_CHANGES, "clear", "reverse", "rotate", "__setitem__", "__delitem__", "__iadd__"):
    setattr(Queue, _name, _counted(getattr(deque, _name)))


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling knobs (engine option names)."""

    page_tokens: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int = 0
    max_model_len: int = 4096
    encoder_swa_bounded_replay: bool = True
    """``replay`` state transfer (True) or ``copy`` with checkpoint images (False)."""
    decoder_swa_bounded_replay: bool = True
    min_final_prefill_rows: int = 8
    eos_token_id: int | None = None
    enable_prefix_caching: bool = True
    speculative_tokens: int = 0
    """DSpark: a decode row runs its anchor and this many drafted positions (0: one row)."""

    @property
    def transfer(self) -> str:
        """The state transfer the block manager runs."""
        return "replay" if self.encoder_swa_bounded_replay else "copy"


class Scheduler:
    """Owns the waiting and running queues and turns them into batches."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, connector=None
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.connector = connector
        """A ``kv_connector.KVConnector`` under the device prefix cache, or None."""
        self._kv_saves: list[KVSave] = []  # offers for the next batch
        self._kv_loads: list[KVLoad] = []
        self._image_tokens: dict[bytes, tuple[int, ...]] = {}  # queued images' token ids
        self.waiting: deque[Sequence] = deque()
        self.running: Queue = Queue()
        self.finished: list[Sequence] = []
        self.step_count = 0
        self.events: list[dict] = []
        self._freed: list[int] = []  # slots freed since the last batch (the runner clears them)
        self.rows = DecodeRows(block_manager.num_slots)
        """The running requests past their prefill, as columns per slot."""
        self._owner: list[Sequence | None] = [None] * block_manager.num_slots
        """The running request holding each slot."""
        self._order: tuple[list[Sequence], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
        self._order_version = (0, 0)  # (``rows.version``, ``running.version``) of ``_order``
        # abort() calls so far and those the last scans saw: no scan of every request per step
        self._aborts = self._aborts_seen = 0
        # the last batch's step, decode rows and ``rows.version`` after scheduling it
        self._scheduled: tuple[int, list[Sequence], int] = (0, [], -1)

    # ---- queue API -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a validated request."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel a request; it finishes with reason ``aborted`` at the next
        schedule/postprocess."""
        if not seq.is_finished:
            seq.aborted = True
            self._aborts += 1

    def kv_waiting(self) -> bool:
        """A waiting request's KV connector retrieve is still running (a step may then have
        nothing to run and still make progress later)."""
        return any(s.kv_prefetch is not None for s in self.waiting)

    def is_finished(self) -> bool:
        """No request waiting or running."""
        return not self.waiting and not self.running

    def preempt(self, seq: Sequence) -> None:
        """Free a running request's pages and slot and re-queue it first.

        It resumes through the prefix cache: blocks its forwards published stay cached.
        """
        self._drop_running([seq])
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_cached_tokens = 0
        seq.fresh_start = None
        seq.prompt_logprobs.clear()  # a scoring request re-scores from position 0
        seq.prompt_greedy.clear()
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- helpers ---------------------------------------------------------------------------
    def _drop_running(self, seqs: list[Sequence]) -> None:
        """Remove ``seqs`` from the running queue (by identity: ``deque.remove`` compares
        dataclasses field by field, a cost per request passed)."""
        gone = {id(s) for s in seqs}
        kept = [s for s in self.running if id(s) not in gone]
        if len(kept) != len(self.running):
            self.running.clear()
            self.running.extend(kept)

    def _free(self, seq: Sequence) -> None:
        self._drop_prefetch(seq)
        self.bm.free(seq.block_table)
        if seq.slot is not None:
            self.rows.unload(seq)
            self._owner[seq.slot] = None
            self.bm.free_slot(seq.slot)
            self._freed.append(seq.slot)
            seq.slot = None
        seq.synced_tokens = seq.synced_blocks = 0

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.config.page_tokens)

    def _chunk(self, seq: Sequence, resume: int, fresh_start: int | None, budget: int):
        """``(start, end)`` of the next forward, or None when it waits for a later step.

        The back-off and the cap/budget rules are the planner's (``choose_prefill_chunk``), so the
        rows counted here are the rows ``plan_step`` lays out.
        """
        cfg = self.config
        choice = choose_prefill_chunk(
            resume, seq.prefill_end, budget,
            hash_block=cfg.page_tokens,
            min_final_rows=cfg.min_final_prefill_rows,
            long_prefill_cap=cfg.long_prefill_token_threshold or None,
            fresh_slot=fresh_start is not None,
            encoder_replay=cfg.encoder_swa_bounded_replay,
            decoder_replay=cfg.decoder_swa_bounded_replay and not seq.params.prompt_logprobs,
        )  # fmt: skip
        if choice is None:
            return None
        start, end = choice.forward_start, resume + choice.chunk_len
        if not choice.is_final_chunk and cfg.transfer == "copy":
            # Non-final chunks end on the hash-block grid so an image exists to resume from.
            grid = end - end % cfg.page_tokens
            if grid > resume:
                end = grid
        return start, end

    def _request(self, seq: Sequence, start: int, end: int) -> ScheduledRequest:
        fresh = seq.fresh_start is not None
        return ScheduledRequest(
            seq_id=seq.seq_id,
            slot=seq.slot,
            start=start,
            resume=seq.num_cached_tokens,
            end=end,
            prompt_len=seq.prefill_end,
            prefix_hit=seq.hits[-1] if seq.hits else 0,
            fresh_slot=fresh,
            is_final_chunk=end >= seq.prefill_end,
            all_logits=seq.params.prompt_logprobs,
        )

    def _unschedulable(self, seq: Sequence) -> str | None:
        cfg = self.config
        if seq.num_tokens >= cfg.max_model_len:
            return f"unschedulable: {seq.num_tokens} tokens reach max_model_len={cfg.max_model_len}"
        if self._pages_for(seq.num_tokens + 1 + cfg.speculative_tokens) > self.bm.num_pages:
            return f"unschedulable: needs more than the {self.bm.num_pages} PAGEs of the pool"
        return None

    # ---- schedule --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch, or None when nothing can run."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        restores = []
        # Requests cancelled between steps finish here, wherever they wait.
        if self._aborts != self._aborts_seen:
            self._aborts_seen = self._aborts
            gone = [s for s in self.running if s.aborted]
            self._drop_running(gone)
            for seq in gone:
                self._finish(seq, "aborted")
            for seq in [s for s in self.waiting if s.aborted]:
                self.waiting.remove(seq)
                self._finish(seq, "aborted")
        # Phase 0: every running request past its prefill decodes one row.
        decode, members = self._schedule_decode(budget)
        budget -= len(members) * (1 + cfg.speculative_tokens)
        reqs: list[ScheduledRequest] = []  # the prefill chunks, one object each
        seqs: list[Sequence] = []
        # Phase 1: partial prefills already running, in queue order (running requests are
        # decode rows or prefilling: none prefills when every one has a row).
        prefilling = (
            [s for s in self.running if s.num_cached_tokens < s.prefill_end]
            if len(self.running) != len(self._members()[0])
            else []
        )
        for seq in prefilling:
            if seq.aborted:
                continue
            span = self._chunk(seq, seq.num_cached_tokens, None, budget)
            if span is None:
                continue
            reqs.append(self._request(seq, *span))
            seqs.append(seq)
            seq.starts.append(span[0])
            budget -= span[1] - span[0]
        # Phase 2: admit waiting requests in order.
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.aborted:
                self.waiting.popleft()
                self._finish(seq, "aborted")
                continue
            reason = self._unschedulable(seq)
            if reason is not None:
                self.waiting.popleft()
                seq.error = reason
                self._finish(seq, "error")
                continue
            if len(self.running) >= cfg.max_num_seqs or not self.bm.free_slots:
                break
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            req, restore = admitted
            self.waiting.popleft()
            self.running.append(seq)
            reqs.append(req)
            seqs.append(seq)
            if restore is not None:
                restores.append(restore)
            budget -= req.chunk_len
        if not members and not reqs:
            if self.bm.pending_stores or self._freed or self._kv_saves:
                # Nothing to run, but queued image stores (or freed slots) still need a batch.
                return self._batch("decode", decode, [], [], [], [])
            return None
        phase = "prefill" if reqs else "decode"
        return self._batch(phase, decode, members, reqs, restores, seqs)

    def _deltas(self, slots: np.ndarray, members: list[Sequence], seqs: list[Sequence]):
        """What each scheduled request's slot gained since the runner last saw it: a
        ``SlotDelta`` for a slot a request took or grew pages in, the columnar appends for the
        common case of one new token and nothing else. ``slots``/``members`` are the decode
        rows (their sync state is the rows'), ``seqs`` the prefill requests."""
        R = self.rows
        nt, st = R.num_tokens[slots], R.synced_tokens[slots]
        nb, sb = R.num_blocks[slots], R.synced_blocks[slots]
        append = (nb == sb) & (nt == st + 1)
        a_slots = slots[append]
        a_tokens = R.last_token[a_slots]
        out = []
        for i in np.flatnonzero(~append).tolist():  # a new page, or no new token
            seq, t0, b0 = members[i], int(st[i]), int(sb[i])
            if t0 == nt[i] and b0 == nb[i]:
                continue
            out.append(self._delta(seq, False, t0, b0))
        R.synced_tokens[slots], R.synced_blocks[slots] = nt, nb
        a_slots, a_tokens = [a_slots], [a_tokens]
        for seq in seqs:
            reset = seq.needs_reset
            t0 = 0 if reset else seq.synced_tokens
            b0 = 0 if reset else seq.synced_blocks
            n_tok, n_blk = len(seq.token_ids), len(seq.block_table)
            if not reset and b0 == n_blk:
                if t0 == n_tok:
                    continue
                if t0 + 1 == n_tok:
                    a_slots.append(np.array([seq.slot], dtype=np.int64))
                    a_tokens.append(np.array([seq.token_ids[t0]], dtype=np.int64))
                    seq.synced_tokens = n_tok
                    continue
            out.append(self._delta(seq, reset, t0, b0))
            seq.synced_tokens, seq.synced_blocks, seq.needs_reset = n_tok, n_blk, False
        if len(a_slots) > 1:
            return tuple(out), np.concatenate(a_slots), np.concatenate(a_tokens)
        return tuple(out), a_slots[0], a_tokens[0]

    @staticmethod
    def _delta(seq: Sequence, reset: bool, t0: int, b0: int) -> SlotDelta:
        return SlotDelta(
            slot=seq.slot,
            reset=reset,
            tokens_from=t0,
            new_tokens=np.asarray(seq.token_ids[t0:], dtype=np.int64),
            blocks_from=b0,
            new_blocks=np.asarray(seq.block_table[b0:], dtype=np.int32),
            params=seq.params if reset else None,
            seed=seq.seed,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def _batch(
        self,
        phase: str,
        decode: RequestColumns,
        members: list[Sequence],
        reqs: list[ScheduledRequest],
        restores,
        seqs: list[Sequence],
    ) -> ScheduledBatch:
        self.step_count += 1
        self._scheduled = (self.step_count, members, self.rows.version)
        deltas, a_slots, a_tokens = self._deltas(decode.slot, members, seqs)
        rows = (
            RequestColumns.concat([decode, RequestColumns.from_requests(reqs)]) if reqs else decode
        )
        batch = ScheduledBatch(
            step=self.step_count,
            phase=phase,
            requests=rows,
            stores=tuple(self.bm.take_stores()),
            restores=tuple(restores),
            kv_saves=tuple(self._kv_saves),
            kv_loads=tuple(self._kv_loads),
            deltas=deltas,
            freed_slots=tuple(self._freed),
            append_slots=a_slots,
            append_tokens=a_tokens,
        )
        self._freed = []
        self._kv_saves, self._kv_loads = [], []
        self.events.append(
            {
                "step": batch.step,
                "phase": phase,
                "ids": rows.seq_id.tolist(),
                "slots": rows.slot.tolist(),
                "starts": rows.start.tolist(),
                "resumes": rows.resume.tolist(),
                "ends": rows.end.tolist(),
                "replay_rows": int(rows.resume.sum() - rows.start.sum()),
                "stores": len(batch.stores),
                "restores": len(batch.restores),
            }
        )
        return batch

    def _admit(self, seq: Sequence, budget: int):
        """Look up the prefix, size the first chunk and allocate; None when it must wait."""
        cfg, bm = self.config, self.bm
        n = seq.num_tokens
        max_hit_blocks = (
            n - 1
        ) // cfg.page_tokens  # the block holding the last token is never reused
        hashes = seq.hashes(cfg.page_tokens, max_hit_blocks)
        hit_pages: list[int] = []
        caching = cfg.enable_prefix_caching and not seq.params.prompt_logprobs
        if caching:
            hit_pages = bm.lookup(hashes)
        device_blocks = len(hit_pages)
        # Blocks ``[device_blocks, hit_blocks)`` and (copy) the image come from the connector.
        fetch = self._connector_hit(seq, hashes, device_blocks) if caching else None
        if fetch == "wait":
            return None
        hit_blocks, image_from_connector = device_blocks, False
        if fetch is not None:
            hit_blocks, image_from_connector = fetch
        elif cfg.transfer == "copy":
            gated = bm.resumable(hashes, hit_blocks)
            if gated < hit_blocks:
                bm.stats.hits_gated += 1
            hit_blocks = gated
        hit_pages = hit_pages[: min(hit_blocks, device_blocks)]
        loaded = hit_blocks - len(hit_pages)
        hit = hit_blocks * cfg.page_tokens
        fresh_start = None
        if hit == 0:
            fresh_start = 0
        elif cfg.transfer == "replay":
            fresh_start = grid_back_off(hit, cfg.page_tokens)
        seq.prefill_end = n
        seq.num_cached_tokens = hit
        span = self._chunk(seq, hit, fresh_start, budget)
        num_new = self._pages_for(n) - len(hit_pages)
        reclaim = sum(1 for p in hit_pages if bm.ref[p] == 0)
        if cfg.transfer == "copy" and hit > 0:
            if image_from_connector:
                reclaim += bm.units_per_image  # the image's fresh units
            else:
                im = bm.images[hashes[hit_blocks - 1]]
                reclaim += len(im.units) if im.pins == 0 else 0
        if span is None or bm.allocatable_pages() - reclaim < num_new:
            seq.num_cached_tokens = 0
            return None
        handle = seq.kv_prefetch
        seq.slot = bm.take_slot()
        self._owner[seq.slot] = seq
        seq.needs_reset = True  # the runner gets the slot's whole content with this batch
        restore = None
        if cfg.transfer == "copy" and hit > 0:
            key = hashes[hit_blocks - 1]
            if image_from_connector:
                im = bm.add_loaded_image(key, hit)
                self._kv_loads.append(KVLoad(tuple(im.units), handle.image, image=True))
            # Pin the image before allocating, so allocation cannot evict it.
            restore = bm.begin_restore(key, seq.slot)
            seq.restores += 1
        seq.block_table = bm.allocate(hit_pages, num_new)
        if loaded:
            pages = seq.block_table[len(hit_pages) : hit_blocks]
            self._kv_loads.append(KVLoad(tuple(pages), handle.units[:loaded]))
            for b, page in enumerate(pages, start=len(hit_pages)):
                bm.publish(hashes[b], page)
        self._drop_prefetch(seq)
        seq.kv_loaded_blocks = loaded
        seq.status = SeqStatus.RUNNING
        seq.fresh_start = fresh_start
        seq.num_published_blocks = hit_blocks
        seq.hits.append(hit)
        seq.starts.append(span[0])
        bm.stats.hits_tokens += hit
        return self._request(seq, *span), restore

    def _connector_hit(self, seq: Sequence, hashes: list[bytes], device_blocks: int):
        """``(hit_blocks, image_from_connector)`` when the connector extends the device hit (its
        retrieve finished), ``"wait"`` while it runs, None to use the device hit alone."""
        conn, cfg, bm = self.connector, self.config, self.bm
        if conn is None:
            return None
        handle = seq.kv_prefetch
        if handle is not None:
            if not conn.ready(handle):
                return "wait"
            if handle.failed is not None or handle.extra.get("first") != device_blocks:
                # a failed retrieve recomputes; a device hit that moved meanwhile asks again
                failed = handle.failed is not None
                self._drop_prefetch(seq)
                if failed:
                    return None
            elif (
                handle.image is None
                and cfg.transfer == "copy"
                and not self._device_image(hashes[handle.extra["hit_blocks"] - 1])
            ):
                self._drop_prefetch(seq)  # the device image it counted on was evicted: ask again
            else:
                return handle.extra["hit_blocks"], handle.image is not None
        tokens = seq.token_ids
        stored = device_blocks + conn.lookup(tokens, hashes, device_blocks)
        hit_blocks, image_block = stored, None
        if cfg.transfer == "copy":
            hit_blocks = 0
            for L in range(stored, 0, -1):
                if self._device_image(hashes[L - 1]):
                    hit_blocks = L
                    break
                if hashes[L - 1] not in bm.images and conn.has_image(tokens, hashes[L - 1]):
                    hit_blocks, image_block = L, L - 1
                    break
            device_gate = bm.resumable(hashes, device_blocks)
            if hit_blocks <= device_gate:  # the device alone resumes as far
                return None
        elif stored <= device_blocks:
            return None
        count = max(0, hit_blocks - device_blocks)
        handle = conn.prefetch(tokens, hashes, device_blocks, count, image_block)
        handle.extra.update(first=device_blocks, hit_blocks=hit_blocks)
        seq.kv_prefetch = handle
        if not conn.ready(handle):
            return "wait"
        if handle.failed is not None:
            self._drop_prefetch(seq)
            return None
        return hit_blocks, handle.image is not None

    def _device_image(self, key: bytes) -> bool:
        im = self.bm.images.get(key)
        return im is not None and im.state == READY

    def _drop_prefetch(self, seq: Sequence) -> None:
        if seq.kv_prefetch is not None:
            self.connector.end_request(seq.kv_prefetch)
            seq.kv_prefetch = None

    def _members(self) -> tuple[list[Sequence], np.ndarray]:
        """The requests with a decode row and their slots, in queue order (rebuilt only after a
        row was loaded or unloaded or the queue changed)."""
        rows = self.rows
        version = (rows.version, self.running.version)
        if self._order_version != version:
            owner = rows.seq
            members = [s for s in self.running if owner[s.slot] is s]
            slots = np.fromiter((s.slot for s in members), np.int64, len(members))
            self._order, self._order_version = (members, slots), version
        return self._order

    def _schedule_decode(self, budget: int) -> tuple[RequestColumns, list[Sequence]]:
        """One decode row for every running request past its prefill, in queue order, as
        columns; a request that needs a page when none is left preempts the newest others (or
        itself). Returns the rows and their requests."""
        members, slots = self._members()
        R, P = self.rows, self.config.page_tokens
        k = self.config.speculative_tokens
        budget //= 1 + k  # rows: a speculative row runs 1 + k positions
        pos = R.pos[slots]
        need = ((pos + k) // P) >= R.num_blocks[slots]
        if len(members) > budget or need.any():
            keep = self._take_pages(members, slots, need, budget)
            members = [s for s, k in zip(members, keep.tolist(), strict=True) if k]
            slots, pos = slots[keep], pos[keep]
        return self._decode_columns(slots, pos), members

    def _decode_columns(self, slots: np.ndarray, pos: np.ndarray) -> RequestColumns:
        """The decode rows of ``slots`` at positions ``pos``, their cursors moved past them: a
        batch scheduled while this one is still on the device (``schedule_overlap``) places
        its rows after these."""
        R = self.rows
        cols = RequestColumns.decode(R.seq_id[slots], slots, pos, R.prompt_len[slots],
                                     R.prefix_hit[slots])  # fmt: skip
        k = self.config.speculative_tokens
        if k:  # the anchor and the drafts; the cursor moves by what is accepted (postprocess)
            cols.end = pos + 1 + k
        else:
            R.pos[slots] = pos + 1
        return cols

    def schedule_overlap(self, inflight: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode batch while ``inflight`` (a decode batch) is still on the device and
        not postprocessed, or None when the next batch must wait for its results.

        Every row of ``inflight`` sampled a token nobody has seen yet: the runner feeds it to
        the new row on the device. A request that reaches its length limit with that token gets
        no row; one that stops on it gets a row whose result its postprocess discards. Under
        ``copy`` an in-flight row ending on the hash-block grid has its image stored by the new
        batch, before its forward (the image's tokens are all known by then). The next batch
        waits instead (None) wherever the outcome of ``inflight`` decides what it holds:
        cancellations, requests to admit or still prefilling, a page shortage (preemption), a
        token budget smaller than the rows."""
        cfg, bm, R = self.config, self.bm, self.rows
        if inflight.phase != "decode" or self._aborts != self._aborts_seen:
            return None
        if bm.pending_stores or self._kv_loads:
            return None
        if self.waiting and len(self.running) < cfg.max_num_seqs and bm.free_slots:
            return None
        members, slots = self._members()
        if not members or len(members) != len(self.running):
            return None  # nothing decodes, or a request is still prefilling
        rows = inflight.requests
        pending = np.zeros(len(R.seq_id), dtype=np.int64)
        live = R.seq_id[rows.slot] == rows.seq_id
        if cfg.transfer == "copy":
            # the image of the state an in-flight row leaves on the grid: queued now, so this
            # batch stores it before its forward changes the slot (postprocess finds it queued)
            for i in np.flatnonzero(live & (rows.end % cfg.page_tokens == 0)).tolist():
                seq, end = R.seq[int(rows.slot[i])], int(rows.end[i])
                if len(seq.token_ids) < end:
                    return None  # (a token of the image is not read yet)
                self._store_image(seq, end)
        pending[rows.slot[live]] = 1
        # a request whose in-flight token reaches its length limit ends with it: no row
        go = R.num_tokens[slots] + pending[slots] < R.limit[slots]
        if not go.all():
            members = [s for s, g in zip(members, go.tolist(), strict=True) if g]
            slots = slots[go]
            if not members:
                return None
        if len(members) > cfg.max_num_batched_tokens:
            return None
        need = (R.pos[slots] // cfg.page_tokens) >= R.num_blocks[slots]
        if int(need.sum()) > bm.allocatable_pages():
            return None
        for j in np.flatnonzero(need).tolist():
            bm.append_page(members[j].block_table)
            R.num_blocks[slots[j]] += 1
        return self._batch("decode", self._decode_columns(slots, R.pos[slots]), members, [], [], [])

    def _take_pages(self, members: list[Sequence], slots: np.ndarray, need: np.ndarray,
                    budget: int) -> np.ndarray:  # fmt: skip
        """The decode rows the budget and the pool carry (a mask): in queue order, a row that
        needs a page takes one, preempting the newest rows still queued while none is left, or
        itself when none is queued behind it; the first ``budget`` rows left are kept."""
        m = len(members)
        keep = np.zeros(m, dtype=bool)
        hi, i, count = m, 0, 0  # rows [i, hi) are still queued; ``count`` kept so far
        for j in np.flatnonzero(need).tolist():
            if j >= hi or count >= budget:
                break
            take = min(j - i, budget - count)  # rows before j need no page
            keep[i : i + take] = True
            count += take
            i = j
            if count >= budget:
                break
            self_preempted = False
            while self.bm.allocatable_pages() == 0:
                if hi - 1 > j:
                    hi -= 1
                    self.preempt(members[hi])
                else:
                    self.preempt(members[j])
                    self_preempted, hi = True, j
                    break
            if not self_preempted:
                self.bm.append_page(members[j].block_table)
                self.rows.num_blocks[slots[j]] += 1
                keep[j] = True
                count += 1
            i = j + 1
        if i < hi and count < budget:
            keep[i : i + min(hi - i, budget - count)] = True
        return keep

    # ---- postprocess -----------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput) -> list[Sequence]:
        """Advance cursors, publish blocks, queue images, sample, finish; returns newly finished.

        Rows of requests with a decode row are handled as columns (cursors, tokens, stop
        checks); a request is visited alone only where its state changes beyond that (a block
        to publish, logprobs to record, a finish) and for prefill chunks."""
        cfg, bm, R = self.config, self.bm, self.rows
        copy = cfg.transfer == "copy"
        for im in bm.complete_batch():
            tokens = self._image_tokens.pop(im.key, ())
            if self.connector is not None:
                self._kv_saves.append(KVSave((im.key,), tuple(im.units), tokens, image=True))
        rows = batch.requests
        step, members, version = self._scheduled
        if step == batch.step and version == R.version and len(rows) == len(members):
            # the batch scheduled last, all decode rows, none unloaded since
            mi, is_row = slice(None), None
            m_slots, m_ends, m_seqs = rows.slot, rows.end, members
        else:
            is_row = R.seq_id[rows.slot] == rows.seq_id  # the request still has its decode row
            mi = np.flatnonzero(is_row)
            m_slots, m_ends = rows.slot[mi], rows.end[mi]
            m_seqs = [R.seq[s] for s in m_slots.tolist()]
        P = cfg.page_tokens  # (the rows' cursors moved when they were scheduled)
        spec_finishing: list[tuple[Sequence, str]] = []
        if output.spec_tokens is not None:  # tokens first: the blocks' hashes need them
            m_ends, spec_finishing = self._spec_tokens(rows, mi, m_slots, m_seqs, output)
        # a batch scheduled after this one (overlapped) has already run past these rows: their
        # images were queued then (``schedule_overlap``), and a slot no longer holds them now
        images = copy and self.step_count == batch.step
        commit = m_ends // P > R.published[m_slots]  # a block completed
        if images:
            commit |= m_ends % P == 0  # an image to store
        for k in np.flatnonzero(commit).tolist():
            self._publish(m_seqs[k], int(m_ends[k]), images)
            R.published[m_slots[k]] = m_seqs[k].num_published_blocks
        others = []  # the prefill rows (and any decode row without a row in ``R``)
        for i in [] if is_row is None else np.flatnonzero(~is_row).tolist():
            req = rows.row(i)
            seq = self._owner[req.slot]
            if seq is None or seq.seq_id != req.seq_id:
                continue  # no longer running
            self._advance(seq, req, output)
            others.append((seq, req))
        finishing: list[tuple[Sequence, str]] = []
        sources = 0  # lists of finishes merged below (each in queue order)
        # Cancellation first: a middle chunk or a deferred step has no sampled row.
        if self._aborts != self._aborts_seen:  # (schedule() marks them seen)
            finishing += [(s, "aborted") for s in self.running if s.aborted]
            sources += bool(finishing)
        # Decode rows: tokens, cursors and stop checks over the columns.
        if output.spec_tokens is not None:  # (done above; cancelled ones finish as aborted)
            ended = [(s, r) for s, r in spec_finishing if not s.aborted]
            finishing += ended
            sources += bool(ended)
        else:
            live = np.array([not s.aborted for s in m_seqs], dtype=bool) if finishing else None
            toks = self._row_tokens(rows, mi, m_seqs, output, live)
            ok = toks >= 0
            if ok.all():  # (one pass of Python per step: the requests' records)
                for seq, end, tok in zip(m_seqs, m_ends.tolist(), toks.tolist(), strict=True):
                    seq.num_cached_tokens = end
                    seq.token_ids.append(tok)
            else:
                for seq, end, tok in zip(m_seqs, m_ends.tolist(), toks.tolist(), strict=True):
                    seq.num_cached_tokens = end
                    if tok >= 0:
                        seq.token_ids.append(tok)
                m_slots, toks = m_slots[ok], toks[ok]
                m_seqs = [s for s, g in zip(m_seqs, ok, strict=True) if g]
            R.num_tokens[m_slots] += 1
            R.last_token[m_slots] = toks
            stop, length = R.stop_reasons(m_slots, toks)
            ended = np.flatnonzero(stop | length).tolist()
            finishing += [(m_seqs[k], "stop" if stop[k] else "length") for k in ended]
            sources += bool(ended)
        # Prefill rows, one at a time: a final chunk samples the request's first token.
        n_before = len(finishing)
        for seq, req in others:
            if seq.aborted or seq.num_cached_tokens < seq.prefill_end:
                continue  # cancelled (finished above), or still prefilling
            if batch.phase != "decode" and not req.is_final_chunk:
                continue  # not sampled this step
            token = self._sampled_token(seq, output)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                finishing.append((seq, reason))
        sources += len(finishing) > n_before
        if sources > 1:  # finish in queue order, as one pass over the queue would
            index = {id(s): k for k, s in enumerate(self.running)}
            finishing.sort(key=lambda f: index[id(f[0])])
        done = [seq for seq, _ in finishing]
        if done:
            self._drop_running(done)
        for seq, reason in finishing:
            self._finish(seq, reason)
        for seq, _ in others:  # a prefill just ended: the request decodes from its row
            ended = not seq.is_finished and seq.num_cached_tokens >= seq.prefill_end
            if ended and R.seq[seq.slot] is not seq:
                R.load(seq, self._stop_rule(seq))
        return done

    def _spec_tokens(
        self, rows, mi, m_slots: np.ndarray, m_seqs: list[Sequence], output: RunnerOutput
    ) -> tuple[np.ndarray, list[tuple[Sequence, str]]]:
        """Speculative decode rows: each request takes its emitted tokens in order (accepted
        drafts, then the target's next token) up to a stop token or its length limit, and
        its cursor moves past the accepted ones. Returns the rows' new cursors (where their
        KV and tokens both reach: what may be published) and the requests that end."""
        R = self.rows
        emitted = output.spec_tokens[mi]
        lps = output.spec_logprobs[mi]
        ends = np.zeros(len(m_seqs), dtype=np.int64)
        finishing: list[tuple[Sequence, str]] = []
        starts = rows.start[mi].tolist()
        for k, seq in enumerate(m_seqs):
            start = starts[k]
            if seq.aborted:
                ends[k] = start
                continue
            stops, limit = self._stop_rule(seq)
            reason, n = None, 0
            for tok in emitted[k].tolist():
                if tok < 0:
                    break
                seq.token_ids.append(tok)
                if seq.params.logprobs is not None:
                    seq.output_logprobs.append((float(lps[k, n]), {}))
                n += 1
                if tok in stops:
                    reason = "stop"
                elif len(seq.token_ids) >= limit:
                    reason = "length"
                if reason is not None:
                    break
            ends[k] = start + n
            seq.num_cached_tokens = start + n
            s = int(m_slots[k])
            R.num_tokens[s] = len(seq.token_ids)
            R.last_token[s] = seq.token_ids[-1]
            R.pos[s] = start + n
            if reason is not None:
                finishing.append((seq, reason))
        return ends, finishing

    def _advance(self, seq: Sequence, req: ScheduledRequest, output: RunnerOutput) -> None:
        """A forward of ``req`` ran: count its replay, score its rows, move the cursor."""
        if req.resume != req.start:
            seq.replay_rows += req.resume - req.start
        seq.fresh_start = None
        if req.all_logits and req.seq_id in output.row_logits:
            self._score(seq, req, output.row_logits[req.seq_id])
        seq.num_cached_tokens = req.end
        self._publish(seq, req.end)

    def _publish(self, seq: Sequence, end: int, image: bool = True) -> None:
        """Publish the blocks a forward ending at ``end`` completed (hashes only after the KV
        is written) and, under ``copy`` (and ``image``), queue the image of a block it ended
        on."""
        cfg, bm = self.config, self.bm
        full = end // cfg.page_tokens
        if full > seq.num_published_blocks:
            hashes = seq.hashes(cfg.page_tokens, full)
            first = seq.num_published_blocks
            for b in range(first, full):
                bm.publish(hashes[b], seq.block_table[b])
            seq.num_published_blocks = full
            if self.connector is not None:
                self._kv_saves.append(
                    KVSave(
                        tuple(hashes[first:full]),
                        tuple(seq.block_table[first:full]),
                        tuple(seq.token_ids[: full * cfg.page_tokens]),
                    )
                )
        if image and cfg.transfer == "copy" and end % cfg.page_tokens == 0 and end > 0:
            self._store_image(seq, end)

    def _store_image(self, seq: Sequence, end: int) -> None:
        """Queue the checkpoint image of ``seq``'s slot at ``end`` (on the grid), unless it is
        stored or queued already."""
        cfg, bm = self.config, self.bm
        key = seq.hashes(cfg.page_tokens, end // cfg.page_tokens)[-1]
        if bm.begin_store(key, seq.slot, end) and self.connector is not None:
            self._image_tokens[key] = tuple(seq.token_ids[:end])

    def _row_tokens(self, rows, mi: np.ndarray | slice, seqs: list[Sequence], output: RunnerOutput,
                    live: np.ndarray | None):  # fmt: skip
        """The tokens sampled for rows ``mi`` of the batch (requests ``seqs``; -1 where a row
        has none or is not ``live``: cancelled), with the logprobs of requests asking
        recorded."""
        if output.row_tokens is None:  # a runner without columns (or without a sampler)
            got = [
                self._sampled_token(seq, output) if live is None or live[k] else None
                for k, seq in enumerate(seqs)
            ]
            return np.array([-1 if t is None else t for t in got], dtype=np.int64)
        toks = output.row_tokens[mi].copy()
        if live is not None:
            toks[~live] = -1
        if self.rows.logprobs.any():
            lps = output.row_logprobs[mi]
            for k in np.flatnonzero(self.rows.logprobs[rows.slot[mi]] & (toks >= 0)).tolist():
                top = output.top_logprobs.get(seqs[k].seq_id, ())
                seqs[k].output_logprobs.append((float(lps[k]), dict(top)))
        return toks

    def _sampled_token(self, seq: Sequence, output: RunnerOutput) -> int | None:
        """The token ``output`` sampled for ``seq`` (sampled here from its logits when the runner
        has no device sampler), its logprobs recorded where asked; None when it has none."""
        token = output.tokens.get(seq.seq_id)
        if token is None:  # a runner without a device sampler: sample its logits here
            logits = output.last_logits.get(seq.seq_id)
            if logits is None:
                return None
            index = seq.num_tokens - seq.num_prompt_tokens
            token = sample(logits, seq.params, seq.seed, index)
            if seq.params.logprobs is not None:
                lp, top = token_logprobs(logits, token, seq.params.logprobs)
                seq.output_logprobs.append((lp, dict(top)))
        elif seq.params.logprobs is not None:
            seq.output_logprobs.append(
                (output.logprobs[seq.seq_id], dict(output.top_logprobs.get(seq.seq_id, ())))
            )
        return token

    def _score(self, seq: Sequence, req: ScheduledRequest, rows: torch.Tensor) -> None:
        lp = torch.log_softmax(rows.double(), dim=-1)
        top = lp.argmax(dim=-1).tolist()  # the first maximum, as an argmax-greedy decoder picks
        for i in range(req.chunk_len):
            pos = req.start + i + 1
            if pos >= seq.num_prompt_tokens or req.start + i < req.resume:
                continue
            tok = seq.token_ids[pos]
            seq.prompt_logprobs.append(float(lp[i, tok]))
            seq.prompt_greedy.append(top[i] == tok)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """``stop`` for EOS (unless ignored) or a stop token id, ``length`` at ``max_tokens``
        or ``max_model_len``; None otherwise (the scalar form of ``DecodeRows.stop_reasons``)."""
        stops, limit = self._stop_rule(seq)
        if token in stops:
            return "stop"
        if len(seq.token_ids) >= limit:
            return "length"
        return None

    def _stop_rule(self, seq: Sequence) -> tuple[frozenset[int], int]:
        """The token ids that stop ``seq`` (EOS unless ignored, ``stop_token_ids``) and the
        token count that ends it, built once per request."""
        rule = seq.stop_rule
        if rule is None:
            p, eos = seq.params, self.config.eos_token_id
            stops = set(p.stop_token_ids)
            if not p.ignore_eos and eos is not None:
                stops.add(eos)
            limit = min(seq.num_prompt_tokens + p.max_tokens, self.config.max_model_len)
            rule = seq.stop_rule = (frozenset(stops), limit)
        return rule
