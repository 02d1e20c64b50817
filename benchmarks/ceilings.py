"""Measure the two device ceilings every benchmark figure is compared with.

Device copy bandwidth (read + write bytes counted) and the bf16 matmul rate, measured in the
calling process so that ratios come from one run. Import ``measure_ceilings`` from other
benchmarks; run this file alone to print both.

    python benchmarks/ceilings.py [--out ceilings.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _time_cuda(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy rate of a large buffer, read and write bytes both counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    seconds = _time_cuda(lambda: dst.copy_(src), iters)
    src = dst = None  # release both buffers before emptying the cache
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def bf16_matmul_flop_per_s(n: int = 8192, iters: int = 20) -> float:
    """Dense bf16 ``n x n x n`` matmul rate on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    seconds = _time_cuda(lambda: a @ b, iters)
    return 2 * n**3 / seconds


def measure_ceilings() -> dict[str, float]:
    """Both ceilings, in bytes/s and FLOP/s."""
    return {
        "copy_bytes_per_s": copy_bandwidth_bytes_per_s(),
        "bf16_flop_per_s": bf16_matmul_flop_per_s(),
    }


def main(argv: list[str] | None = None) -> int:
    """Print both ceilings (and write them as JSON to ``--out``); 2 without CUDA."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here (default: stdout only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ceilings.py: needs a CUDA device, and this machine has none", file=sys.stderr)
        return 2
    c = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"copy bandwidth : {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write)")
    print(f"bf16 matmul    : {c['bf16_flop_per_s'] / 1e12:.1f} TFLOP/s (8192^3)")
    print(json.dumps(c))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(c, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
