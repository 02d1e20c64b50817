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

from collections import Counter

import numpy as np
import torch

from v41plan.geometry.runtime import CacheSpec
from v41plan.serving.admission import EngineOptions
from v41plan.serving.batch import RunnerOutput, ScheduledBatch, check_plan, to_step_input


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

        self.spec = spec
        self.options = options
        self.vocab_size = int(spec.model_config["vocab_size"])
        P = spec.replay.hash_block_tokens
        weights = ckpt.weights if ckpt.weights is not None else ckpt.process(dtype, device)
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
        )  # fmt: skip
        from v41plan.runtime.graphs import build_graph_runner

        # FULL / PIECEWISE decode graphs on CUDA (None under eager execution or on CPU).
        self.graphs = build_graph_runner(self.model, spec, options)
        self.flags = {
            "encoder_replay": bool(options.encoder_swa_bounded_replay),
            "decoder_replay": bool(options.decoder_swa_bounded_replay),
        }
        self.stats: Counter = Counter()
        self._copies = None  # the pool's CopyPlanner, built at the first image copy

    def graph_stats(self) -> dict:
        """Capture report and replay counters (empty under eager execution)."""
        if self.graphs is None:
            return {}
        return {
            "mode": self.graphs.mode,
            "buckets": [list(b) for b in self.graphs.buckets],
            "stats": dict(self.graphs.stats),
            "capture": self.graphs.report,
        }

    # ---- state copies ------------------------------------------------------------------------
    def _copy_image(self, slot: int, units: tuple[int, ...], store: bool) -> None:
        """Store or restore one image through the generated span table (checked against the
        pool's layout id and byte totals) and the backend's copy."""
        from v41plan.planner.checkpoint import CopyPlanner, ImageOp, load_image_layout

        pools = self.model.pools
        if self._copies is None:
            g = pools.geometry
            self._copies = CopyPlanner(
                g, pools.num_pages, pools.num_slots, load_image_layout(g, self.spec.name)
            )
        g = self._copies.geometry
        op = ImageOp(slot, tuple(units), g.layout_id, g.image_bytes)
        spans = self._copies.store(op) if store else self._copies.restore(op)
        src, dst = pools.span_addresses(self._copies.regions, spans)
        self.model.backend.copy_image(pools.backing, src, dst)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Stores, restores, fresh-slot resets, then the planned forward."""
        from v41plan.planner.step import plan_step

        for op in batch.stores:
            self._copy_image(op.slot, op.units, store=True)
            self.stats["stores"] += 1
        for op in batch.restores:
            self._copy_image(op.slot, op.units, store=False)
            self.stats["restores"] += 1
        out = RunnerOutput()
        if not batch.requests:
            return out
        for r in batch.requests:
            if r.fresh_slot:
                self.model.pools.reset_slot(r.slot)
                self.stats["fresh_resets"] += 1
        from v41plan.runtime.graphs import graph_forward, pad_for_graphs

        step = to_step_input(batch, compress=self.engram.compress)
        step = pad_for_graphs(self.graphs, step, batch.phase == "decode")
        plan = plan_step(step, self.spec, **self.flags)
        check_plan(batch, plan)
        ids = np.concatenate(
            [np.asarray(r.token_ids[r.start : r.end], dtype=np.int64) for r in batch.requests]
        )
        want_rows = any(r.all_logits for r in batch.requests)
        res = graph_forward(self.graphs, self.model, plan, ids, all_row_logits=want_rows)
        self.stats["forwards"] += 1
        self.stats["rows"] += int(plan.scheduled_tokens)
        self.stats["replay_rows"] += sum(r.replay_rows for r in batch.requests)
        if plan.decoder_replay:
            self.stats["decoder_replay_steps"] += 1
            self.stats["tail_rows"] += len(plan.tail_rows)
        cu = plan.cu_seqlens_q
        logits = res.logits.float().cpu()  # one device-to-host copy per step, not per request
        row_logits = (
            res.row_logits.float().cpu() if want_rows and res.row_logits is not None else None
        )
        for i, r in enumerate(batch.requests):
            if r.is_final_chunk:
                out.last_logits[r.seq_id] = logits[i]
            if r.all_logits and row_logits is not None:
                out.row_logits[r.seq_id] = row_logits[int(cu[i]) : int(cu[i + 1])]
        return out


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
