"""Measure the device ceilings every benchmark figure is compared with.

Device copy bandwidth (read + write bytes counted), the bf16 matmul rate and the FP8 matmul rate
(``torch._scaled_mm``, E4M3 x E4M3 with row-wise fp32 scales, bf16 out: the rate of W8A8 and
W4A8 work), measured in the calling process so that ratios come from one run. Import
``measure_ceilings`` from other benchmarks; run this file alone to print them (JSON with the
tree's provenance).

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


def fp8_matmul_flop_per_s(n: int = 8192, iters: int = 20) -> float:
    """Dense FP8 ``n x n x n`` matmul rate: ``torch._scaled_mm`` of E4M3 operands (the second
    column-major) with row-wise fp32 scales ``[n, 1]`` and ``[1, n]``, bf16 output."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    sa = torch.rand(n, 1, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5

    def mm():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    seconds = _time_cuda(mm, iters)
    return 2 * n**3 / seconds


def measure_ceilings() -> dict:
    """The ceilings, in bytes/s and FLOP/s. ``fp8_flop_per_s`` is None (with ``fp8_error``)
    when the device or torch build has no FP8 matmul; floors then count FP8 work at the bf16
    rate and say so."""
    out: dict = {
        "copy_bytes_per_s": copy_bandwidth_bytes_per_s(),
        "bf16_flop_per_s": bf16_matmul_flop_per_s(),
    }
    try:
        out["fp8_flop_per_s"] = fp8_matmul_flop_per_s()
    except (RuntimeError, TypeError, AttributeError) as exc:
        out["fp8_flop_per_s"] = None
        out["fp8_error"] = f"{type(exc).__name__}: {exc}"
    return out


def ceilings_line(c: dict) -> str:
    """One printed line of the measured ceilings."""
    fp8 = c.get("fp8_flop_per_s")
    return (
        f"ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{c['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, fp8 "
        + (f"{fp8 / 1e12:.0f} TFLOP/s" if fp8 else f"not measured ({c.get('fp8_error')})")
    )


def main(argv: list[str] | None = None) -> int:
    """Print both ceilings (and write them as JSON to ``--out``); 2 without CUDA."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here (default: stdout only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ceilings.py: needs a CUDA device, and this machine has none", file=sys.stderr)
        return 2
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from v41plan.validation.provenance import provenance

    c = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"copy bandwidth : {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write)")
    print(f"bf16 matmul    : {c['bf16_flop_per_s'] / 1e12:.1f} TFLOP/s (8192^3)")
    fp8 = c["fp8_flop_per_s"]
    print(
        "fp8 matmul     : "
        + (f"{fp8 / 1e12:.1f} TFLOP/s (8192^3, row-wise scales)" if fp8 else c["fp8_error"])
    )
    report = {**c, "device": torch.cuda.get_device_name(), "provenance": provenance()}
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
