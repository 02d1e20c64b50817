"""The engine's paged runner: a scheduled batch -> ``plan_step`` -> the paged runtime model.

Per batch, in order: checkpoint stores (STATE slot -> image PAGE units), restores (units ->
slot), a position-0 / rebuild reset of every fresh slot, then the planned forward. The plan's
forward starts are checked against the scheduler's (``check_plan``), so the rows the scheduler
budgeted are the rows that run. Counters (``stats``) record what each path did: stores,
restores, fresh resets, replay rows, decoder-replay steps and tail rows.

Under torchrun every rank runs the identical schedule on its tensor-parallel shard of the
weights (``v41plan.model.sharding``: heads, index heads, output groups, experts) and a full replica
of
the cache; ``tensor_parallel_size`` is the launched world size, or 1 for a full replica of the
model on every rank.

``build_runner(spec, checkpoint, options)`` loads a checkpoint directory (its config checked
against the spec before any weight is read) or, with no checkpoint, builds the spec's seeded
random checkpoint in memory, and wraps it in ``PagedRunner``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from v41plan.geometry.runtime import CacheSpec
from v41plan.serving.admission import EngineOptions
from v41plan.serving.batch import (
    RunnerOutput,
    ScheduledBatch,
    SlotTables,
    check_plan,
    history_window,
    step_token_ids,
    to_step_input,
)

log = logging.getLogger(__name__)


class PagedRunner:
    """Executes scheduled batches on ``RuntimeModel`` over PAGE/STATE pools."""

    paged = True

    def __init__(
        self,
        spec: CacheSpec,
        ckpt,
        options: EngineOptions,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        from v41plan.model.sharding import shard_weights
        from v41plan.runtime.collectives import tp_group
        from v41plan.runtime.paged_model import RuntimeModel
        from v41plan.serving.admission import resolve_kernels

        t_build = time.perf_counter()
        self.spec = spec
        self.options = options
        self.kernels = resolve_kernels(options, device.type)
        """The kernel choices the options' ``auto`` values resolved to on this device."""
        self.vocab_size = int(spec.model_config["vocab_size"])
        self.device_type = device.type
        self.speculative = options.speculative_config is not None
        """DSpark: every decode row verifies its anchor and the draft's block in one forward."""
        P = spec.replay.hash_block_tokens
        if ckpt.weights is not None:
            weights = ckpt.weights
        elif self.kernels["resident_weights"]:
            weights = ckpt.process(dtype, device, resident=True)
        else:
            weights = ckpt.process(dtype, device)
        self.engram = ckpt.engram_host()
        self.tp = tp_group(options.tensor_parallel_size, device.type)
        weights = shard_weights(weights, ckpt.config, self.tp, options.enable_expert_parallel)
        self.model = RuntimeModel(
            spec, weights, self.engram,
            kv_cache_dtype=options.kv_cache_dtype,
            index_cache_dtype=options.index_cache_dtype,
            num_pages=options.num_pages,
            num_slots=options.max_num_seqs,
            max_tokens=max(options.max_num_batched_tokens, options.max_num_seqs),
            max_bs=options.max_num_seqs,
            table_width=-(-options.max_model_len // P) + 1,
            dtype=dtype, device=device, cfg=ckpt.config, tp=self.tp,
            backend=_backend(self.kernels["kernel_backend"], device),
            dense=self.kernels["dense_kernels"], moe=self.kernels["moe_impl"],
            compile_backend=self.kernels["compile_backend"],
            speculative=self.speculative,
        )  # fmt: skip
        self.spec_block = self.model.draft.block_size if self.speculative else 0
        self._drafts = np.zeros((options.max_num_seqs, max(self.spec_block, 1)), dtype=np.int64)
        """Per slot, the block its draft proposed last (what its next decode row verifies)."""
        self.spec_confidence_sum = np.zeros(max(self.spec_block, 1), dtype=np.float64)
        """The draft's confidence logits summed per draft position over every proposal."""
        self.kernels["resident_weights"] = self.model.resident  # as loaded
        from v41plan.runtime.graphs import build_cuda_graphs

        # FULL / PIECEWISE decode graphs on CUDA (None under eager execution or on CPU).
        self.graphs = build_cuda_graphs(self.model, spec, options)
        self.startup = {"build_s": time.perf_counter() - t_build}
        """Seconds of the start: ``build_s`` (weights to the device and the model), with CUDA
        graphs ``warmup_s`` (every captured width eagerly once; at level 3 that compiles the
        dense pieces), ``capture_s`` and ``compiled_graphs``."""
        if self.graphs is not None:
            rep = self.graphs.report
            self.startup.update({k: rep[k] for k in ("warmup_s", "capture_s", "compiled_graphs")})
            log.info(
                "start: %.1f s (warm-up %.1f s, %d graphs compiled at level %d; capture %.1f s)",
                self.startup["build_s"], rep["warmup_s"], rep["compiled_graphs"],
                self.kernels["compilation_level"], rep["capture_s"],
            )  # fmt: skip
        self.flags = {
            "encoder_replay": bool(options.encoder_swa_bounded_replay),
            "decoder_replay": bool(options.decoder_swa_bounded_replay),
        }
        self.stats: Counter = Counter()
        self._readback: dict = {}  # pinned host buffers of the step's results, by shape
        self._readback_turn = 0
        self._src_row = np.full(options.max_num_seqs, -1, dtype=np.int64)
        """Per slot, the row of the last launch that sampled its request's next token."""
        self._src_seq = np.full(options.max_num_seqs, -1, dtype=np.int64)
        self._last: Launched | None = None
        self._token_map: torch.Tensor | None = None  # Engram's token map on the device
        self.wait_s = 0.0
        """Seconds the host spent waiting for launched results (``collect``)."""
        """The last launch (its sampled tokens feed the next launch's pending rows)."""
        self.tables = SlotTables(options.max_num_seqs, self.model.table_width)
        """Each slot's token ids and block table, kept up to date by the batches' deltas."""
        self._history = history_window(spec.replay.replay_history_tokens, P)
        self.connector = None
        """The engine's KV connector (``kv_connector.KVConnector``), when one is configured."""

    def graph_stats(self) -> dict:
        """Capture report and replay counters (empty under eager execution)."""
        if self.graphs is None:
            return {}
        return {
            "mode": self.graphs.mode,
            "buckets": [list(b) for b in self.graphs.buckets],
            "stats": dict(self.graphs.stats),
            "replays_per_step": self.graphs.replays_per_step(),
            "capture": self.graphs.report,
        }

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Stores, restores, fresh-slot resets, then the planned forward: ``prepare`` on the
        host, ``run`` (or a graph replay of it) on the device, one readback of the results."""
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> Launched:
        """``execute`` up to the readback: the batch's device work and the copy of its results
        to the host are queued, nothing waits for them (``collect`` does).

        A decode row whose token the previous launch sampled and nobody has read yet (the
        engine scheduled it with ``Scheduler.schedule_overlap``) takes that token on the device,
        and its cursor's newest Engram id with it."""
        from v41plan.planner.step import plan_step
        from v41plan.runtime.graphs import select_bucket

        model = self.model
        self.tables.apply(batch)
        if batch.kv_saves or batch.kv_loads:
            self.transfer_kv(batch)
        for op in batch.stores:
            model.copy_image(op.slot, op.units, store=True)
            self.stats["stores"] += 1
        for op in batch.restores:
            model.copy_image(op.slot, op.units, store=False)
            self.stats["restores"] += 1
        rows = batch.requests  # columns: no per-request object on this path
        n = len(rows)
        if not n:
            return Launched(batch, 0)
        decode = batch.phase == "decode"  # one row each, never a fresh slot or all-row logits
        if not decode:
            for slot in rows.slot[rows.fresh_slot].tolist():
                model.reset_slot(slot)
                self.stats["fresh_resets"] += 1
        bucket = None
        if self.graphs is not None and decode:
            bucket = select_bucket(self.graphs.buckets, n, int(rows.chunk_len.max()))
        step = to_step_input(
            batch, self.tables, self.engram.compress, history=self._history,
            running_bs=None if bucket is None else bucket[0],
            running_tokens=None if bucket is None else bucket[0] * bucket[1],
            block_table_width=None if bucket is None else model.table_width,
        )  # fmt: skip
        plan = plan_step(step, self.spec, **self.flags)
        check_plan(batch, plan)
        slots = step.slots  # request order
        spec = None
        if self.speculative:
            ids, spec = self._spec_inputs(batch, slots)
        else:
            ids = step_token_ids(batch, self.tables, slots)
        sampling = self.tables.sampling(slots)
        pend = None
        if spec is not None:
            want_rows = bool(rows.all_logits.any())
            final = np.flatnonzero(rows.is_final_chunk)
        elif decode:
            want_rows, final = False, slice(None)
            held = self.tables.num_tokens[slots]
            if not bool((held > rows.start).all()):
                pend = self._pending(batch, held)
                ids = ids.copy()
                ids[pend[0]] = 0  # a valid id until the device writes the real one
                sampling.output_index[pend[0]] += 1  # the pending token is an output already
        else:
            want_rows = bool(rows.all_logits.any())
            final = np.flatnonzero(rows.is_final_chunk)
        inputs = model.prepare(plan, ids, all_row_logits=want_rows, sampling=sampling, spec=spec)
        if pend is not None:
            self._feed_pending(inputs, pend)
        res = self.graphs.run(inputs) if self.graphs is not None else None
        if res is None:
            res = model.run(inputs)
        self.stats["forwards"] += 1
        self.stats["rows"] += int(plan.scheduled_tokens)
        if not decode:  # a decode row never replays
            self.stats["replay_rows"] += int((rows.resume - rows.start).sum())
        if plan.decoder_replay:
            self.stats["decoder_replay_steps"] += 1
            self.stats["tail_rows"] += len(plan.tail_rows)
        launched = Launched(batch, n, decode, final, want_rows, plan, slots,
                            sampling.top_n, res.sampled.token_ids, pend)  # fmt: skip
        launched.spec = spec
        launched.host, launched.done = self._queue_read_back(res, want_rows)
        self._src_row[:] = -1
        sampled_rows = np.arange(n) if decode else final
        self._src_row[slots[sampled_rows]] = sampled_rows
        self._src_seq[slots[sampled_rows]] = rows.seq_id[sampled_rows]
        self._last = launched
        return launched

    def _spec_inputs(self, batch: ScheduledBatch, slots: np.ndarray):
        """(flat token ids, ``StepSpec``) of a speculating step: a decode row runs its anchor
        and the block its slot's draft proposed; its cursor candidates are the cursor after
        each accepted length (position and Engram history through the accepted tokens)."""
        from v41plan.runtime.paged_model import StepSpec

        rows, t = batch.requests, self.tables
        B = self.spec_block
        verify = rows.start >= rows.prompt_len
        n = len(rows)
        if verify.any() and not bool((rows.end[verify] - rows.start[verify] == B + 1).all()):
            raise RuntimeError(f"step {batch.step}: a speculative decode row must run {B + 1} rows")
        drafts = np.zeros((n, B), dtype=np.int64)
        drafts[verify] = self._drafts[slots[verify], :B]
        # a decode row's anchor is its slot's last token (what a plain decode step reads)
        block = np.concatenate([t.last_token[slots][:, None], drafts], axis=1)
        if verify.all():  # a decode batch: one array op
            ids = block.reshape(-1)
        else:
            parts = [
                block[i] if verify[i] else t.tokens(int(slots[i]), int(rows.start[i]),
                                                    int(rows.end[i]))
                for i in range(n)
            ]  # fmt: skip
            ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        mirror = self.model.pools.cursor_host
        h = mirror.shape[1]
        cursors = np.zeros((n, B + 1, h), dtype=np.int64)
        v = np.flatnonzero(verify)
        if len(v):
            hist = mirror[slots[v], 1:]
            for a in range(B + 1):
                cursors[v, a, 0] = rows.start[v] + a + 1
                if h > 1:
                    cu = np.arange(len(v) + 1, dtype=np.int64) * (a + 1)
                    cursors[v, a, 1:] = self.engram.advance_batch(
                        block[v, : a + 1].reshape(-1), cu, hist
                    )
        spec = StepSpec(verify, drafts, cursors, rows.is_final_chunk.copy())
        return ids, spec

    def _pending(self, batch: ScheduledBatch, held: np.ndarray):
        """``(rows, source rows)`` of the decode rows whose token the previous launch sampled
        (the slot tables stop one token short of their position)."""
        rows = batch.requests
        pend = np.flatnonzero(held <= rows.start)
        slots = rows.slot[pend]
        src = self._src_row[slots]
        last = self._last
        ok = (held[pend] == rows.start[pend]) & (src >= 0)
        ok &= self._src_seq[slots] == rows.seq_id[pend]
        if last is None or last.collected or not bool(ok.all()):
            raise RuntimeError(
                f"step {batch.step}: decode rows {pend[~ok].tolist()} read tokens that neither "
                "the slot tables nor the previous launch hold"
            )
        return pend, src, last

    def _feed_pending(self, inputs, pend) -> None:
        """The pending rows' token ids, and their cursors' newest Engram ids, from the previous
        launch's sampled tokens: device work queued before the forward that reads them."""
        rows, src, last = pend
        n = len(rows)
        tokens = last.sampled
        if np.array_equal(rows, np.arange(n)) and np.array_equal(src, np.arange(n)):
            got = tokens[:n]
            inputs.token_ids[:n].copy_(got)
            dst = slice(0, n)
        else:
            dev = tokens.device
            dst = torch.from_numpy(rows).to(dev, non_blocking=True)
            got = tokens[torch.from_numpy(src).to(dev, non_blocking=True)]
            inputs.token_ids[dst] = got
        if inputs.cursors.shape[1] > 1:
            if self._token_map is None:
                eng = self.model.engram_device
                self._token_map = (
                    eng.token_map if eng is not None
                    else torch.from_numpy(self.engram.token_map).to(tokens.device)
                )  # fmt: skip
            inputs.cursors[dst, 1] = self._token_map[got]
        self.stats["pending_rows"] += n

    def can_overlap(self, launched: Launched) -> bool:
        """Whether the next batch may be scheduled and launched before ``launched``'s results
        are read: a decode batch, and Engram rows hashed on the device (a host table lookup
        needs the token ids on the host)."""
        if not launched.decode or launched.n == 0 or launched.want_rows:
            return False
        if self.speculative:  # the next rows' drafts and cursors come from these results
            return False
        model = self.model
        return model.engram_device is not None or not model._engram_shapes

    def collect(self, launched: Launched) -> RunnerOutput:
        """Wait for ``launched``'s results and return them as the scheduler reads them. The
        cursors of a later launch's rows that read this launch's tokens on the device get
        their newest Engram id on the host mirror too."""
        out = RunnerOutput()
        if launched.collected:
            raise RuntimeError(f"step {launched.batch.step}: results collected twice")
        launched.collected = True
        n = launched.n
        if not n:
            return out
        host, launched.host = launched.host, {}
        if launched.done is not None:  # pinned buffers a later launch reuses: copies
            t0 = time.perf_counter()
            launched.done.synchronize()
            self.wait_s += time.perf_counter() - t0
            host = {k: v.clone() for k, v in host.items()}
        rows = launched.batch.requests
        tokens = host["token_ids"].numpy()[:n].astype(np.int64, copy=False)
        logprobs = host["logprobs"].numpy()[:n]
        later = self._last
        if later is not launched and later.pend is not None and later.pend[2] is launched:
            p_rows, p_src, _ = later.pend
            mirror = self.model.pools.cursor_host
            if mirror.shape[1] > 1:
                mirror[later.slots[p_rows], 1] = self.engram.token_map[tokens[p_src]]
        if launched.spec is not None:
            tokens, logprobs = self._collect_spec(launched, host)
        if not launched.decode:  # only final chunks sample
            tokens = np.where(rows.is_final_chunk, tokens, -1)
        out.set_rows(rows.seq_id, tokens, logprobs)
        if launched.spec is not None:
            emitted = host["spec_tokens"].numpy()[:n].astype(np.int64)
            sampled = rows.is_final_chunk
            out.spec_tokens = np.where(sampled[:, None], emitted, -1)
            out.spec_logprobs = host["spec_logprobs"].numpy()[:n]
        if launched.top_n > 0:
            top_n = self.tables.top_n[launched.slots].tolist()
            for i in np.arange(n)[launched.final].tolist():
                k = top_n[i]
                if k > 0:
                    ids_i = host["top_ids"][i, :k].tolist()
                    lps_i = host["top_logprobs"][i, :k].tolist()
                    out.top_logprobs[int(rows.seq_id[i])] = list(zip(ids_i, lps_i, strict=True))
        if launched.want_rows:
            cu = launched.plan.cu_seqlens_q
            for i in np.flatnonzero(rows.all_logits).tolist():
                sid = int(rows.seq_id[i])
                out.row_logits[sid] = host["row_logits"][int(cu[i]) : int(cu[i + 1])]
        return out

    def _collect_spec(self, launched: Launched, host: dict) -> tuple[np.ndarray, np.ndarray]:
        """A speculating step's results on the host: the verifying requests' cursors committed
        on the mirror at their accepted lengths, each proposing slot's next block kept, the
        acceptance counters; returns every row's next token (the one after its accepted
        drafts) and its logprob."""
        n, sp = launched.n, launched.spec
        slots = launched.slots
        accepted = host["spec_accepted"].numpy()[:n].astype(np.int64)
        v = np.flatnonzero(sp.verify)
        if len(v):
            self.model.commit_accepted(slots[v], sp.cursors[v, accepted[v]])
            self.stats["spec_verify_rows"] += len(v)
            self.stats["spec_drafted"] += len(v) * self.spec_block
            self.stats["spec_accepted"] += int(accepted[v].sum())
            for a in accepted[v].tolist():
                self.stats[f"spec_accepted_len_{a}"] += 1
        props = np.flatnonzero(sp.proposes)
        self._drafts[slots[props], : self.spec_block] = host["spec_drafts"].numpy()[props]
        if len(props):  # the confidence head's logit per draft position, summed over blocks
            self.spec_confidence_sum += host["spec_confidence"].numpy()[props].sum(axis=0)
            self.stats["spec_proposals"] += len(props)
        emitted = host["spec_tokens"].numpy()[:n]
        lps = host["spec_logprobs"].numpy()[:n]
        ar = np.arange(n)
        return emitted[ar, accepted].astype(np.int64), lps[ar, accepted]

    def transfer_kv(self, batch: ScheduledBatch) -> None:
        """The batch's connector offers (read before anything of this batch writes the pools),
        then its loads into fresh PAGE units. Under tensor parallelism every rank has its own
        connector (the local tier) holding the same bytes, so every rank decides alike."""
        pools, conn = self.model.pools, self.connector
        if conn is None:
            raise RuntimeError("a batch carries KV transfers but the runner has no connector")
        for op in batch.kv_saves:
            data = pools.read_units(op.pages)
            if op.image:
                conn.save_image(op.keys[0], op.token_ids, data)
            else:
                conn.save_units(op.keys, op.token_ids, data)
        for op in batch.kv_loads:
            pools.write_units(op.pages, op.data, image=op.image)
            self.stats["kv_loaded_units"] += len(op.pages)

    def _queue_read_back(self, res, want_rows: bool):
        """The step's one device-to-host transfer, queued: the sampled token ids and their
        logprobs (the top logprobs when asked), and the row logits of scoring requests, into
        pinned buffers on CUDA (two sets, alternating: a launch's results stay readable while
        the next launch's copy runs). Returns the host tensors and the event that completes
        them (None on the CPU, where they are already copies)."""
        s = res.sampled
        parts = {"token_ids": s.token_ids, "logprobs": s.logprobs}
        if res.spec is not None:
            sp = res.spec
            parts.update(spec_accepted=sp.accepted, spec_tokens=sp.tokens,
                         spec_logprobs=sp.logprobs, spec_drafts=sp.drafts,
                         spec_confidence=sp.confidence.float())  # fmt: skip
        if s.top_ids.shape[1]:
            parts["top_ids"], parts["top_logprobs"] = s.top_ids, s.top_logprobs
        if want_rows and res.row_logits is not None:
            rl = res.row_logits  # float64 stays (exact scoring); bf16 and float32 as float32
            parts["row_logits"] = rl if rl.dtype == torch.float64 else rl.float()
        if s.token_ids.device.type != "cuda":
            return {k: v.clone() for k, v in parts.items()}, None
        self._readback_turn ^= 1
        host = {}
        for name, x in parts.items():
            key = (self._readback_turn, name, tuple(x.shape), x.dtype)
            buf = self._readback.get(key)
            if buf is None:
                buf = self._readback[key] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            buf.copy_(x, non_blocking=True)
            host[name] = buf
        done = torch.cuda.Event()
        done.record()
        return host, done


class Launched:
    """A launched batch whose results may still be on their way to the host."""

    def __init__(self, batch, n, decode=True, final=None, want_rows=False, plan=None, slots=None,
                 top_n=0, sampled=None, pend=None):  # fmt: skip
        self.batch = batch
        self.n = n
        """Rows of requests (0: the batch ran only copies)."""
        self.decode = decode
        self.final = final
        self.want_rows = want_rows
        self.plan = plan
        self.slots = slots
        self.top_n = top_n
        self.sampled = sampled
        """The device tensor of the sampled token ids (what pending rows of the next launch
        read)."""
        self.pend = pend
        """``(rows, source rows, source launch)`` of the rows that read a token on the device."""
        self.spec = None
        """The step's ``StepSpec`` when the model speculates."""
        self.host: dict = {}
        self.done = None
        self.collected = False


def _backend(name: str, device: torch.device):
    """The kernel backend an engine option names (admission checked it)."""
    if name == "triton" and device.type == "cuda":
        from v41plan.runtime.kernels.triton_backend import TritonBackend

        return TritonBackend()
    from v41plan.runtime.kernels.torch_ref import TorchBackend

    return TorchBackend()


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_weights(spec: CacheSpec, checkpoint: str | None, options: EngineOptions):
    """A ``LoadedCheckpoint``: from ``checkpoint`` or the spec's seeded random one (in memory)."""
    from v41plan.model.checkpoint import LoadedCheckpoint, load_checkpoint, random_state
    from v41plan.model.config import config_from_cache_spec

    speculative = options.speculative_config is not None  # the draft's mtp.* tensors too
    if checkpoint is not None:
        return load_checkpoint(checkpoint, spec, dtype=None, speculative=speculative)
    cfg = config_from_cache_spec(spec)
    state = random_state(cfg, options.random_weights_seed, draft=speculative)
    return LoadedCheckpoint.from_state(cfg, state)


def device_of(options: EngineOptions) -> torch.device:
    """The execution device: ``cuda:LOCAL_RANK`` when CUDA is chosen or available, else CPU."""
    from v41plan.runtime.dist import world_info

    name = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        return torch.device("cuda", world_info().local_rank)
    return torch.device("cpu")


def build_runner(spec: CacheSpec, checkpoint: str | None, options: EngineOptions):
    """The engine's paged runner for ``spec`` (weights loaded here, after admission)."""
    from v41plan.model.sharding import check_tp
    from v41plan.serving.runner import PagedRunner

    # tensor-parallel splits are refused before any weight loads
    check_tp(spec.model_config, options.tensor_parallel_size, options.enable_expert_parallel)
    ckpt = load_weights(spec, checkpoint, options)
    return PagedRunner(spec, ckpt, options, dtype=DTYPES[options.dtype], device=device_of(options))
