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
    RunnerOutput,
    ScheduledBatch,
    ScheduledRequest,
    SlotDelta,
)
from v41plan.serving.block_manager import READY, BlockManager
from v41plan.serving.sampling import sample, token_logprobs
from v41plan.serving.sequence import SeqStatus, Sequence


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
        self.running: deque[Sequence] = deque()
        self.finished: list[Sequence] = []
        self.step_count = 0
        self.events: list[dict] = []
        self._freed: list[int] = []  # slots freed since the last batch (the runner clears them)

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
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_cached_tokens = 0
        seq.fresh_start = None
        seq.prompt_logprobs.clear()  # a scoring request re-scores from position 0
        seq.prompt_greedy.clear()
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- helpers ---------------------------------------------------------------------------
    def _free(self, seq: Sequence) -> None:
        self._drop_prefetch(seq)
        self.bm.free(seq.block_table)
        if seq.slot is not None:
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
        if self._pages_for(seq.num_tokens + 1) > self.bm.num_pages:
            return f"unschedulable: needs more than the {self.bm.num_pages} PAGEs of the pool"
        return None

    # ---- schedule --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch, or None when nothing can run."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        restores = []
        # Requests cancelled between steps finish here, wherever they wait.
        for seq in [s for s in self.running if s.aborted]:
            self.running.remove(seq)
            self._finish(seq, "aborted")
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            self._finish(seq, "aborted")
        # Phase 0: every running request past its prefill decodes one row.
        reqs, seqs = self._schedule_decode(budget)
        budget -= len(reqs)
        decodes = len(reqs)
        # Phase 1: partial prefills already running, in queue order.
        for seq in [s for s in self.running if s.num_cached_tokens < s.prefill_end]:
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
        if not reqs:
            if self.bm.pending_stores or self._freed or self._kv_saves:
                # Nothing to run, but queued image stores (or freed slots) still need a batch.
                return self._batch("decode", [], [], [])
            return None
        phase = "decode" if len(reqs) == decodes else "prefill"
        return self._batch(phase, reqs, restores, seqs)

    def _deltas(self, seqs: list[Sequence]):
        """What each scheduled request's slot gained since the runner last saw it: a
        ``SlotDelta`` for a slot a request took or grew pages in, the columnar appends for the
        common case of one new token and nothing else."""
        out, a_slots, a_tokens = [], [], []
        for seq in seqs:
            reset = seq.needs_reset
            t0 = 0 if reset else seq.synced_tokens
            b0 = 0 if reset else seq.synced_blocks
            n_tok, n_blk = len(seq.token_ids), len(seq.block_table)
            if not reset and b0 == n_blk:
                if t0 == n_tok:
                    continue
                if t0 + 1 == n_tok:
                    a_slots.append(seq.slot)
                    a_tokens.append(seq.token_ids[t0])
                    seq.synced_tokens = n_tok
                    continue
            out.append(
                SlotDelta(
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
            )
            seq.synced_tokens, seq.synced_blocks, seq.needs_reset = n_tok, n_blk, False
        return (
            tuple(out),
            np.asarray(a_slots, dtype=np.int64),
            np.asarray(a_tokens, dtype=np.int64),
        )

    def _batch(self, phase: str, reqs: list[ScheduledRequest], restores, seqs) -> ScheduledBatch:
        self.step_count += 1
        deltas, a_slots, a_tokens = self._deltas(seqs)
        batch = ScheduledBatch(
            step=self.step_count,
            phase=phase,
            requests=tuple(reqs),
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
        cols = [(r.seq_id, r.slot, r.start, r.resume, r.end) for r in reqs]  # one pass
        ids, slots, starts, resumes, ends = map(list, zip(*cols)) if cols else ([], [], [], [], [])
        self.events.append(
            {
                "step": batch.step,
                "phase": phase,
                "ids": ids,
                "slots": slots,
                "starts": starts,
                "resumes": resumes,
                "ends": ends,
                "replay_rows": sum(resumes) - sum(starts),
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

    def _schedule_decode(self, budget: int) -> tuple[list[ScheduledRequest], list[Sequence]]:
        """One decode row for every running request past its prefill, in queue order; a request
        that needs a page when none is left preempts the newest others (or itself)."""
        reqs: list[ScheduledRequest] = []
        scheduled: list[Sequence] = []
        # (attributes, not the is_prefilling property: this runs over every running request)
        queue = deque(
            s for s in self.running if s.num_cached_tokens >= s.prefill_end and not s.aborted
        )
        while queue and budget > 0:
            seq = queue.popleft()
            pos = seq.num_cached_tokens
            need_page = pos // self.config.page_tokens >= len(seq.block_table)
            preempted_self = False
            while need_page and self.bm.allocatable_pages() == 0:
                victim = queue.pop() if queue else None
                if victim is None:
                    self.preempt(seq)
                    preempted_self = True
                    break
                self.preempt(victim)
            if preempted_self:
                continue
            if need_page:
                self.bm.append_page(seq.block_table)
            scheduled.append(seq)
            # positional (seq_id, slot, start, resume, end, prompt_len, prefix_hit, fresh_slot,
            # is_final_chunk): half the cost of keywords, once per request per step
            hit = seq.hits[-1] if seq.hits else 0
            reqs.append(ScheduledRequest(seq.seq_id, seq.slot, pos, pos, pos + 1,
                                         seq.prefill_end, hit, False, True))  # fmt: skip
            budget -= 1
        return reqs, scheduled

    # ---- postprocess -----------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput) -> list[Sequence]:
        """Advance cursors, publish blocks, queue images, sample, finish; returns newly finished."""
        cfg, bm = self.config, self.bm
        copy = cfg.transfer == "copy"
        for im in bm.complete_batch():
            tokens = self._image_tokens.pop(im.key, ())
            if self.connector is not None:
                self._kv_saves.append(KVSave((im.key,), tuple(im.units), tokens, image=True))
        by_id = {s.seq_id: s for s in self.running}
        done: list[Sequence] = []
        for req in batch.requests:
            seq = by_id.get(req.seq_id)
            if seq is None:
                continue
            if req.resume != req.start:
                seq.replay_rows += req.resume - req.start
            seq.fresh_start = None
            if req.all_logits and req.seq_id in output.row_logits:
                self._score(seq, req, output.row_logits[req.seq_id])
            seq.num_cached_tokens = req.end
            # Publish the blocks this forward completed (hashes only after the KV is written).
            full = req.end // cfg.page_tokens
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
            if copy and req.end % cfg.page_tokens == 0 and req.end > 0:
                key = seq.hashes(cfg.page_tokens, full)[full - 1]
                if bm.begin_store(key, seq.slot, req.end) and self.connector is not None:
                    self._image_tokens[key] = tuple(seq.token_ids[: req.end])
        # every request of a decode batch samples (one the batch left out has no token nor
        # logits in the output and is skipped below); a prefill batch only its final chunks
        final = (
            None
            if batch.phase == "decode"
            else {r.seq_id for r in batch.requests if r.is_final_chunk}
        )
        for seq in list(self.running):
            # Cancellation first: a middle chunk or a deferred step has no sampled row.
            if seq.aborted:
                self.running.remove(seq)
                self._finish(seq, "aborted")
                done.append(seq)
                continue
            if seq.num_cached_tokens < seq.prefill_end or (
                final is not None and seq.seq_id not in final
            ):
                continue  # still prefilling, or not sampled this step
            token = output.tokens.get(seq.seq_id)
            if token is None:  # a runner without a device sampler: sample its logits here
                logits = output.last_logits.get(seq.seq_id)
                if logits is None:
                    continue
                index = seq.num_tokens - seq.num_prompt_tokens
                token = sample(logits, seq.params, seq.seed, index)
                if seq.params.logprobs is not None:
                    lp, top = token_logprobs(logits, token, seq.params.logprobs)
                    seq.output_logprobs.append((lp, dict(top)))
            elif seq.params.logprobs is not None:
                seq.output_logprobs.append(
                    (output.logprobs[seq.seq_id], dict(output.top_logprobs.get(seq.seq_id, ())))
                )
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                done.append(seq)
        return done

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
        or ``max_model_len``; None otherwise. The rule is built once per request (a decode
        step checks every running request)."""
        rule = seq.stop_rule
        if rule is None:
            p, eos = seq.params, self.config.eos_token_id
            stops = set(p.stop_token_ids)
            if not p.ignore_eos and eos is not None:
                stops.add(eos)
            limit = min(seq.num_prompt_tokens + p.max_tokens, self.config.max_model_len)
            rule = seq.stop_rule = (frozenset(stops), limit)
        if token in rule[0]:
            return "stop"
        if len(seq.token_ids) >= rule[1]:
            return "length"
        return None
