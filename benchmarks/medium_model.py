"""Shared set-up of the GPU benchmarks: the MEDIUM model in bf16, its floors, timing helpers.

Floors (``performance_method.md``): a figure's floor is ``max(bytes / copy bandwidth, FLOPs /
bf16 matmul rate)`` with both ceilings measured in the same process (``ceilings.py``).

How bytes and FLOPs are counted (the work the model must do, not what this executor does):

- Weight bytes: every device weight the step uses, read once, at its bf16 compute size;
  routed experts only for the experts the batch can touch (expected distinct experts of
  ``tokens * top_k`` uniform picks, at most all of them); the embedding and LM head rows of
  the batch only for the embedding, the whole LM head.
- Pool bytes (decode): per request and layer the ``W`` window rows and, on compressed layers,
  the ``index_topk`` selected main rows (head_dim each, at the pool's row size), plus the index
  rows its scorer reads (every visible compressed row of the owner's plane).
- FLOPs: ``2 * rows * active parameters`` per layer (attention projections, shared expert,
  ``top_k`` routed experts), plus attention ``4 * heads * head_dim * (W + topk)`` per row and
  index scoring ``2 * index_heads * index_head_dim * visible rows`` per scoring row; rows per
  layer come from the step plan (decoder replay cuts them).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

SPEC = Path(__file__).resolve().parents[1] / "specs" / "medium.yaml"


def load_spec(path: str | Path = SPEC):
    """The MEDIUM ``CacheSpec`` (compiled package when present, else the YAML)."""
    from v41plan.serving.engine import resolve_spec

    return resolve_spec("medium" if Path(path) == SPEC else str(path))


def load_weights(spec, checkpoint: str | None, seed: int = 0):
    """``(cfg, bf16 CUDA weights, Engram host)`` from a checkpoint directory or the seeded random
    one."""
    from v41plan.model.checkpoint import LoadedCheckpoint, load_checkpoint, random_state
    from v41plan.model.config import config_from_cache_spec

    if checkpoint:
        ckpt = load_checkpoint(checkpoint, spec, dtype=None)
    else:
        cfg = config_from_cache_spec(spec)
        ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, seed))
    w = ckpt.process(torch.bfloat16, "cuda")
    return ckpt.config, w, ckpt.engram_host()


def time_host(fn, iters: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn(); torch.cuda.synchronize()`` (host-bound work included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_device(fn, iters: int, warmup: int = 2) -> float:
    """Median device seconds of ``fn`` between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


# ---- floors ------------------------------------------------------------------------------------
def weight_groups(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Parameter counts by role: routed experts, embedding, head, the rest (per-layer dense)."""
    out = {"routed": 0, "embed": 0, "head": 0, "dense": 0}
    for name, t in weights.items():
        if ".ffn.experts." in name:
            out["routed"] += t.numel()
        elif name == "embed.weight":
            out["embed"] += t.numel()
        elif name == "head.weight":
            out["head"] += t.numel()
        else:
            out["dense"] += t.numel()
    return out


def expected_experts(tokens: int, top_k: int, experts: int) -> float:
    """Expected distinct experts of ``tokens`` independent uniform top-k picks."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def step_floor(cfg, weights, plan, ceilings, *, kv_row_bytes: int, index_row_bytes: int) -> dict:
    """Bytes, FLOPs and the floor (seconds) of one planned forward (see the module docstring)."""
    import numpy as np

    g = weight_groups(weights)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    n_layers = len(cfg.layers)
    per_expert = g["routed"] / (E * n_layers)
    rows_total = int(plan.scheduled_tokens)
    experts_read = min(E, expected_experts(rows_total, k, E))
    weight_bytes = 2 * (
        g["dense"] + g["head"] + experts_read * per_expert * n_layers + rows_total * cfg.hidden_size
    )
    dense_per_layer = g["dense"] / n_layers
    flops = 2 * cfg.vocab_size * cfg.hidden_size * plan.scheduled_bs  # LM head at the last rows
    pool_bytes = 0
    decode = plan.graph_key[0] == "decode"
    W, topk = cfg.sliding_window, cfg.index_topk
    pos = plan.positions.astype(np.int64)
    for info in cfg.layers:
        rows = np.asarray(
            plan.layer_rows.get((info.index, "attention"), np.zeros(0, np.int64)), dtype=np.int64
        )
        rows = rows[rows < rows_total]
        n = len(rows)
        flops += 2 * n * (dense_per_layer + k * per_expert)
        flops += 4 * cfg.num_attention_heads * cfg.head_dim * (W + (topk if info.ratio else 0)) * n
        if info.ratio and info.role in ("full", "reindex"):
            vis = int(((pos[rows] + 1) // info.ratio).sum())
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * vis
            if decode:
                pool_bytes += vis * index_row_bytes
        if decode:
            window = np.minimum(pos[rows] + 1, W).sum()
            sel = np.minimum((pos[rows] + 1) // info.ratio, topk).sum() if info.ratio else 0
            pool_bytes += int(window + sel) * kv_row_bytes
    total_bytes = weight_bytes + pool_bytes
    t_bytes = total_bytes / ceilings["copy_bytes_per_s"]
    t_flops = flops / ceilings["bf16_flop_per_s"]
    return {
        "bytes": int(total_bytes),
        "weight_bytes": int(weight_bytes),
        "pool_bytes": int(pool_bytes),
        "flops": int(flops),
        "floor_bytes_s": t_bytes,
        "floor_flops_s": t_flops,
        "floor_s": max(t_bytes, t_flops),
        "bound": "bytes" if t_bytes >= t_flops else "flops",
    }
