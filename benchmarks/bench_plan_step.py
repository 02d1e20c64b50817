"""Host time of ``plan_step`` for a decode step and a ragged prefill step.

    python benchmarks/bench_plan_step.py [--spec specs/deepseek_v41_flash.yaml] [--iters 2000]

Decode: 256 running requests, one row each, contexts 100..4600 tokens. Prefill: 16 requests x
512 new tokens at hash-block-aligned resume points of 4096-token prompts, with a mix of
non-final, final (tail) and backed-off final chunks. Both use the columnar ``StepArrays``
input (what a scheduler keeping numpy state passes); the ``StepInput`` (one dataclass per
request) figure is printed too. Ceilings: 100 us (decode) and 300 us (prefill).

Plan + prepare: the same 256-request decode step planned and prepared for the device by
``RuntimeModel.prepare`` (the staging workspace: every per-request and per-row input, the
Engram rows of every request and the sampler's columns) on the ``tiny`` model, contexts cut to
100..600 tokens so its pools stay small. Ceiling: 300 us.

Each figure is the lowest of ``BLOCKS`` block medians (every block's median is in the report):
on a shared host other tenants slow whole stretches of seconds, which one median over all
calls would fold in.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import numpy as np
from report_io import write_report

from v41plan.planner.step import RequestInput, StepArrays, StepInput, plan_step

ROOT = Path(__file__).resolve().parent.parent


def load_spec(path: str):
    """Generated spec when compiled, else straight from the YAML."""
    try:
        from v41plan.geometry.runtime import load_cache_spec

        return load_cache_spec(path)
    except ValueError:
        from v41plan.geometry.derive import load_cache_spec_unchecked

        return load_cache_spec_unchecked(path)


def decode_step(spec, n: int = 256) -> StepArrays:
    """``n`` decoding requests, one row each."""
    rng = np.random.default_rng(0)
    page = spec.replay.hash_block_tokens
    prompt = rng.integers(100, 4000, n)
    start = prompt + rng.integers(0, 600, n)
    pages = int(start.max()) // page + 1
    return StepArrays(
        slots=np.arange(n),
        block_tables=np.arange(n * pages).reshape(n, pages),
        prompt_lens=prompt,
        starts=start,
        chunk_lens=np.ones(n, dtype=np.int64),
        is_decode=np.ones(n, dtype=bool),
        prefix_hits=np.zeros(n, dtype=np.int64),
        fresh_slot=np.zeros(n, dtype=bool),
        running_bs=n,
        running_tokens=n,
    )


def prefill_step(spec, n: int = 16, chunk: int = 512) -> StepArrays:
    """``n`` requests x ``chunk`` new tokens of 4096-token prompts (some final, some short)."""
    rng = np.random.default_rng(1)
    page = spec.replay.hash_block_tokens
    prompt = np.full(n, 4096, dtype=np.int64)
    start = rng.integers(0, (4096 - chunk) // page + 1, n) * page
    start[-4:] = 4096 - chunk  # final chunks (a tail each)
    chunk_lens = np.full(n, chunk, dtype=np.int64)
    start[-1], chunk_lens[-1] = 4096 - 40, 40  # a short final chunk: backs off a hash block
    pages = 4096 // page
    return StepArrays(
        slots=np.arange(n),
        block_tables=np.arange(n * pages).reshape(n, pages),
        prompt_lens=prompt,
        starts=start,
        chunk_lens=chunk_lens,
        is_decode=np.zeros(n, dtype=bool),
        prefix_hits=np.zeros(n, dtype=np.int64),
        fresh_slot=np.zeros(n, dtype=bool),
    )


def as_requests(a: StepArrays) -> StepInput:
    """The same step as ``StepInput`` (one ``RequestInput`` per request, tuple block tables)."""
    reqs = tuple(
        RequestInput(
            slot=int(a.slots[i]),
            block_table=tuple(int(x) for x in a.block_tables[i]),
            prompt_len=int(a.prompt_lens[i]),
            start=int(a.starts[i]),
            chunk_len=int(a.chunk_lens[i]),
            phase="decode" if a.is_decode[i] else "prefill",
        )
        for i in range(len(a.slots))
    )
    return StepInput(reqs, running_bs=a.running_bs, running_tokens=a.running_tokens)


BLOCKS = 5
"""Timing blocks per figure: the figure is the lowest block median (a shared host's other
tenants slow whole stretches of seconds, not single calls); every block's median is reported."""

BLOCK_MEDIANS: dict[str, list[float]] = {}


