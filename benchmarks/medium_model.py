"""Shared set-up of the GPU benchmarks: the MEDIUM model in bf16, its floors, timing helpers.

Floors (``performance_method.md``): a figure's floor is ``max(bytes / copy bandwidth, FLOPs at
their rates)`` with every ceiling measured in the same process (``ceilings.py``). Two floors are
reported while the runtime holds dequantised bf16 weights:

- ``floor`` (shipped formats): weight bytes as the checkpoint ships them (``tensor_table``: FP8
  E4M3 dense weights with their E8M0 block scales, FP4 E2M1 routed experts with their E8M0 row
  scales, bf16 and fp32 tensors at their published size); W8A8 and W4A8 work (every FP8 or FP4
  linear but ``wo_a``, which the published model runs dequantised) at the FP8 GEMM rate, the rest
  at the bf16 rate; index scoring at the FP8 rate over the fp8 index plane;
- ``floor_bf16``: every parameter at 2 bytes (no scales) and every FLOP at the bf16 rate, the
  floor of the runtime as it runs today.

How bytes and FLOPs are counted (the work the model must do, not what this executor does), per
layer from the step plan's row sets (decoder replay cuts them):

- Weight bytes: each tensor a layer uses is read once when its sub-step runs any row: query,
  output and indexer-query weights on the attention rows, the window-KV projection on the
  ring-write rows, the compressor and index-key weights on the compress rows, the FFN on the FFN
  rows; routed experts only for the experts the layer's FFN rows can touch (expected distinct
  experts of ``rows * top_k`` uniform picks, at most all); the embedding rows of the batch and
  the whole LM head. Engram table rows (about 13 KB a token on medium) are not counted.
- Pool bytes (decode): per attention row its window rows (at the ring's row size) and, on
  compressed layers, its selected main rows (at the main plane's row size), plus the index rows
  its scorer reads (every visible compressed row of the owner's plane).
- FLOPs: ``2 * rows * parameters`` of every matrix on the rows that use it (routed experts:
  ``top_k`` of them per row), attention ``4 * heads * head_dim * keys`` per row (window keys
  from the row's floor, selected keys ``min(visible, index_topk)``), index scoring ``2 *
  index_heads * index_head_dim * visible rows`` per scoring row, and the LM head at the last
  rows. Published fp32 pieces (mHC, gate, head, ratio-2 compressor) count at the bf16 rate, a
  lower bound on their time.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

SPEC = Path(__file__).resolve().parents[1] / "specs" / "medium.yaml"


def load_spec(path: str | Path = SPEC):
    """A ``CacheSpec`` by name (``medium``, ``flash_slice``: the compiled package) or YAML path;
    the default is MEDIUM."""
    from v41plan.serving.engine import resolve_spec

    return resolve_spec("medium" if Path(path) == SPEC else str(path))


def load_weights(spec, checkpoint: str | None, seed: int = 0, resident: bool = False):
    """``(cfg, CUDA weights, Engram host, load report)`` from a checkpoint directory or the
    seeded random one: bf16 dequantised, or with ``resident`` as published (W8A8 linears, W4A8
    experts: the runtime's CUDA default). The report holds ``resident_bytes`` and
    ``checkpoint_bytes``."""
    from v41plan.model.checkpoint import LoadedCheckpoint, load_checkpoint, random_state
    from v41plan.model.config import config_from_cache_spec

    if checkpoint:
        ckpt = load_checkpoint(checkpoint, spec, dtype=None)
    else:
        cfg = config_from_cache_spec(spec)
        ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, seed))
    if resident:
        w = ckpt.process(torch.bfloat16, "cuda", resident=True)
    else:
        w = ckpt.process(torch.bfloat16, "cuda")
    return ckpt.config, w, ckpt.engram_host(), ckpt.report


def medium_report(spec, args, ceilings: dict, rows: list, **extra) -> dict:
    """The common head of a medium benchmark's report: provenance, device, torch, spec, compute
    and cache dtypes, the ceilings and the (still filling) ``rows``, then ``extra``."""
    from v41plan.validation.provenance import provenance

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    prov = provenance()
    return {
        "provenance": prov,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": prov.get("commit"),
        "spec": spec.name,
        "dtype": "bfloat16",
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "ceilings": ceilings,
        "rows": rows,
        **extra,
    }


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


def decode_requests(spec, max_bs: int, context: int, seed: int = 0):
    """``(block tables, token ids)`` of ``max_bs`` requests of ``context`` tokens (plus a few to
    decode): request ``i`` holds slot ``i`` and its own run of PAGEs."""
    import numpy as np

    need = -(-(context + 8) // spec.replay.hash_block_tokens)
    rng = np.random.default_rng(seed)
    tables = [tuple(range(i * need, (i + 1) * need)) for i in range(max_bs)]
    return tables, [rng.integers(0, 256, context + 4) for _ in range(max_bs)]


def prefill_to_context(m, spec, tables, ids, context: int, chunk: int = 8192) -> None:
    """Prefill every request fresh to ``context`` tokens, eagerly, ``chunk // context``
    requests a forward (decoder replay on)."""
    import numpy as np

    from v41plan.planner.step import RequestInput, StepInput, plan_step

    per_fwd = max(1, chunk // context)
    for lo in range(0, len(tables), per_fwd):
        group = range(lo, min(len(tables), lo + per_fwd))
        for i in group:
            m.pools.reset_slot(i)
        reqs = tuple(
            RequestInput(
                slot=i,
                block_table=tables[i],
                prompt_len=context,
                start=0,
                chunk_len=context,
                phase="prefill",
                fresh_slot=True,
            )
            for i in group
        )
        plan = plan_step(StepInput(reqs), spec, decoder_replay=True)
        m.forward(plan, np.concatenate([ids[i][:context] for i in group]))


def decode_step(m, spec, tables, ids, context: int, bs: int):
    """``(plan, token ids)`` of one decode step of the first ``bs`` requests at ``context``."""
    import numpy as np

    from v41plan.planner.step import RequestInput, StepInput, plan_step

    reqs = tuple(
        RequestInput(
            slot=i,
            block_table=tables[i],
            prompt_len=context,
            start=context,
            chunk_len=1,
            phase="decode",
        )
        for i in range(bs)
    )
    si = StepInput(reqs, running_bs=bs, running_tokens=bs, block_table_width=m.table_width)
    return plan_step(si, spec), np.array([ids[i][context] for i in range(bs)])


# ---- floors ------------------------------------------------------------------------------------
_ATTN = ("attn.wq_a", "attn.q_norm", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.attn_sink")
_ATTN += ("attn.indexer.wq_b", "attn.indexer.weights_proj")
_RING = ("attn.wkv", "attn.kv_norm")
_COMP = ("attn.compressor.", "attn.indexer.wk", "attn.indexer.k_norm")


def _sub_step(rest: str) -> str:
    """Which rows read a layer tensor (its name after ``layers.{i}.``)."""
    if rest.startswith(("ffn.", "hc_ffn_", "ffn_norm")):
        return "ffn"
    if rest.startswith(_COMP):
        return "compress"
    if rest.startswith(_RING):
        return "ring_write"
    if rest.startswith(_ATTN):
        return "attention"
    return "layer"  # mHC of the attention site, attn_norm, Engram: every row the layer runs


def layer_tensors(cfg) -> dict:
    """Per layer, per sub-step: ``[(name, shipped bytes, parameters, rate class)]`` from the
    published tensor table; ``"global"`` holds the embedding, final norm and LM head. Rate class:
    ``fp8`` (W8A8 / W4A8 matrices), ``bf16`` (other matrices), None (vectors and scales)."""
    from v41plan.model.checkpoint import tensor_table

    out: dict = {"global": [], "layers": {i.index: {} for i in cfg.layers}}
    for t in tensor_table(cfg):
        if t.kind in ("table", "table_scale"):
            continue  # Engram tables: a host-side gather
        n = 1
        for d in t.shape:
            n *= d
        params = 0 if t.kind.endswith("scale") else (2 * n if t.kind == "fp4" else n)
        if t.kind.endswith("scale") or len(t.shape) < 2:
            rate = None
        elif t.kind in ("fp8", "fp4") and ".wo_a." not in t.name:
            rate = "fp8"
        else:
            rate = "bf16"
        entry = (t.name, t.nbytes, params, rate)
        if not t.name.startswith("layers."):
            out["global"].append(entry)
            continue
        _, i, rest = t.name.split(".", 2)
        sub = "expert" if rest.startswith("ffn.experts.") else _sub_step(rest)
        out["layers"][int(i)].setdefault(sub, []).append(entry)
    return out


def expected_experts(tokens: int, top_k: int, experts: int) -> float:
    """Expected distinct experts of ``tokens`` independent uniform top-k picks."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def pool_row_bytes(geometry) -> dict[str, int]:
    """Row sizes a decode step reads: ``ring`` (window KV), ``main`` (compressed KV) and
    ``index`` (the index plane's row, 0 without one)."""
    ring = next(f for f in geometry.state_fields if f.name == "swa_rings")
    ring_row = ring.shape[-1] * (2 if ring.dtype == "bfloat16" else 1)
    main = next(p.row_bytes for p in geometry.planes if p.kind == "main")
    index = next((p.row_bytes for p in geometry.planes if p.kind != "main"), 0)
    return {"ring": ring_row, "main": main, "index": index}


def step_floor(cfg, plan, ceilings, *, rows: dict[str, int], index_cache_dtype: str) -> dict:
    """Bytes, FLOPs and both floors (seconds) of one planned forward (see the module docstring).

    ``rows`` is ``pool_row_bytes(geometry)``; ``ceilings`` holds ``copy_bytes_per_s``,
    ``bf16_flop_per_s`` and ``fp8_flop_per_s`` (None or absent: not measured, the FP8 work then
    counts at the bf16 rate and ``fp8_rate_measured`` is false).
    """
    import numpy as np

    tensors = layer_tensors(cfg)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    W, topk = cfg.sliding_window, cfg.index_topk
    decode = plan.graph_key[0] == "decode"
    total = int(plan.scheduled_tokens)
    pos = plan.positions[:total].astype(np.int64)
    bid = np.maximum(plan.batch_ids[:total], 0)
    shipped = bf16 = pool = 0
    flops = {"fp8": 0.0, "bf16": 0.0}

    def rows_of(layer: int, sub: str) -> np.ndarray:
        arr = plan.layer_rows.get((layer, sub))
        r = np.zeros(0, np.int64) if arr is None else np.asarray(arr, dtype=np.int64)
        return r[r < total]

    for info in cfg.layers:
        L = info.index
        sets = {s: rows_of(L, s) for s in ("ring_write", "compress", "attention", "ffn")}
        sets["layer"] = np.unique(np.concatenate(list(sets.values())))
        for sub, entries in tensors["layers"][L].items():
            if sub == "expert":
                n = len(sets["ffn"])
                if n == 0:
                    continue
                touched = min(E, expected_experts(n, k, E)) / E
                for _name, nbytes, params, rate in entries:
                    shipped += touched * nbytes
                    bf16 += touched * 2 * params
                    if rate:
                        flops[rate] += 2 * n * params * k / E
                continue
            n = len(sets[sub])
            if n == 0:
                continue
            for _name, nbytes, params, rate in entries:
                shipped += nbytes
                bf16 += 2 * params
                if rate:
                    flops[rate] += 2 * n * params
        at = sets["attention"]
        if len(at) == 0:
            continue
        p = pos[at]
        floor = (
            plan.swa_replay_start[bid[at]]
            if info.segment == "decoder"
            else plan.encoder_window_floor[bid[at]]
        )
        window = np.minimum(p + 1 - np.minimum(floor, p), W)
        keys = window.sum()
        if info.ratio:
            vis = (p + 1) // info.ratio
            keys += np.minimum(vis, topk).sum()
            if info.role in ("full", "reindex"):
                rate = "fp8" if index_cache_dtype == "fp8" else "bf16"
                flops[rate] += 2 * cfg.index_n_heads * cfg.index_head_dim * int(vis.sum())
                if decode:
                    pool += int(vis.sum()) * rows["index"]
            if decode:
                pool += int(np.minimum(vis, topk).sum()) * rows["main"]
        if decode:
            pool += int(window.sum()) * rows["ring"]
        flops["bf16"] += 4 * cfg.num_attention_heads * cfg.head_dim * int(keys)
    for name, nbytes, params, _rate in tensors["global"]:
        if name == "embed.weight":  # only the batch's rows
            nbytes, params = nbytes * total // cfg.vocab_size, params * total // cfg.vocab_size
        shipped += nbytes
        bf16 += 2 * params
    flops["bf16"] += 2 * cfg.vocab_size * cfg.hidden_size * plan.scheduled_bs  # LM head
    bw, r16 = ceilings["copy_bytes_per_s"], ceilings["bf16_flop_per_s"]
    r8 = ceilings.get("fp8_flop_per_s") or None
    t_bytes = (shipped + pool) / bw
    t_flops = flops["bf16"] / r16 + flops["fp8"] / (r8 or r16)
    t_bytes16 = (bf16 + pool) / bw
    t_flops16 = (flops["bf16"] + flops["fp8"]) / r16
    return {
        "bytes": int(shipped + pool),
        "weight_bytes": int(shipped),
        "pool_bytes": int(pool),
        "flops": int(flops["bf16"] + flops["fp8"]),
        "fp8_flops": int(flops["fp8"]),
        "floor_bytes_s": t_bytes,
        "floor_flops_s": t_flops,
        "floor_s": max(t_bytes, t_flops),
        "bound": "bytes" if t_bytes >= t_flops else "flops",
        "fp8_rate_measured": r8 is not None,
        "bf16_weight_bytes": int(bf16),
        "floor_bf16_bytes_s": t_bytes16,
        "floor_bf16_flops_s": t_flops16,
        "floor_bf16_s": max(t_bytes16, t_flops16),
        "bound_bf16": "bytes" if t_bytes16 >= t_flops16 else "flops",
    }
