"""``v41plan bench NAME [ARGS ...]``: run one of the checkout's ``benchmarks/`` scripts.

The benchmarks live beside the package in a source checkout (they are not installed); this
command finds them there and runs the chosen one with the remaining arguments, so
``v41plan bench plan_step`` is ``python benchmarks/bench_plan_step.py``.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

# NAME -> (script, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "plan_step": (
        "bench_plan_step.py",
        "plan_step medians: 256-request decode, 16 x 512 ragged prefill (CPU)",
    ),
    "decode": (
        "bench_decode.py",
        "decode step eager vs FULL graph at batch 1/8/64 on MEDIUM (CUDA)",
    ),
    "prefill": ("bench_prefill.py", "8K-token prefill, decoder replay on vs off, on MEDIUM (CUDA)"),
    "ceilings": ("ceilings.py", "device copy bandwidth and bf16 matmul rate (CUDA)"),
    "kernels": (
        "bench_kernels.py",
        "Triton backend kernels against their floors and in-image peers (CUDA)",
    ),
    "replay_deviation": (
        "replay_deviation.py",
        "decoder-replay logit deviation against a full prefill (CPU)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``v41plan bench``."""
    names = "\n".join(f"  {k:17s} {v[1]}" for k, v in BENCHMARKS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = f"Run a benchmark from benchmarks/.\n\nbenchmarks:\n{names}"
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark script as ``__main__`` with its own arguments."""
    script = BENCH_DIR / BENCHMARKS[args.name][0]
    if not script.exists():
        print(
            f"v41plan bench: {script} not found: benchmarks ship with a source checkout "
            f"(run from a clone of the repository)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(BENCH_DIR))  # benchmarks import their neighbours (ceilings.py, ...)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