def median_us(fn, iters: int, label: str = "") -> float:
    """Wall time of ``fn()`` in microseconds: ``iters`` calls in ``BLOCKS`` blocks (GC off while
    timing), the lowest block median; the block medians are kept in ``BLOCK_MEDIANS[label]``."""
    for _ in range(50):
        fn()
    medians = []
    per_block = max(1, iters // BLOCKS)
    gc.disable()
    try:
        for _ in range(BLOCKS):
            samples = []
            for _ in range(per_block):
                t0 = time.perf_counter_ns()
                fn()
                samples.append(time.perf_counter_ns() - t0)
            medians.append(statistics.median(samples) / 1000)
    finally:
        gc.enable()
    if label:
        BLOCK_MEDIANS[label] = [round(m, 1) for m in medians]
    return min(medians)


def plan_and_prepare_us(iters: int, n: int = 256) -> float:
    """Median of ``plan_step`` + ``RuntimeModel.prepare`` of an ``n``-request decode step on the
    tiny model (random weights, CPU)."""
    import torch

    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime.paged_model import RuntimeModel, StepSampling

    torch.set_num_threads(1)
    spec = load_spec(str(ROOT / "specs" / "tiny.yaml"))
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    rng = np.random.default_rng(0)
    page = spec.replay.hash_block_tokens
    prompt = rng.integers(100, 500, n)
    start = prompt + rng.integers(0, 100, n)
    pages = int(start.max()) // page + 1
    m = RuntimeModel(
        spec, ckpt.process(torch.float32), ckpt.engram_host(), num_pages=n * pages + 1,
        num_slots=n, max_tokens=n, max_bs=n, table_width=pages + 1, cfg=cfg,
    )  # fmt: skip
    step = StepArrays(
        slots=np.arange(n),
        block_tables=np.arange(n * pages).reshape(n, pages),
        prompt_lens=prompt,
        starts=start,
        chunk_lens=np.ones(n, dtype=np.int64),
        is_decode=np.ones(n, dtype=bool),
        prefix_hits=np.zeros(n, dtype=np.int64),
        fresh_slot=np.zeros(n, dtype=bool),
        running_bs=n,
        running_tokens=n,
        block_table_width=pages + 1,
    )
    ids = rng.integers(0, 256, n)
    f = np.full(n, 0.7, dtype=np.float32)
    sampling = StepSampling(f, np.zeros(n, np.int64), f, f * 0, np.arange(n), np.arange(n))

    def once():
        m.prepare(plan_step(step, spec), ids, sampling=sampling)

    return median_us(once, iters, "plan + prepare, decode 256 (tiny)")


def main() -> int:
    """Print the table of medians and ceilings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "specs" / "deepseek_v41_flash.yaml"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument(
        "--out", default=None, help="JSON report path (default: $OUT/bench_plan_step.json)"
    )
    args = ap.parse_args()
    spec = load_spec(args.spec)
    dec, pre = decode_step(spec), prefill_step(spec)
    rows = [
        (
            "decode 256 x 1 (StepArrays)",
            median_us(lambda: plan_step(dec, spec), args.iters, "decode 256 x 1 (StepArrays)"),
            100,
        ),
        (
            "prefill 16 x 512 (StepArrays)",
            median_us(lambda: plan_step(pre, spec), args.iters, "prefill 16 x 512 (StepArrays)"),
            300,
        ),
    ]
    dec_r, pre_r = as_requests(dec), as_requests(pre)
    rows.append(
        (
            "decode 256 x 1 (StepInput)",
            median_us(lambda: plan_step(dec_r, spec), args.iters, "decode 256 x 1 (StepInput)"),
            None,
        )
    )
    rows.append(
        (
            "prefill 16 x 512 (StepInput)",
            median_us(lambda: plan_step(pre_r, spec), args.iters, "prefill 16 x 512 (StepInput)"),
            None,
        )
    )
    rows.append(("plan + prepare, decode 256 (tiny)", plan_and_prepare_us(args.iters // 4), 300))
    print(f"plan_step on {spec.name}: {args.iters} calls a row in {BLOCKS} blocks, lowest median")
    print(f"{'step':34} {'median us':>10} {'ceiling us':>11}")
    for name, us, ceiling in rows:
        mark = "" if ceiling is None else ("  ok" if us <= ceiling else "  OVER")
        print(f"{name:34} {us:10.1f} {'' if ceiling is None else ceiling:>11}{mark}")
    import platform

    from v41plan.validation.provenance import provenance

    report = {
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "spec": spec.name,
        "iters": args.iters,
        "blocks": BLOCKS,
        "rows": [
            {
                "step": name,
                "median_us": us,
                "block_medians_us": BLOCK_MEDIANS.get(name),
                "ceiling_us": ceiling,
                "of_ceiling": None if ceiling is None else ceiling / us,
            }
            for name, us, ceiling in rows
        ],
        "provenance": provenance(),
    }
    write_report(report, args.out, "bench_plan_step.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
