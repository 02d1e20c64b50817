"""``v41plan train --spec S --out DIR``: train a small V4.1 on the quality tasks' corpus and
write a published-layout checkpoint, ``train_log.json`` and ``loss.png``
(``v41plan.validation.training``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from v41plan.cli.args import Refused, path_exists, spec_arg

CORPUS_OPTIONS = (
    ("copy_share", float, "copy documents among the recall and copy ones"),
    ("short_copy_share", float, "copies whose code lies inside the window of its repeat"),
    (
        "max_filler_chars",
        int,
        "longest copy filler drawn (the task's own: 420; a first stage can cap it)",
    ),
    ("max_recall_pairs", int, "longest recall list drawn (the task's own: 48; at most 52)"),
    ("recall_questions", int, "questions a recall list asks (the task: 1; more: multi-query)"),
    ("min_code_letters", int, "shortest code of a copy past the window (the task's: 8)"),
    ("max_code_letters", int, "longest code of a copy past the window"),
)
"""The corpus mixture's flags: ``TrainOptions`` field, type, help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``train``; the defaults are those of the committed quality checkpoint."""
    from v41plan.validation.training import TrainOptions

    d = TrainOptions()
    parser.add_argument("--spec", required=True, help="spec file or compiled name (quality40)")
    parser.add_argument("--out", required=True, help="directory to write; required")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    parser.add_argument("--batch-seqs", type=int, default=d.batch_seqs, help="sequences a step")
    parser.add_argument(
        "--seq-tokens", type=int, default=d.seq_tokens, help="tokens a sequence (even)"
    )
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    parser.add_argument(
        "--dense-steps",
        type=int,
        default=d.dense_steps,
        help="warm-up steps attending to every compressed row",
    )
    for name, kind, text in CORPUS_OPTIONS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=getattr(d, name), help=text)
    parser.add_argument(
        "--fill-long",
        action="store_true",
        help="fill each sequence with recall and copy documents to its end instead of sums",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="weights and corpus seed")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="run the mHC prediction eagerly on CUDA too (default: torch.compile it there)",
    )
    parser.add_argument(
        "--init-checkpoint",
        default=None,
        help="go on training from this checkpoint's weights (same spec; the optimizer restarts; "
        "default: the init-checkpoint weights of --seed)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="stop after this many seconds of training and still write everything (0: no limit)",
    )


def run(args: argparse.Namespace) -> int:
    """Train; prints progress, then what it wrote."""
    spec = spec_arg(args.spec, "--spec")
    for name in ("steps", "batch_seqs", "seq_tokens"):
        if getattr(args, name) < 1:
            raise Refused(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.seq_tokens % 2:
        raise Refused(f"--seq-tokens {args.seq_tokens}: must be even (ratio-2 pairs)")
    if not 0 <= args.dense_steps:
        raise Refused(f"--dense-steps {args.dense_steps}: must be >= 0")
    for name in ("copy_share", "short_copy_share"):
        if not 0 <= getattr(args, name) <= 1:
            flag = f"--{name.replace('_', '-')}"
            raise Refused(f"{flag} {getattr(args, name)}: must be between 0 and 1")
    if args.max_filler_chars < 5:
        raise Refused(f"--max-filler-chars {args.max_filler_chars}: must be at least 5")
    if not 6 <= args.max_recall_pairs <= 52:
        raise Refused(f"--max-recall-pairs {args.max_recall_pairs}: must be 6 to 52 (its keys)")
    if args.recall_questions < 1:
        raise Refused(f"--recall-questions {args.recall_questions}: must be at least 1")
    if not 1 <= args.min_code_letters <= args.max_code_letters:
        raise Refused(
            f"--min-code-letters {args.min_code_letters}, --max-code-letters "
            f"{args.max_code_letters}: want 1 <= min <= max"
        )
    if args.lr <= 0:
        raise Refused(f"--lr {args.lr}: must be positive")
    out = Path(args.out)
    if path_exists(out) and not out.is_dir():
        raise Refused(f"--out {args.out}: exists and is not a directory")
    if args.init_checkpoint is not None and not Path(args.init_checkpoint).is_dir():
        raise Refused(f"--init-checkpoint {args.init_checkpoint}: not a directory")
    import torch

    from v41plan.model.config import config_from_cache_spec
    from v41plan.validation.training import TrainOptions, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Refused(f"--device {device}: CUDA is not available here")
    cfg = config_from_cache_spec(spec)
    if args.seq_tokens > cfg.max_position_embeddings:
        raise Refused(
            f"--seq-tokens {args.seq_tokens}: above the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    opts = TrainOptions(
        steps=args.steps,
        batch_seqs=args.batch_seqs,
        seq_tokens=args.seq_tokens,
        lr=args.lr,
        warmup_steps=min(TrainOptions.warmup_steps, args.steps),
        dense_steps=args.dense_steps,
        **{name: getattr(args, name) for name, _kind, _text in CORPUS_OPTIONS},
        fill_long=args.fill_long,
        seed=args.seed,
        graphs=not args.no_graphs,
        compile=not args.no_compile,
        log_every=min(TrainOptions.log_every, args.steps),
        time_limit_s=args.time_limit,
        init_checkpoint=args.init_checkpoint,
    )
    from v41plan.model.checkpoint import CheckpointError

    try:
        train(cfg, spec.name, out, opts, device, progress=lambda m: print(m, flush=True))
    except CheckpointError as exc:
        raise Refused(f"--init-checkpoint {exc}") from None
    except ValueError as exc:
        if opts.init_checkpoint and str(exc).startswith(opts.init_checkpoint):
            raise Refused(f"--init-checkpoint {exc}") from None
        raise
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `v41plan train --help`")
