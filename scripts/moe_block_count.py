"""Expert blocks a grouped-MoE decode step runs, by block rows, under uniform routing.

    python scripts/moe_block_count.py [--experts 32] [--topk 6] [--tokens 16,32,64] [--trials 2000]

Each token picks ``topk`` distinct experts uniformly; an expert holding ``c`` rows runs
``ceil(c / block_m)`` blocks, each streaming the expert's weights once. Prints the mean blocks a
step for 16- and 32-row blocks (``triton_moe.DECODE_ROWS32_FROM``'s estimate). Runs on the CPU.
"""

from __future__ import annotations

import argparse

import torch


def mean_blocks(tokens: int, experts: int, topk: int, block_m: int, trials: int, seed: int):
    """Mean over ``trials`` uniform routings of ``sum_e ceil(rows_e / block_m)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(trials, tokens, experts, generator=g).argsort(-1)[..., :topk]
    counts = torch.nn.functional.one_hot(ids, experts).sum((1, 2))  # [trials, experts]
    return float(((counts + block_m - 1) // block_m).sum(1).float().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--tokens", default="16,32,64")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"{'tokens':>6} {'16-row blocks':>14} {'32-row blocks':>14}")
    for n in (int(t) for t in args.tokens.split(",")):
        b16, b32 = (
            mean_blocks(n, args.experts, args.topk, bm, args.trials, args.seed) for bm in (16, 32)
        )
        print(f"{n:>6} {b16:>14.2f} {b32:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
