"""Where a `v41plan train` step's time goes, and how it scales with the batch.

    python scripts/train_step_profile.py [--spec quality40] [--batches 16,32,64] \
        [--seq-tokens 640] [--steps 6] [--device cuda] [--out FILE.json]

For each batch size: builds the training step (``validation.training._Stepper``, CUDA graphs on
CUDA, dense attention as the recall runs train), captures it, times ``--steps`` replays on
device events (s a step, tokens a second), then profiles one replay at the first batch size:
the kernels it launches and the largest of them by device time. On the CPU (a smoke test) the
step runs eagerly and the profile counts operators. Writes the rows and the provenance to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from v41plan.geometry.resolve import resolve_spec
from v41plan.model.config import config_from_cache_spec
from v41plan.model.train import TrainModel
from v41plan.validation.provenance import provenance
from v41plan.validation.training import TrainOptions, _Stepper


def _time_steps(stepper: _Stepper, steps: int, cuda: bool) -> float:
    """Seconds a step over ``steps`` steps (after one untimed)."""
    stepper.step(dense=True)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            stepper.step(dense=True)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    t = time.perf_counter()
    for _ in range(steps):
        stepper.step(dense=True)
    return (time.perf_counter() - t) / steps


def _profile(stepper: _Stepper, cuda: bool, top: int) -> dict:
    """Kernels (CUDA) or operators (CPU) of one step, and the largest by time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        stepper.step(dense=True)
        if cuda:
            torch.cuda.synchronize()
    count, total = Counter(), Counter()
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if cuda != on_device or (not cuda and not e.name.startswith("aten::")):
            continue
        if not cuda and e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # an operator inside another: counted once, at the top
        count[e.name] += 1
        total[e.name] += e.device_time_total if cuda else e.self_cpu_time_total
    busy = sum(total.values())
    return {
        "launches": sum(count.values()),
        "busy_ms": busy / 1e3,
        "largest": [
            {"name": n[:160], "calls": count[n], "ms": total[n] / 1e3}
            for n, _ in total.most_common(top)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--seq-tokens", type=int, default=640)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    cfg = config_from_cache_spec(resolve_spec(args.spec))
    n_rows = (len(cfg.engram_layer_ids), cfg.engram_cols)
    rows, prof = [], None
    for b in (int(x) for x in args.batches.split(",")):
        opts = TrainOptions(batch_seqs=b, seq_tokens=args.seq_tokens, graphs=cuda, compile=cuda)
        model = TrainModel(cfg, 0, dev, compile_hc=cuda)
        stepper = _Stepper(model, opts, b, args.seq_tokens, n_rows)
        t0 = time.perf_counter()
        stepper.step(dense=True)  # the capture (CUDA)
        if cuda:
            torch.cuda.synchronize()
        setup_s = time.perf_counter() - t0
        s = _time_steps(stepper, args.steps, cuda)
        row = {
            "batch_seqs": b,
            "tokens_per_step": b * args.seq_tokens,
            "s_per_step": s,
            "tokens_per_s": b * args.seq_tokens / s,
            "first_step_s": setup_s,
            "graphs": stepper.graphs_on,
            "max_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
        }
        rows.append(row)
        print(
            f"batch {b:>3}: {s:.3f} s a step, {row['tokens_per_s']:,.0f} tokens/s "
            f"(first step {setup_s:.1f} s)"
        )
        if prof is None:
            prof = _profile(stepper, cuda, args.top)
            print(
                f"  one step: {prof['launches']} {'kernels' if cuda else 'operators'}, "
                f"{prof['busy_ms']:.1f} ms busy; largest:"
            )
            for k in prof["largest"][:12]:
                print(f"  {k['ms']:>9.2f} ms {k['calls']:>6}  {k['name'][:90]}")
        del stepper, model
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "spec": args.spec,
        "seq_tokens": args.seq_tokens,
        "rows": rows,
        "profile_first_batch": prof,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
