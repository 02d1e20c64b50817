"""The split-K W8A8 linear's end: a second launch (``_split_sum_kernel``) against the tile's
last split summing in the same launch (``SPLIT_ONE_LAUNCH``), at decode rows and flash_slice
widths, each timed by CUDA-graph replay in the same process; bits compared.

    python3 benchmarks/probe_split_launch.py [--out FILE]

Prints a table and writes JSON (``device``, ``torch``, ``triton``, ``commit``, ``spec``,
``ceilings``, rows with ``ms`` per form, ``equal``, ``floor_ms`` (weight and row bytes at the
copy bandwidth measured here) and ``of_floor`` of the one-launch form)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_moe import _fp8_weight, time_ms
from ceilings import copy_bandwidth_bytes_per_s
from report_io import write_report

SHAPES = {"wq_a": (1280, 5120), "wkv": (512, 5120), "wo_b": (5120, 8192), "shared.w2": (5120, 2304)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from v41plan.runtime.kernels import triton_gemm as tg
    from v41plan.validation.provenance import provenance

    bw = copy_bandwidth_bytes_per_s()
    shipped = tg.SPLIT_ONE_LAUNCH
    rows = []
    for name, (N, K) in SHAPES.items():
        wc, ws = _fp8_weight(N, K)
        for M in (1, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            r = {"name": name, "M": M, "N": N, "K": K}
            outs = {}
            for one in (False, True):
                tg.SPLIT_ONE_LAUNCH = one
                outs[one] = tg.w8a8_linear(x, wc, ws)
                r["one_launch_ms" if one else "two_launch_ms"] = time_ms(
                    lambda x=x, wc=wc, ws=ws: tg.w8a8_linear(x, wc, ws)
                )[0]
            tg.SPLIT_ONE_LAUNCH = shipped
            r["equal"] = bool(torch.equal(outs[False], outs[True]))
            r["split_k"] = tg.default_config(M, N, K, "fp8").split_k
            nbytes = N * K + (N // 32) * (K // 32) + M * (N + K) * 2
            r["floor_ms"] = nbytes / bw * 1e3
            r["ms"] = r["one_launch_ms"]
            r["of_floor"] = r["floor_ms"] / r["ms"]
            rows.append(r)
            print(
                f"{name:10} M={M:3} split {r['split_k']:2}  two launches "
                f"{r['two_launch_ms'] * 1e3:7.1f} us  one {r['one_launch_ms'] * 1e3:7.1f} us  "
                f"of_floor {r['of_floor']:.3f}  equal {r['equal']}"
            )
    report = {
        "device": torch.cuda.get_device_name(),
        "spec": "flash_slice widths",
        "ceilings": {"copy_bytes_per_s": bw},
        "provenance": provenance(),
        "rows": rows,
    }
    write_report(report, args.out, "probe_split_launch.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
