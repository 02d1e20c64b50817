"""Decode step time on the MEDIUM model (bf16): eager vs FULL CUDA graph, at batch 1, 8 and 64.

    python3 benchmarks/bench_decode.py [--checkpoint DIR] [--context 512] [--out report.json]

Each batch size runs ``bs`` requests prefilled to ``--context`` tokens, then times the same
decode step (every request one token) three ways: eager ``RuntimeModel.forward`` (host work
included), a FULL graph step (host preparation + one replay) and the replay alone on device
events. Both ceilings are measured in this process; each figure is given with its floor
(``medium_model.step_floor``: bytes / copy bandwidth vs FLOPs / bf16 rate, the larger) and as
``floor / measured``. Writes JSON to ``--out`` (``$OUT/bench_decode.json`` on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import measure_ceilings
from medium_model import load_spec, load_weights, step_floor, time_device, time_host


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkpoint", default=None, help="checkpoint directory (default: seeded random weights)"
    )
    ap.add_argument(
        "--context", type=int, default=256, help="tokens each request holds before the timed step"
    )
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode.py: needs a CUDA device, and this machine has none", file=sys.stderr)
        return 2
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime.graphs import GraphRunner, capture_buckets
    from v41plan.runtime.paged_model import RuntimeModel

    ceil = measure_ceilings()
    spec = load_spec()
    cfg, weights, engram = load_weights(spec, args.checkpoint)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    P = spec.replay.hash_block_tokens
    need = -(-(args.context + 8) // P)
    chunk = 8192
    m = RuntimeModel(
        spec,
        weights,
        engram,
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        num_pages=max_bs * need + 8,
        num_slots=max_bs,
        max_tokens=max(chunk, max_bs),
        max_bs=max_bs,
        table_width=need + 1,
        dtype=torch.bfloat16,
        device="cuda",
        cfg=cfg,
    )
    geom = m.geometry
    kv_row_bytes = next(p.row_bytes for p in geom.planes if p.kind == "main")
    index_row_bytes = next((p.row_bytes for p in geom.planes if p.kind != "main"), 0)
    runner = GraphRunner(
        m, spec, [b for b in capture_buckets(spec, max_bs, max_bs) if b[0] in sizes], "FULL"
    )
    capture = runner.capture()

    rng = np.random.default_rng(0)
    reqs = [(i, tuple(range(i * need, (i + 1) * need))) for i in range(max_bs)]
    ids = [rng.integers(0, 256, args.context + 4) for _ in range(max_bs)]
    per_fwd = max(1, chunk // args.context)
    for lo in range(0, max_bs, per_fwd):  # prefill every request to the context (eager)
        group = range(lo, min(max_bs, lo + per_fwd))
        for i in group:
            m.pools.reset_slot(i)
        plan = plan_step(
            StepInput(
                tuple(
                    RequestInput(
                        slot=i,
                        block_table=reqs[i][1],
                        prompt_len=args.context,
                        start=0,
                        chunk_len=args.context,
                        phase="prefill",
                        fresh_slot=True,
                    )
                    for i in group
                )
            ),
            spec,
            decoder_replay=True,
        )
        m.forward(plan, np.concatenate([ids[i][: args.context] for i in group]))
    torch.cuda.synchronize()

    rows = []
    for bs in sizes:
        step = StepInput(
            tuple(
                RequestInput(
                    slot=i,
                    block_table=reqs[i][1],
                    prompt_len=args.context,
                    start=args.context,
                    chunk_len=1,
                    phase="decode",
                )
                for i in range(bs)
            ),
            running_bs=bs,
            running_tokens=bs,
            block_table_width=m.buf.block_tables.shape[1],
        )
        plan = plan_step(step, spec)
        tok = np.array([ids[i][args.context] for i in range(bs)])
        snap = m.pools.backing.clone()  # both paths run the step from the same pool state
        want = m.forward(plan, tok).logits.float()
        m.pools.backing.copy_(snap)
        got = runner.replay(plan, tok).float()
        m.pools.backing.copy_(snap)
        del snap
        same = bool(torch.equal(want.argmax(-1), got.argmax(-1)))
        max_diff = (want - got).abs().max().item()
        eager_s = time_host(lambda plan=plan, tok=tok: m.forward(plan, tok), args.iters)
        graph_s = time_host(lambda plan=plan, tok=tok: runner.replay(plan, tok), args.iters)
        g = runner.graphs[(bs, 1)]
        replay_s = time_device(g.replay, args.iters)
        fl = step_floor(
            cfg, weights, plan, ceil, kv_row_bytes=kv_row_bytes, index_row_bytes=index_row_bytes
        )
        rows.append(
            {
                "batch": bs,
                "context": args.context,
                "eager_ms": eager_s * 1e3,
                "graph_step_ms": graph_s * 1e3,
                "replay_ms": replay_s * 1e3,
                "speedup_step": eager_s / graph_s,
                "speedup_replay": eager_s / replay_s,
                "tokens_equal": same,
                "max_logit_diff": max_diff,
                **fl,
                "floor_ms": fl["floor_s"] * 1e3,
                "eager_of_floor": fl["floor_s"] / eager_s,
                "graph_step_of_floor": fl["floor_s"] / graph_s,
                "replay_of_floor": fl["floor_s"] / replay_s,
            }
        )

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "spec": spec.name,
        "dtype": "bfloat16",
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "ceilings": ceil,
        "capture": capture,
        "rows": rows,
    }
    print(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'bs':>4} {'eager ms':>9} {'graph ms':>9} {'replay ms':>9} {'x step':>7} {'x replay':>8} "
        f"{'floor ms':>9} {'bound':>6} {'eager/fl':>8} {'replay/fl':>9} tokens="
    )
    for r in rows:
        print(
            f"{r['batch']:>4} {r['eager_ms']:>9.2f} {r['graph_step_ms']:>9.2f} "
            f"{r['replay_ms']:>9.2f} "
            f"{r['speedup_step']:>7.1f} {r['speedup_replay']:>8.1f} {r['floor_ms']:>9.3f} "
            f"{r['bound']:>6} "
            f"{r['eager_of_floor']:>8.3f} {r['replay_of_floor']:>9.3f} {r['tokens_equal']}"
        )
    out = args.out or (
        os.path.join(os.environ["OUT"], "bench_decode.json") if os.environ.get("OUT") else None
    )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
