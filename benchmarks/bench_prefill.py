"""One 8K-token prefill on the MEDIUM model (bf16): decoder SWA bounded replay on vs off.

    python3 benchmarks/bench_prefill.py [--checkpoint DIR] [--tokens 8192] [--kernel-table N]
        [--flag kernels.triton_gemm.MM_ROWS=None] [--out report.json]

A fresh request's whole prompt in one forward (prefill is always eager). With decoder replay
on, the stage table runs the decoder layers on the tail (the last ``W`` rows) only; off, every
layer runs every row. The ceilings (copy bandwidth, bf16 and FP8 matmul rates) are measured in
this process and each time is given with its two floors (``medium_model.step_floor``, rows per
layer from the plan: ``floor_ms`` shipped weight formats with W8A8/W4A8 work at the FP8 rate,
``floor_bf16_ms`` bf16 weights at the bf16 rate) and as ``of_floor = floor / measured``.
``--flag``: module flags (``module.NAME=value`` under ``v41plan.runtime``, a Python literal)
whose other side is timed too, after the default, in the same process (rows with ``flags``
and ``next_token_equal_default``).
Writes JSON, with the tree's provenance, to ``--out`` (``$OUT/bench_prefill.json`` on the
device).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode_paths import VARIANTS, _kernel_table, module_flags
from ceilings import ceilings_line, measure_ceilings
from medium_model import (
    load_spec,
    load_weights,
    medium_report,
    pool_row_bytes,
    step_floor,
    time_host,
)
from report_io import write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkpoint", default=None, help="checkpoint directory (default: seeded random weights)"
    )
    ap.add_argument("--spec", default="medium", help="spec name or YAML (e.g. flash_slice)")
    ap.add_argument(
        "--variant",
        default="reference",
        choices=sorted(VARIANTS),
        help="kernel path as in bench_decode_paths.py (reference: torch ops, bf16 weights; "
        "resident: Triton attention and dense kernels, grouped W4A8 MoE, W8A8 linears)",
    )
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument(
        "--kernel-table",
        type=int,
        default=0,
        help="also profile one forward each way and record its N largest kernels by device time",
    )
    ap.add_argument(
        "--flag",
        action="append",
        default=[],
        help="module.NAME=value under v41plan.runtime: also time the prefill with it set",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        flags = {
            k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in args.flag)
        }  # fmt: skip
    except (ValueError, SyntaxError) as exc:
        ap.error(f"--flag takes module.NAME=<Python literal>: {exc}")
    if not torch.cuda.is_available():
        print("bench_prefill.py: needs a CUDA device, and this machine has none", file=sys.stderr)
        return 2
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime.paged_model import RuntimeModel

    ceil = measure_ceilings()
    spec = load_spec(args.spec)
    kernels, dense, moe, resident, compile_backend = VARIANTS[args.variant]
    cfg, weights, engram, load_report = load_weights(spec, args.checkpoint, resident=resident)
    if kernels == "triton":
        from v41plan.runtime.kernels.triton_backend import TritonBackend

        backend = TritonBackend()
    else:
        from v41plan.runtime.kernels.torch_ref import TorchBackend

        backend = TorchBackend()
    P = spec.replay.hash_block_tokens
    n = args.tokens
    pages = -(-n // P) + 1
    m = RuntimeModel(
        spec,
        weights,
        engram,
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        num_pages=pages + 2,
        num_slots=1,
        max_tokens=n,
        max_bs=1,
        table_width=pages,
        dtype=torch.bfloat16,
        device="cuda",
        cfg=cfg,
        backend=backend,
        dense=dense,
        moe=moe,
        compile_backend=compile_backend,
    )
    del weights
    ids = np.random.default_rng(0).integers(0, 256, n)
    req = RequestInput(
        slot=0,
        block_table=tuple(range(pages)),
        prompt_len=n,
        start=0,
        chunk_len=n,
        phase="prefill",
        fresh_slot=True,
    )
    rows, logits = [], {}
    for setting, replay in [({}, False), ({}, True)] + [(flags, r) for r in (False, True) if flags]:
        plan = plan_step(StepInput((req,)), spec, decoder_replay=replay)

        def run(plan=plan):
            m.pools.reset_slot(0)
            return m.forward(plan, ids)

        with module_flags(setting):
            row = _time_prefill(run, args, cfg, plan, ceil, m, n, replay, setting)
            out = run().logits.float()
        if setting:  # the flag's next token against the default's, the same replay setting
            row["next_token_equal_default"] = bool(
                torch.equal(out.argmax(-1), logits[replay].argmax(-1))
            )
        else:
            logits[replay] = out
        rows.append(row)
    same = bool(torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)))
    report = medium_report(
        spec, args, ceil, rows,
        speedup_replay_on=rows[0]["ms"] / rows[1]["ms"], last_token_equal=same,
        variant=args.variant, resident=resident,
        resident_bytes=load_report["resident_bytes"],
        checkpoint_bytes=load_report["checkpoint_bytes"],
    )  # fmt: skip
    print(ceilings_line(ceil))
    print(
        f"{'replay':>6} {'tokens':>6} {'ms':>9} {'tok/s':>9} {'layer rows':>10} {'TFLOP':>7} "
        f"{'fp8 TF':>7} {'floor ms':>9} {'bf16 fl':>8} {'bound':>6} {'of floor':>8} {'of bf16':>8}"
    )
    for r in rows:
        if r["flags"]:
            print(f"  with {r['flags']} (next token as the default's: "
                  f"{r['next_token_equal_default']}):")  # fmt: skip
        print(
            f"{'on' if r['decoder_replay'] else 'off':>6} {r['tokens']:>6} {r['ms']:>9.1f} "
            f"{r['tokens_per_s']:>9.0f} {r['rows_run']:>10} {r['flops'] / 1e12:>7.2f} "
            f"{r['fp8_flops'] / 1e12:>7.2f} {r['floor_ms']:>9.2f} {r['floor_bf16_ms']:>8.2f} "
            f"{r['bound']:>6} {r['of_floor']:>8.4f} {r['of_floor_bf16']:>8.4f}"
        )
    for r in rows:
        for k in r.get("kernel_table", ()):
            print(f"  {'on' if r['decoder_replay'] else 'off':>3} {k['us'] / 1e3:9.2f} ms "
                  f"{k['calls']:6.0f} x {k['kernel'][:90]}")  # fmt: skip
    print(f"replay on / off speedup: {report['speedup_replay_on']:.2f}x; same next token: {same}")
    write_report(report, args.out, "bench_prefill.json")
    return 0


def _time_prefill(run, args, cfg, plan, ceil, m, n, replay, setting) -> dict:
    """One row: ``run`` (the prefill forward) timed, with its floors and kernel table."""
    t = time_host(run, args.iters, warmup=1)
    fl = step_floor(
        cfg, plan, ceil, rows=pool_row_bytes(m.geometry), index_cache_dtype=args.index_cache_dtype
    )
    layer_rows = [len(plan.layer_rows.get((info.index, "attention"), ())) for info in cfg.layers]
    extra = {}
    if args.kernel_table:
        table, busy_ms = _kernel_table(run, 1, args.kernel_table)
        extra = {"kernel_table": table, "kernel_busy_ms": busy_ms}
    return {
        "decoder_replay": replay,
        "flags": setting,
        "tokens": n,
        "ms": t * 1e3,
        "tokens_per_s": n / t,
        "rows_run": int(sum(layer_rows)),
        **fl,
        "floor_ms": fl["floor_s"] * 1e3,
        "floor_bf16_ms": fl["floor_bf16_s"] * 1e3,
        "of_floor": fl["floor_s"] / t,
        "of_floor_bf16": fl["floor_bf16_s"] / t,
        **extra,
    }


if __name__ == "__main__":
    sys.exit(main())
