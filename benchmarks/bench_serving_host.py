"""Host time of one engine step at many running requests: scheduler, prepare, readback.

    python benchmarks/bench_serving_host.py [--spec tiny] [--requests 256] [--steps 200]

An engine over the real paged runner (the embedded random checkpoint of ``--spec``) with the
model's device work replaced by a stub: ``run()`` returns logits of the right shape without
computing anything, so what is timed is the host path of a decode step with ``--requests``
running requests: ``Scheduler.schedule`` (the decode rows and the per-step deltas), the
runner's host side (slot-table deltas, ``StepArrays``, ``plan_step``, ``RuntimeModel.prepare``:
the staging workspace and the Engram rows), the readback, and ``Scheduler.postprocess``
(sampling, stop checks, block publication). Prints the median per step and each part's share,
and writes JSON to ``--out``. The ceiling is 1 ms per step at 256 requests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_io import write_report

CEILING_MS = 1.0


def main(argv: list[str] | None = None) -> int:
    """Build the engine, warm it up to ``--requests`` decoding requests, time ``--steps``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from v41plan.runtime.paged_model import RuntimeModel, StepOutput
    from v41plan.runtime.sampler import SamplerOutput
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams
    from v41plan.validation.provenance import provenance

    n = args.requests
    llm = LLM(
        args.spec,
        max_num_seqs=n,
        max_num_batched_tokens=max(n * args.prompt, 512),
        max_model_len=args.prompt + args.steps + 64,
        device="cpu",
    )
    model: RuntimeModel = llm.runner.model
    vocab = llm.vocab_size
    timings: dict[str, list[float]] = defaultdict(list)

    def stub_run(inputs):  # no device work: the host path alone is timed
        b, t = inputs.b, inputs.t
        top = inputs.sampling_shape[2] if inputs.sampling_shape else 0
        sampled = SamplerOutput(
            torch.zeros(b, dtype=torch.int64), torch.zeros(b),
            torch.zeros(b, top, dtype=torch.int64), torch.zeros(b, top),
        )  # fmt: skip
        rows = torch.zeros(t, vocab) if inputs.all_row_logits else None
        return StepOutput(torch.zeros(b, vocab), rows, sampled)

    model.run = stub_run
    real_prepare, real_read = model.prepare, llm.runner.collect

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name].append(time.perf_counter() - t0)

        return wrapper

    model.prepare = timed("prepare", real_prepare)
    llm.runner.collect = timed("readback", real_read)
    params = SamplingParams(max_tokens=args.steps + 32, ignore_eos=True)
    for i in range(n):
        llm.add_request([(7 * i + k) % 250 for k in range(args.prompt)], params)
    while any(s.is_prefilling for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()  # prefill every request (untimed)
    for samples in timings.values():
        samples.clear()
    sched = llm.scheduler
    steps = []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        out = llm.runner.execute(batch)
        t2 = time.perf_counter()
        sched.postprocess(batch, out)
        t3 = time.perf_counter()
        assert batch.phase == "decode" and len(batch.requests) == n
        timings["schedule"].append(t1 - t0)
        timings["execute"].append(t2 - t1)
        timings["postprocess"].append(t3 - t2)
        steps.append(t3 - t0)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    med = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
    step_ms = statistics.median(steps) * 1e3
    rows = [{"part": k, "ms": med[k]} for k in ("schedule", "execute", "prepare", "readback",
                                                  "postprocess")]  # fmt: skip
    report = {
        "spec": args.spec,
        "requests": n,
        "steps": args.steps,
        "step_ms": step_ms,
        "ceiling_ms": CEILING_MS,
        "of_ceiling": CEILING_MS / step_ms,
        "rows": rows,
        "provenance": provenance(),
    }
    print(f"host time of one decode step, {n} running requests, median of {args.steps}")
    print(f"{'part':12} {'ms':>8}")
    for r in rows:
        print(f"{r['part']:12} {r['ms']:8.3f}")
    print(f"{'step':12} {step_ms:8.3f}   ceiling {CEILING_MS} ms "
          f"{'ok' if step_ms <= CEILING_MS else 'OVER'}")  # fmt: skip
    write_report(report, args.out, "bench_serving_host.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
