"""``v41plan init-checkpoint --spec S --out DIR --seed N``: write a random published-layout
checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``init-checkpoint``."""
    parser.add_argument(
        "--spec", required=True, help="spec file (specs/tiny.yaml) or compiled spec name (tiny)"
    )
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument(
        "--shard-mib", type=int, default=512, help="largest shard in MiB (default 512)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes writing shards in parallel (same bytes; memory about workers x 4 GiB "
        "at V4.1-Flash widths)",
    )


def _cache_spec(spec: str):
    """The compiled spec when its generated code exists, else the YAML file read directly."""
    import importlib.util

    from v41plan.geometry.runtime import generated_package, load_cache_spec

    p = Path(spec)
    name = p.stem if p.suffix in (".yaml", ".yml") else spec
    try:
        compiled = importlib.util.find_spec(generated_package(name) + ".geometry") is not None
    except ModuleNotFoundError:
        compiled = False
    if compiled:
        return load_cache_spec(spec)
    if not p.exists():
        p = Path("specs") / f"{name}.yaml"
    if not p.exists():
        raise ValueError(
            f"spec {spec!r}: no compiled code under v41plan/generated/{name}/ and no file {p}"
        )
    from v41plan.geometry.derive import load_cache_spec_unchecked

    return load_cache_spec_unchecked(str(p))


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint; prints the directory, size and time."""
    from v41plan.model.checkpoint import write_checkpoint
    from v41plan.model.config import config_from_cache_spec

    try:
        cfg = config_from_cache_spec(_cache_spec(args.spec))
    except (ValueError, OSError) as exc:
        print(f"v41plan init-checkpoint: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = write_checkpoint(
        args.out,
        cfg,
        args.seed,
        shard_bytes=args.shard_mib << 20,
        progress=True,
        workers=max(1, args.workers),
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB, seed {args.seed}) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0
