"""Building the engine's runner: weights, device, then the paged runner.

``build_runner(spec, checkpoint, options)`` loads a checkpoint directory (its config checked
against the spec before any weight is read) or, with no checkpoint, builds the spec's seeded
random checkpoint in memory, and wraps it in ``PagedRunner`` (the executor's runtime model
over PAGE/STATE pools).
"""

from __future__ import annotations

import torch

from v41plan.exec.admission import EngineOptions
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


def build_runner(spec: CacheSpec, checkpoint: str | None, options: EngineOptions):
    """The engine's paged runner for ``spec`` (weights loaded here, after admission)."""
    from v41plan.exec.paged_runner import PagedRunner
    from v41plan.exec.tp import check_tp

    # tensor-parallel splits are refused before any weight loads
    check_tp(spec.model_config, options.tensor_parallel_size, options.enable_expert_parallel)
    ckpt = load_weights(spec, checkpoint, options)
    return PagedRunner(spec, ckpt, options, dtype=DTYPES[options.dtype], device=device_of(options))
