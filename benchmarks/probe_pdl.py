"""Programmatic dependent launch on a decode-shaped chain of W8A8 linears, on one GPU.

    python3 benchmarks/probe_pdl.py [--rows 1,64] [--layers 40] [--out F]

Each layer runs flash_slice's five W8A8 linears at decode shapes (``wq_a``, ``wq_b``, ``wkv``,
``wo_b``, the shared expert's ``w2``), each behind its activation quantizer, with its own
weights (nothing stays in L2 between layers): 400 launches a replay at 40 layers, the pattern
of the decode step's linears. One CUDA graph per ``triton_common.PDL_MODES`` entry (off, on),
with ``PDL_MAX_ROWS`` raised to the row count so that every row count is timed both ways, timed
by replays; the "on" outputs are compared bit for bit with the "off" graph's. Rows: ``ms``,
``floor_ms`` (the weights' bytes over the copy rate measured here), ``of_floor``; writes JSON
(``$OUT/probe_pdl.json`` or ``--out``).
"""

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

SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192)}
SHAPES["w2"] = (5120, 2304)
"""``[N, K]`` of each linear at flash_slice widths."""


def chain(weights: list[dict], inputs: dict[str, torch.Tensor]):
    """One replayable step: every layer's linears, ``wq_b`` reading ``wq_a``'s output; returns
    the last layer's outputs."""
    from v41plan.runtime.kernels.triton_gemm import w8a8_linear

    def run():
        out = {}
        for w in weights:
            qa = w8a8_linear(inputs["x"], *w["wq_a"], torch.bfloat16)
            out["q"] = w8a8_linear(qa, *w["wq_b"], torch.bfloat16)
            out["kv"] = w8a8_linear(inputs["x"], *w["wkv"], torch.bfloat16)
            out["o"] = w8a8_linear(inputs["o"], *w["wo_b"], torch.bfloat16)
            out["y"] = w8a8_linear(inputs["h"], *w["w2"], torch.bfloat16)
        return out

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl.py needs a CUDA device", file=sys.stderr)
        return 2
    from v41plan.runtime.kernels import triton_common as tc
    from v41plan.validation.provenance import provenance

    bw = copy_bandwidth_bytes_per_s()
    weights = [{k: _fp8_weight(n, kk) for k, (n, kk) in SHAPES.items()} for _ in range(args.layers)]
    wbytes = sum(c.numel() + s.numel() for w in weights for c, s in w.values())
    rows: list[dict] = []
    saved = tc.PDL, tc.PDL_MAX_ROWS
    print(f"{'rows':>4} {'mode':>9} {'ms':>8} {'floor':>7} {'of_floor':>8}  same bits")
    try:
        for m in [int(r) for r in args.rows.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(m)
            inputs = {
                k: torch.randn(m, d, generator=g, device="cuda").to(torch.bfloat16)
                for k, d in (("x", 5120), ("o", 8192), ("h", 2304))
            }
            ref = None
            for mode in tc.PDL_MODES:
                tc.PDL, tc.PDL_MAX_ROWS = mode, max(m, saved[1])
                run = chain(weights, inputs)
                outs = run()
                torch.cuda.synchronize()
                same = None
                if ref is None:
                    ref = {k: v.clone() for k, v in outs.items()}
                else:
                    same = all(torch.equal(outs[k], ref[k]) for k in ref)
                ms, how = time_ms(run)
                floor_ms = wbytes / bw * 1e3
                rows.append(
                    {"kernel": "w8a8 chain", "rows": m, "layers": args.layers, "pdl": mode,
                     "ms": ms, "timing": how, "floor_ms": floor_ms, "of_floor": floor_ms / ms,
                     "launches": 10 * args.layers, "same_bits_as_off": same}
                )  # fmt: skip
                print(f"{m:>4} {mode:>9} {ms:>8.3f} {floor_ms:>7.3f} {floor_ms / ms:>8.3f}  {same}")
    finally:
        tc.PDL, tc.PDL_MAX_ROWS = saved
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(),
        "spec": "flash_slice",
        "ceilings": {"copy_bytes_per_s": bw},
        "weight_bytes": wbytes,
        "rows": rows,
    }
    write_report(report, args.out, "probe_pdl.json")
    bad = [r for r in rows if r["same_bits_as_off"] is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
