"""Engine start time on CUDA: weights, warm-up (at level 3 the dense pieces compile there) and
graph capture, with Inductor's and Triton's on-disk caches cold and then warm.

    python3 benchmarks/bench_startup.py [--checkpoint DIR] [--spec medium] [--max-num-seqs 8]
        [--levels 3,0] [--out report.json]

Each row is one fresh process building ``LLM(spec, checkpoint, FULL graphs,
compilation_level=L)`` and generating a few tokens. Level 3 runs twice over one cache directory
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``, made empty first): the first start is
cold, the second finds every graph and kernel compiled. A start has no floor: rows carry
``of_floor: null``. Writes ``$OUT/bench_startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(args) -> int:
    """Build the engine once and print its start figures as one JSON line."""
    import torch

    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.spec, args.checkpoint, device="cuda", dtype="bfloat16", enforce_eager=False,
        cudagraph_mode="FULL", max_num_seqs=args.max_num_seqs, compilation_level=args.level,
    )  # fmt: skip
    start_s = time.perf_counter() - t0
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    row = {
        "level": args.level,
        "start_s": start_s,
        **llm.runner.startup,
        "kernels": llm.runner.kernels,
        "generated": len(out[0].outputs[0].token_ids),
        "error": out[0].error,
    }
    print("STARTUP " + json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="default: seeded random weights")
    ap.add_argument("--spec", default="medium")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--levels", default="3,0", help="compilation levels to start with")
    ap.add_argument("--level", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_startup.py: needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    from report_io import write_report

    from v41plan.validation.provenance import provenance

    rows: list[dict] = []
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(),
        "spec": args.spec,
        "max_num_seqs": args.max_num_seqs,
        "rows": rows,
    }
    cache = tempfile.mkdtemp(prefix="v41plan_compile_cache_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache + "/triton"}
    runs = []
    for level in (int(x) for x in args.levels.split(",") if x):
        runs += [(level, "cold"), (level, "warm")] if level == 3 else [(level, "warm")]
    print(f"{'level':>5} {'cache':>5} {'start s':>8} {'build s':>8} {'warm-up s':>9} "
          f"{'capture s':>9} {'graphs':>6}")  # fmt: skip
    for level, state in runs:
        cmd = [sys.executable, __file__, "--child", "--spec", args.spec,
               "--max-num-seqs", str(args.max_num_seqs), "--level", str(level)]  # fmt: skip
        if args.checkpoint:
            cmd += ["--checkpoint", args.checkpoint]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
        line = next((x for x in res.stdout.splitlines() if x.startswith("STARTUP ")), None)
        if line is None:
            print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
            report.setdefault("failed", []).append({"level": level, "cache": state})
            continue
        row = {**json.loads(line[8:]), "cache": state, "process_s": time.perf_counter() - t0}
        row["of_floor"] = None
        rows.append(row)
        print(f"{level:>5} {state:>5} {row['start_s']:>8.1f} {row['build_s']:>8.1f} "
              f"{row.get('warmup_s', 0):>9.1f} {row.get('capture_s', 0):>9.1f} "
              f"{row.get('compiled_graphs', 0):>6}", flush=True)  # fmt: skip
        write_report(report, args.out, "bench_startup.json")
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
