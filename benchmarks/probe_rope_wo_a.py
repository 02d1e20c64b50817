"""The output projection's inverse RoPE + grouped ``wo_a``: the fused kernel's tiles against
the composition (RoPE kernels and the cuBLAS grouped product), MEDIUM widths, on one GPU.

    python3 benchmarks/probe_rope_wo_a.py [--rows 1,8,64] [--out F]

Per row count: the composition (``dense_ref.rope_wo_a``) and every ``(BR, BK, warps, stages)``
of ``TILES`` (``triton_dense._launch_rope_wo_a``), each timed as CUDA-graph replays, with
``floor_ms`` (the weight and rows over the copy bandwidth measured here) and ``of_floor``.
Writes JSON (``$OUT/probe_rope_wo_a.json`` or ``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_moe import time_ms
from ceilings import copy_bandwidth_bytes_per_s
from report_io import write_report

TILES = list(itertools.product((16, 32), (256, 512), (4, 8), (2, 3)))
"""The swept ``(BR, BK, warps, stages)``."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_rope_wo_a.py: needs a CUDA device", file=sys.stderr)
        return 2
    from v41plan.runtime.kernels import dense_ref
    from v41plan.runtime.kernels import triton_dense as td

    bw = copy_bandwidth_bytes_per_s(1 << 29, 10)
    h, d, groups, r, rd = 16, 512, 4, 256, 64
    rows = []
    wo_a = torch.randn(groups * r, h * d // groups, device="cuda").bfloat16() * 0.02
    for n in [int(x) for x in args.rows.split(",")]:
        o = torch.randn(n, h, d, device="cuda").bfloat16()
        ang = torch.rand(n, rd // 2, device="cuda")
        cos, sin = torch.cos(ang), torch.sin(ang)
        floor = (wo_a.numel() * 2 + o.numel() * 2 + n * groups * r * 2) / bw
        ref = dense_ref.rope_wo_a(o, cos, sin, wo_a, groups).float()
        ms, how = time_ms(
            lambda o=o, cos=cos, sin=sin: dense_ref.rope_wo_a(o, cos, sin, wo_a, groups)
        )
        rows.append({"rows": n, "form": "composition", "ms": ms, "how": how,
                     "floor_ms": floor * 1e3, "of_floor": floor * 1e3 / ms})  # fmt: skip
        print(f"{n:>4} composition {ms * 1e3:8.1f} us", flush=True)
        for tiles in TILES:

            def fn(o=o, cos=cos, sin=sin, tiles=tiles):
                return td._launch_rope_wo_a(o, cos, sin, wo_a, groups, tiles)

            try:
                got = fn().float()
                err = float((got - ref).norm() / ref.norm())
                ms, how = time_ms(fn)
            except Exception as exc:  # noqa: BLE001 - a tile over the resources is a row
                rows.append({"rows": n, "form": "kernel", "tiles": tiles, "error": str(exc)[:80]})
                continue
            rows.append({"rows": n, "form": "kernel", "tiles": tiles, "ms": ms, "how": how,
                         "rel_l2": err, "floor_ms": floor * 1e3,
                         "of_floor": floor * 1e3 / ms})  # fmt: skip
        best = sorted((x for x in rows if x["rows"] == n and "ms" in x and x["form"] == "kernel"),
                      key=lambda x: x["ms"])[:3]  # fmt: skip
        for b in best:
            print(f"{n:>4} kernel {b['tiles']} {b['ms'] * 1e3:8.1f} us rel {b['rel_l2']:.1e}")
    from v41plan.validation.provenance import provenance

    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(),
        "spec": "medium",
        "copy_bytes_per_s": bw,
        "shape": {"heads": h, "head_dim": d, "groups": groups, "rank": r},
        "rows": rows,
    }
    write_report(report, args.out, "probe_rope_wo_a.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
