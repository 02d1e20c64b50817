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

from v41plan.cli.args import Refused

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

# NAME -> (script, one-line description); "(CUDA)" marks the ones refused on a CPU machine
BENCHMARKS: dict[str, tuple[str, str]] = {
    "plan_step": (
        "bench_plan_step.py",
        "plan_step medians: 256-request decode, 16 x 512 ragged prefill (CPU)",
    ),
    "decode": (
        "bench_decode.py",
        "decode step eager vs FULL graph at batch 1/8/64 on MEDIUM (CUDA)",
    ),
    "decode_paths": (
        "bench_decode_paths.py",
        "decode step per kernel path (reference ... resident weights, level 3) on MEDIUM (CUDA)",
    ),
    "startup": (
        "bench_startup.py",
        "engine start: build, warm-up (level 3 compiles there), capture; caches cold and warm",
    ),
    "prefill": ("bench_prefill.py", "8K-token prefill, decoder replay on vs off, on MEDIUM (CUDA)"),
    "serve": (
        "bench_serve.py",
        "open-loop load on the OpenAI server: throughput, TTFT, ITL, prefix hits",
    ),
    "ceilings": ("ceilings.py", "device copy bandwidth and bf16 matmul rate (CUDA)"),
    "gemm_moe": (
        "bench_gemm_moe.py",
        "W8A8 linear and grouped W4A8 MoE at flash_slice widths vs floors and peers (CUDA)",
    ),
    "dense_kernels": (
        "bench_dense_kernels.py",
        "fused mHC site / expand / FP8 quant vs eager and compiled torch, per site (CUDA)",
    ),
    "decode_tiles": (
        "sweep_decode_tiles.py",
        "tile sweep of the decode step's mHC site, W8A8 linears and grouped MoE (CUDA)",
    ),
    "site": (
        "probe_site.py",
        "where the decode mHC site's time goes: its parts taken away one by one (CUDA)",
    ),
    "rope_wo_a": (
        "probe_rope_wo_a.py",
        "the fused output projection (inverse RoPE + grouped wo_a) tiles vs its composition (CUDA)",
    ),
    "kernels": (
        "bench_kernels.py",
        "Triton backend kernels against their floors and in-image peers (CUDA)",
    ),
    "replay_deviation": (
        "replay_deviation.py",
        "decoder-replay logit deviation against a full prefill (CPU)",
    ),
}


def needs_cuda(name: str) -> bool:
    """True for a benchmark that runs only on a CUDA device."""
    return BENCHMARKS[name][1].endswith("(CUDA)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``v41plan bench``."""
    names = "\n".join(f"  {k:17s} {v[1]}" for k, v in BENCHMARKS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        f"Run a benchmark from benchmarks/.\n\nbenchmarks:\n{names}\n\n"
        f"`v41plan bench NAME --help` shows a benchmark's own options."
    )
    parser.add_argument(
        "name", choices=sorted(BENCHMARKS), help="which benchmark, one of %(choices)s"
    )
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the benchmark (default: none)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark script as ``__main__`` with its own arguments."""
    script = BENCH_DIR / BENCHMARKS[args.name][0]
    if not script.exists():
        raise Refused(
            f"{args.name}: {script} not found: benchmarks ship with a source checkout "
            f"(run from a clone of the repository)"
        )
    asks_help = any(a in ("-h", "--help") for a in args.args)
    if needs_cuda(args.name) and not asks_help:
        import torch

        if not torch.cuda.is_available():
            cpu = ", ".join(k for k in sorted(BENCHMARKS) if not needs_cuda(k))
            raise Refused(
                f"{args.name}: needs a CUDA device, and this machine has none "
                f"(CPU benchmarks: {cpu})"
            )
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(BENCH_DIR))  # benchmarks import their neighbours (ceilings.py, ...)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(f"v41plan bench {args.name}: {exc.code}", file=sys.stderr)
        return 1
    return 0
