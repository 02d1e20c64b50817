"""``v41plan init-checkpoint --spec S --out DIR --seed N``: write a random published-layout
checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from v41plan.cli.args import Refused, path_exists, spec_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``init-checkpoint``."""
    parser.add_argument(
        "--spec",
        required=True,
        help="spec file (specs/tiny.yaml) or compiled spec name (tiny); required",
    )
    parser.add_argument("--out", required=True, help="checkpoint directory to write; required")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (same seed, same bytes)"
    )
    parser.add_argument("--shard-mib", type=int, default=512, help="largest shard in MiB")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes writing shards in parallel (same bytes; memory about workers x 4 GiB "
        "at V4.1-Flash widths)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint; prints the directory, size and time."""
    spec = spec_arg(args.spec, "--spec")
    if args.shard_mib < 1:
        raise Refused(f"--shard-mib {args.shard_mib}: must be at least 1")
    if args.seed < 0:
        raise Refused(f"--seed {args.seed}: must be >= 0")
    if args.workers < 1:
        raise Refused(f"--workers {args.workers}: must be at least 1")
    out_dir = Path(args.out)
    if path_exists(out_dir) and not out_dir.is_dir():
        raise Refused(f"--out {args.out}: exists and is not a directory")
    from v41plan.model.checkpoint import write_checkpoint
    from v41plan.model.config import config_from_cache_spec

    try:
        cfg = config_from_cache_spec(spec)
    except ValueError as exc:
        raise Refused(f"--spec {args.spec}: its model section is refused: {exc}") from None
    t0 = time.perf_counter()
    try:
        out = write_checkpoint(
            out_dir,
            cfg,
            args.seed,
            shard_bytes=args.shard_mib << 20,
            progress=True,
            workers=args.workers,
        )
    except OSError as exc:
        print(
            f"v41plan init-checkpoint: --out {args.out}: cannot write "
            f"{exc.filename or args.out} ({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 1
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB, seed {args.seed}) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0
