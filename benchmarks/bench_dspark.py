"""DSpark on MEDIUM: the engine's draft + verify step against its plain decode step.

    python3 benchmarks/bench_dspark.py [--batch-sizes 1,8] [--context 512] [--steps 16]
        [--out report.json]

Two engines over the same seeded random weights (the draft's included), one speculating
(``speculative_config={"method": "dspark"}``), both with FULL CUDA graphs, bf16, the Triton
backend and dense kernels, the grouped MoE over dequantised weights (the draft runs
dequantised weights, so the plain engine does too) and compilation level 0 (no Inductor
warm-up). Per batch size, ``bs`` requests of ``--context`` prompt tokens are admitted and
prefilled; then ``--steps`` engine steps (``LLM.step``, synchronized) are timed once every
request decodes. Each row gives the wall time of a step, the tokens it emitted, tokens per
second, and (speculating) the acceptance counters. Random weights accept essentially
nothing, so here the speculative row measures the cost of a draft + verify step, not a
speed-up.

Floors (``medium_model.step_floor``, ceilings measured in this process): ``floor_ms`` is the
floor of the step's target forward: one row per request for the plain step, the anchor and
five drafts for the verify step (the draft's own three window-only blocks are not counted,
so that floor is a little low). ``of_floor`` is ``floor_ms / ms``. Writes JSON with the tree's
provenance to ``--out`` (``$OUT/bench_dspark.json`` on the device).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_io import write_report

DSPARK = {"method": "dspark", "num_speculative_tokens": 5}


def _engines(spec, args, max_bs: int):
    """(plain, speculating) engines over one seeded random checkpoint."""
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import LLM
    from v41plan.serving.runner import DTYPES, PagedRunner

    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0, draft=True))
    device = torch.device(args.device)

    def factory(spec_, checkpoint, options):
        return PagedRunner(spec_, ckpt, options, dtype=DTYPES[args.dtype], device=device)

    graphs = args.device == "cuda"
    opts = {
        "enforce_eager": not graphs, "cudagraph_mode": "FULL" if graphs else "NONE",
        "device": args.device, "dtype": args.dtype, "max_num_seqs": max_bs,
        "max_num_batched_tokens": max(max_bs * args.context, 2 * spec.replay.hash_block_tokens),
        "max_model_len": args.context + 6 * (args.steps + 4) + 16, "compilation_level": 0,
        "resident_weights": False, "world_size": 1,
    }  # fmt: skip
    if graphs:
        opts.update(kernel_backend="triton", dense_kernels="triton", moe_impl="grouped")
    plain = LLM(spec, runner_factory=factory, **opts)
    spec_llm = LLM(spec, runner_factory=factory, speculative_config=DSPARK, **opts)
    return plain, spec_llm


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(llm, bs: int, context: int, steps: int) -> dict:
    """Admit ``bs`` requests of ``context`` tokens, step until every one decodes, then time
    ``steps`` steps: ms a step, tokens a step, tokens/s."""
    from v41plan.serving.sampling import SamplingParams

    rng = np.random.default_rng(bs)
    params = SamplingParams(max_tokens=6 * (steps + 4), temperature=0.0, ignore_eos=True)
    seqs = [llm.add_request(rng.integers(0, 250, context).tolist(), params) for _ in range(bs)]
    for _ in range(1000):
        llm.step()
        if all(s.num_tokens > s.num_prompt_tokens for s in seqs):
            break
    for _ in range(2):  # warm: the first decode steps
        llm.step()
    llm.drain()
    _sync()
    before = sum(s.num_tokens for s in seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    llm.drain()
    _sync()
    seconds = time.perf_counter() - t0
    tokens = sum(s.num_tokens for s in seqs) - before
    for s in seqs:
        llm.abort(s)
    llm.run_until_done()
    return {
        "ms": 1e3 * seconds / steps,
        "tokens_per_step": tokens / steps,
        "tokens_per_s": tokens / seconds,
    }


def floors(spec, cfg, bs: int, context: int, q: int, ceilings: dict | None, geometry) -> dict:
    """The target forward's floor of a decode step of ``bs`` requests, ``q`` rows each."""
    from medium_model import pool_row_bytes, step_floor

    from v41plan.planner.step import RequestInput, StepInput, plan_step

    if ceilings is None:
        return {}
    P = spec.replay.hash_block_tokens
    pages = -(-(context + q) // P)
    reqs = tuple(
        RequestInput(slot=i, block_table=tuple(range(i * pages, (i + 1) * pages)),
                     prompt_len=context, start=context, chunk_len=q, phase="decode")
        for i in range(bs)
    )  # fmt: skip
    plan = plan_step(StepInput(reqs), spec)
    return step_floor(cfg, plan, ceilings, rows=pool_row_bytes(geometry), index_cache_dtype="fp8")


def main(argv: list[str] | None = None) -> int:
    """Time both engines at each batch size; print a table, write the JSON."""
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec
    from v41plan.validation.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="medium", help="a spec with a DSpark draft")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens a request")
    ap.add_argument("--steps", type=int, default=16, help="engine steps timed")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    ap.add_argument("--out", default=None, help="JSON report (default: $OUT/bench_dspark.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_dspark: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    spec = resolve_spec(args.spec)
    cfg = config_from_cache_spec(spec)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ceilings = None
    if args.device == "cuda":
        from ceilings import ceilings_line, measure_ceilings

        ceilings = measure_ceilings()
        print(ceilings_line(ceilings))
    t0 = time.perf_counter()
    plain, spec_llm = _engines(spec, args, max(sizes))
    build_s = time.perf_counter() - t0
    geometry = {
        "plain": plain.runner.model.pools.geometry,
        "dspark": spec_llm.runner.model.pools.geometry,
    }
    rows = []
    print(f"{'engine':<8} {'bs':>3} {'ms/step':>9} {'tok/step':>9} {'tok/s':>9} {'of_floor':>9}")
    for bs in sizes:
        for name, llm, q in (("plain", plain, 1), ("dspark", spec_llm, 6)):
            got = time_steps(llm, bs, args.context, args.steps)
            fl = floors(spec, cfg, bs, args.context, q, ceilings, geometry[name])
            floor_ms = 1e3 * fl["floor_s"] if fl else None
            row = {
                "engine": name, "bs": bs, "context": args.context, "rows_per_request": q,
                **got, "floor_ms": floor_ms,
                "of_floor": floor_ms / got["ms"] if floor_ms else None,
            }  # fmt: skip
            if name == "dspark":
                row["speculative"] = llm.speculative_stats()
            rows.append(row)
            of = f"{row['of_floor']:.3f}" if row["of_floor"] else "-"
            print(f"{name:<8} {bs:>3} {got['ms']:>9.2f} {got['tokens_per_step']:>9.2f} "
                  f"{got['tokens_per_s']:>9.1f} {of:>9}")  # fmt: skip
    for bs in sizes:
        p = next(r for r in rows if r["engine"] == "plain" and r["bs"] == bs)
        d = next(r for r in rows if r["engine"] == "dspark" and r["bs"] == bs)
        d["step_cost_vs_plain"] = d["ms"] / p["ms"]
        print(f"bs {bs}: a draft + verify step costs {d['step_cost_vs_plain']:.2f}x a plain step")
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "spec": spec.name,
        "dtype": args.dtype,
        "build_s": build_s,
        "ceilings": ceilings,
        "note": "random weights: acceptance is meaningless; the rows measure the step cost",
        "rows": rows,
    }
    write_report(report, args.out, "bench_dspark.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
