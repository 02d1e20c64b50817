"""Programmatic dependent launch on a decode-shaped chain of W8A8 linears, on one GPU.

    python3 benchmarks/probe_pdl.py [--rows 1,64] [--layers 40] [--out F]

Each layer runs flash_slice's five W8A8 linears at decode shapes (``wq_a``, ``wq_b``, ``wkv``,
``wo_b``, the shared expert's ``w2``), each behind its activation quantizer, with its own
weights (nothing stays in L2 between layers): 400 launches a replay at 40 layers, the pattern
of the decode step's linears. One CUDA graph per ``triton_common.PDL_MODES`` entry (off, on),
with ``PDL_MAX_ROWS`` raised to the row count so that every row count is timed both ways, timed
by replays; the "on" outputs are compared bit for bit with the "off" graph's. Then ``wq_a`` and
``wkv`` as two products against one joint product (``joint_rows``, PDL off). Rows: ``ms``,
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

from v41plan.model.quant import QuantWeight

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


def joint_rows(weights: list[dict], row_counts: list[int], bw: float, rows: list) -> None:
    """``wq_a`` and ``wkv`` of every layer as two W8A8 products against one over their stacked
    weight (``resident.linear_pair``), PDL off: 80 against 40 GEMM launches (and quantizer
    launches) a replay; the joint output's halves against the two products (``max_abs_diff``:
    other K splits, so float32 summation order only)."""
    from v41plan.runtime.resident import linear_pair

    pairs = [
        linear_pair()(QuantWeight(*w["wq_a"], "fp8"), QuantWeight(*w["wkv"], "fp8"), torch.bfloat16)
        for w in weights
    ]
    n1 = SHAPES["wq_a"][0]
    wbytes = sum(c.numel() + s.numel() for w in weights for k in ("wq_a", "wkv") for c, s in [w[k]])
    for m in row_counts:
        x = torch.randn(m, 5120, device="cuda").to(torch.bfloat16)
        forms = {
            "separate": lambda x=x: [(a(x), b(x)) for a, b, _ in pairs],
            "joint": lambda x=x: [(y[:, :n1], y[:, n1:]) for y in (j(x) for _, _, j in pairs)],
        }
        ref = [tuple(t.float() for t in ab) for ab in forms["separate"]()]
        for name, fn in forms.items():
            got = fn()
            diff = max(
                float((g.float() - r).abs().max())
                for gr, rr in zip(got, ref, strict=True)
                for g, r in zip(gr, rr, strict=True)
            )
            ms, how = time_ms(fn)
            fl = wbytes / bw * 1e3
            rows.append(
                {"kernel": "wq_a + wkv", "rows": m, "layers": len(weights), "form": name,
                 "ms": ms, "timing": how, "floor_ms": fl, "of_floor": fl / ms,
                 "max_abs_diff": diff, "same_bits_as_off": None}
            )  # fmt: skip
            print(f"{m:>4} {name:>9} {ms:>8.3f} {fl:>7.3f} {fl / ms:>8.3f}  diff {diff:.3g}")


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
        tc.PDL = "off"
        try:
            joint_rows(weights, [int(r) for r in args.rows.split(",")], bw, rows)
        except Exception as exc:  # noqa: BLE001 - the chain's rows are kept, the error is a row
            rows.append({"kernel": "wq_a + wkv", "error": f"{type(exc).__name__}: {exc}"})
            print(rows[-1])
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
    bad = [r for r in rows if r.get("same_bits_as_off") is False or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
