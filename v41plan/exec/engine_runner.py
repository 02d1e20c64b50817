"""Model runners the engine builds: weights, then the paged runtime model (or the dense fallback).

``build_runner(spec, checkpoint, options)`` loads a checkpoint directory (its config checked
against the spec before any weight is read) or, with no checkpoint, builds the spec's seeded
random checkpoint in memory. It then wraps the executor's paged runtime model when the package
provides one (``v41plan.exec.runtime_model``); otherwise it falls back to ``ReferenceRunner``,
which recomputes each sampled row with the dense reference model from position 0 and performs
no paging, so it exercises the scheduler but none of the state transfers.
"""

from __future__ import annotations

import importlib.util

import torch

from v41plan.exec.admission import EngineOptions
from v41plan.exec.batch import RunnerOutput, ScheduledBatch
from v41plan.geometry.runtime import CacheSpec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_weights(spec: CacheSpec, checkpoint: str | None, options: EngineOptions):
    """A ``LoadedCheckpoint``: from ``checkpoint`` or the spec's seeded random one (in memory)."""
    from v41plan.exec.checkpoint import LoadedCheckpoint, load_checkpoint, random_state
    from v41plan.exec.config import config_from_cache_spec

    if checkpoint is not None:
        return load_checkpoint(checkpoint, spec, dtype=None)
    cfg = config_from_cache_spec(spec)
    return LoadedCheckpoint.from_state(cfg, random_state(cfg, options.seed))


def device_of(options: EngineOptions) -> torch.device:
    """The execution device: ``cuda:LOCAL_RANK`` when CUDA is chosen or available, else CPU."""
    from v41plan.exec.dist import world_info

    name = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        return torch.device("cuda", world_info().local_rank)
    return torch.device("cpu")


class ReferenceRunner:
    """Dense fallback: each sampled row is the reference model's prefill of ``[0, end)``.

    It ignores slots, pages and state copies (so it cannot detect a wrong restore), which makes
    it a scheduler-level runner only.
    """

    paged = False

    def __init__(self, model, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Logits of each final row (and every row where asked)."""
        out = RunnerOutput()
        for r in batch.requests:
            if not (r.is_final_chunk or r.all_logits):
                continue
            logits = self.model.prefill(list(r.token_ids[: r.end]))
            if r.all_logits:
                out.row_logits[r.seq_id] = logits[r.start : r.end].float().cpu()
            if r.is_final_chunk:
                out.last_logits[r.seq_id] = logits[-1].float().cpu()
        return out


def build_runner(spec: CacheSpec, checkpoint: str | None, options: EngineOptions):
    """The engine's runner for ``spec`` (paged when the executor provides it)."""
    from v41plan.exec.tp import check_tp

    # tensor-parallel splits are refused before any weight loads
    check_tp(spec.model_config, options.tensor_parallel_size, options.enable_expert_parallel)
    ckpt = load_weights(spec, checkpoint, options)
    dtype = DTYPES[options.dtype]
    device = device_of(options)
    vocab = int(spec.model_config["vocab_size"])
    if importlib.util.find_spec("v41plan.exec.runtime_model") is not None:
        from v41plan.exec.paged_runner import PagedRunner

        return PagedRunner(spec, ckpt, options, dtype=dtype, device=device)
    from v41plan.exec.reference import ReferenceModel

    model = ReferenceModel.from_checkpoint(ckpt, dtype, device, index_cache_dtype=options.index_cache_dtype)
    return ReferenceRunner(model, vocab)
