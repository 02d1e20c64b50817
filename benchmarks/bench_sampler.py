"""Device sampler time per step: eager and CUDA-graph replay, by batch size and mode.

    python3 benchmarks/bench_sampler.py [--vocab 129280] [--batch-sizes 1,8,64,256] [--out F]

Modes: ``greedy`` (``sampled=False``), ``sampled`` (temperature only, ``truncate=False``),
``full`` (top-k, top-p and min-p rows: the sort runs), ``full+top20`` (``full`` with 20 top
logprobs) and ``full+pen`` (``full`` with penalty rows gathered from slot tables). Each figure
is the median device time of one call (events around it), eager and as one graph replay,
next to its floor: the logits' bytes read once at the copy bandwidth measured in this run
(``ceilings.copy_bandwidth_bytes_per_s``, read and write bytes counted), and the ratio
``floor / replay``. Writes JSON to ``--out`` (``$OUT/bench_sampler.json`` on the device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import copy_bandwidth_bytes_per_s
from medium_model import time_device
from report_io import write_report

MODES = ("greedy", "sampled", "full", "full+top20", "full+pen")


def _inputs(mode: str, bs: int, vocab: int):
    """Sampler inputs of one mode on CUDA, and the call's static keywords."""
    from v41plan.runtime.sampler import SamplerInputs

    dev = "cuda"
    hot = mode != "greedy"
    trunc = mode.startswith("full")
    inp = SamplerInputs(
        temperature=torch.full((bs,), 0.8 if hot else 0.0, device=dev),
        top_k=torch.full((bs,), 50 if trunc else 0, dtype=torch.int64, device=dev),
        top_p=torch.full((bs,), 0.9 if trunc else 1.0, device=dev),
        min_p=torch.full((bs,), 0.02 if trunc else 0.0, device=dev),
        seed=torch.arange(bs, dtype=torch.int64, device=dev),
        output_index=torch.zeros(bs, dtype=torch.int64, device=dev),
    )
    kw = {"sampled": hot, "truncate": trunc, "top_n": 20 if mode == "full+top20" else 0}
    tables = None
    if mode == "full+pen":
        inp.presence_penalty = torch.full((bs,), 0.5, device=dev)
        inp.frequency_penalty = torch.full((bs,), 0.3, device=dev)
        inp.repetition_penalty = torch.full((bs,), 1.1, device=dev)
        counts = torch.randint(0, 3, (bs, vocab), dtype=torch.int32, device=dev)
        prompt = torch.rand(bs, vocab, device=dev) < 0.01
        tables = (counts, prompt, torch.arange(bs, device=dev))
    return inp, kw, tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampler.py needs a CUDA device")
        return 2
    from v41plan.runtime.sampler import penalty_rows, sample_tokens

    copy_bps = copy_bandwidth_bytes_per_s()
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        logits = torch.randn(bs, args.vocab, device="cuda") * 3
        floor_s = bs * args.vocab * 4 / copy_bps
        for mode in MODES:
            inp, kw, tables = _inputs(mode, bs, args.vocab)

            def call(inp=inp, kw=kw, tables=tables, logits=logits):
                if tables is not None:
                    inp.output_counts, inp.prompt_mask = penalty_rows(*tables)
                return sample_tokens(logits, inp, **kw)

            eager_s = time_device(call, args.iters)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            replay_s = time_device(graph.replay, args.iters)
            rows.append(
                {
                    "bs": bs,
                    "mode": mode,
                    "eager_us": eager_s * 1e6,
                    "replay_us": replay_s * 1e6,
                    "floor_us": floor_s * 1e6,
                    "floor_over_replay": floor_s / replay_s,
                }
            )
            del graph
    print(f"device: {torch.cuda.get_device_name()}  vocab {args.vocab}")
    print(f"copy bandwidth (read+write): {copy_bps / 1e12:.2f} TB/s")
    print(f"{'bs':>4} {'mode':<11} {'eager us':>9} {'replay us':>10} {'floor us':>9} {'fl/rep':>7}")
    for r in rows:
        print(
            f"{r['bs']:>4} {r['mode']:<11} {r['eager_us']:>9.1f} {r['replay_us']:>10.1f} "
            f"{r['floor_us']:>9.2f} {r['floor_over_replay']:>7.3f}"
        )
    report = {
        "device": torch.cuda.get_device_name(),
        "vocab": args.vocab,
        "copy_bytes_per_s": copy_bps,
        "rows": rows,
    }
    write_report(report, args.out, "bench_sampler.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
