"""Where an eager engine step's time goes on the device: launches, copies, syncs, top ops.

    python3 scripts/gpu_profile_step.py [--spec specs/tiny40.yaml] [--dtype float64] [--out F]

Builds an eager engine (and, with ``--graph``, a FULL-graph one, timing its build), runs the
same greedy batch with the Engram lookup on the device and on the host, and profiles one run
with the torch profiler: the counts of kernel launches, host<->device copies and stream
syncs, and the ops with the most host time. Prints a short table; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

_RUNTIME_CALLS = ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
                  "cudaDeviceSynchronize", "cudaMemsetAsync", "cudaGraphLaunch")  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batch(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(40 + 17 * i)] for i in range(4)]


def profile_engine(llm: LLM, label: str, out_tokens: int) -> dict:
    """Times one greedy batch twice (the first warms up), then profiles a third run."""
    prompts = _batch(llm.vocab_size)
    sp = SamplingParams(max_tokens=out_tokens, temperature=0.0)
    llm.generate(prompts, sp)
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    _sync()
    wall_s = time.perf_counter() - t0
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate(prompts, sp)
        _sync()
    ev = prof.key_averages()
    calls = {k: 0 for k in _RUNTIME_CALLS}
    for e in ev:
        if e.key in calls:
            calls[e.key] += e.count
    aten = sorted(
        (e for e in ev if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total
    )
    top = [{"op": e.key, "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1)}
           for e in aten[:12]]  # fmt: skip
    cuda_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in ev) / 1e3
    row = {"label": label, "wall_s": round(wall_s, 3), "device_busy_ms": round(cuda_ms, 1),
           "aten_calls": sum(e.count for e in ev if e.key.startswith("aten::")), **calls,
           "top_host_ops": top}  # fmt: skip
    print(f"{label:28s} wall {wall_s:7.3f} s  device {cuda_ms:8.1f} ms  "
          + "  ".join(f"{k.removeprefix('cuda')} {v}" for k, v in calls.items()))  # fmt: skip
    for t in top[:8]:
        print(f"    {t['op']:36s} {t['count']:7d} {t['self_cpu_ms']:9.1f} ms")
    return row


def main(argv: list[str] | None = None) -> int:
    """Profiles the configurations and writes the JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/tiny40.yaml")
    ap.add_argument("--dtype", default="float64")
    # 6 tokens took the whole 200 s profile step on the H200 (the CUDA profiler over about
    # 170,000 launches of one engine); 2 keep both engines within it
    ap.add_argument("--out-tokens", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for on_device in (True, False):
        t0 = time.perf_counter()
        llm = LLM(args.spec, dtype=args.dtype, device=args.device, max_num_seqs=4)
        if not on_device:
            llm.runner.model.engram_device = None  # before any step: the host half stages rows
        build_s = time.perf_counter() - t0
        row = profile_engine(llm, f"eager engram_dev={on_device}", args.out_tokens)
        row["build_s"] = round(build_s, 2)
        rows.append(row)
        del llm
    if args.graph:
        t0 = time.perf_counter()
        llm = LLM(args.spec, dtype=args.dtype, device=args.device, max_num_seqs=4,
                  enforce_eager=False, cudagraph_mode="FULL")  # fmt: skip
        build_s = time.perf_counter() - t0
        print(f"FULL-graph engine built in {build_s:.1f} s")
        row = profile_engine(llm, "graph FULL", args.out_tokens)
        row["build_s"] = round(build_s, 2)
        rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        report = {"spec": args.spec, "dtype": args.dtype, "torch": torch.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
