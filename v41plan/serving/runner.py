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
        P = spec.replay.hash_block_tokens
        if ckpt.weights is not None:
            weights = ckpt.weights
        elif self.kernels["resident_weights"]:
            # the grouped wo_a runs on bf16 values in the published model
            weights = ckpt.process(dtype, device, resident=True, dequantize=("attn.wo_a.weight",))
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
        )  # fmt: skip
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
        out = RunnerOutput()
        rows = batch.requests  # columns: no per-request object on this path
        n = len(rows)
        if not n:
            return out
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
        ids = step_token_ids(batch, self.tables, slots)
        if decode:
            want_rows, final = False, slice(None)
        else:
            want_rows = bool(rows.all_logits.any())
            final = np.flatnonzero(rows.is_final_chunk)
        sampling = self.tables.sampling(slots)
        inputs = model.prepare(plan, ids, all_row_logits=want_rows, sampling=sampling)
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
        host = self.read_back(res, want_rows)
        tokens = host["token_ids"].numpy()[:n].astype(np.int64, copy=False)
        logprobs = host["logprobs"].numpy()[:n]
        if not decode:  # only final chunks sample
            tokens = np.where(rows.is_final_chunk, tokens, -1)
        out.set_rows(rows.seq_id, tokens, logprobs)
        if sampling.top_n > 0:
            top_n = self.tables.top_n[slots].tolist()
            for i in np.arange(n)[final].tolist():
                k = top_n[i]
                if k > 0:
                    ids_i = host["top_ids"][i, :k].tolist()
                    lps_i = host["top_logprobs"][i, :k].tolist()
                    out.top_logprobs[int(rows.seq_id[i])] = list(zip(ids_i, lps_i, strict=True))
        if want_rows:
            cu = plan.cu_seqlens_q
            for i in np.flatnonzero(rows.all_logits).tolist():
                sid = int(rows.seq_id[i])
                out.row_logits[sid] = host["row_logits"][int(cu[i]) : int(cu[i + 1])]
        return out

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

    def read_back(self, res, want_rows: bool) -> dict[str, torch.Tensor]:
        """The step's one device-to-host transfer: the sampled token ids and their logprobs
        (the top logprobs when asked), and the row logits of scoring requests, through pinned
        buffers on CUDA. Returns host tensors (copies: the pinned buffers are reused)."""
        s = res.sampled
        parts = {"token_ids": s.token_ids, "logprobs": s.logprobs}
        if s.top_ids.shape[1]:
            parts["top_ids"], parts["top_logprobs"] = s.top_ids, s.top_logprobs
        if want_rows and res.row_logits is not None:
            rl = res.row_logits  # float64 stays (exact scoring); bf16 and float32 as float32
            parts["row_logits"] = rl if rl.dtype == torch.float64 else rl.float()
        if s.token_ids.device.type != "cuda":
            return {k: v.clone() for k, v in parts.items()}
        host = {}
        for name, x in parts.items():
            key = (name, tuple(x.shape), x.dtype)
            buf = self._readback.get(key)
            if buf is None:
                buf = self._readback[key] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            buf.copy_(x, non_blocking=True)
            host[name] = buf
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the results are the step's only readback
        return {k: v.clone() for k, v in host.items()}


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

    if checkpoint is not None:
        return load_checkpoint(checkpoint, spec, dtype=None)
    cfg = config_from_cache_spec(spec)
    return LoadedCheckpoint.from_state(cfg, random_state(cfg, options.random_weights_seed))


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
