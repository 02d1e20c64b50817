"""Which part of the 40-layer schedule slows recall? ``v41plan train``'s loop on cut schedules.

    python scripts/recall_depth_probe.py --ratios 0,0,1,1 --out DIR [--steps 1000] \
        [--time-limit 450] [--device cuda]
    python scripts/recall_depth_probe.py --ratios quality40 --out DIR    # the whole schedule

Trains ``validation.training.train`` (the quality model's own step: CUDA graphs, the corpus,
the per-kind accuracies in ``train_log.json``) from fresh weights on recall alone in its
multi-query form (``--recall-questions 8``, lists of 6 to ``--max-pairs`` pairs, all dense
attention; ``--fill-long``: no sums after the list, ``--copy-share``: copies among the
lists), at quality40's widths with the layer schedule ``--ratios`` (compress ratio a layer:
0 window-only, 1 or 2; each run of equal nonzero ratios owns its compressed rows and index at
its first layer, Engram at layer 1), or quality40's own 40 layers (``--init-checkpoint``: from
those weights). Prints ``v41plan train``'s progress lines; ``DIR/train_log.json`` keeps the
per-step accuracies of each answer kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from v41plan.geometry.resolve import resolve_spec
from v41plan.model.config import config_from_cache_spec
from v41plan.validation.training import TrainOptions, train


def schedule_config(ratios: list[int]):
    """quality40 with the layer schedule ``ratios`` (no MTP layers, Engram at layer 1)."""
    base = config_from_cache_spec(resolve_spec("quality40"))
    if ratios[:2] != [0, 0] or any(r not in (0, 1, 2) for r in ratios):
        raise ValueError(f"ratios {ratios}: want two window-only layers first, then 0, 1 or 2")
    owners = [i for i, r in enumerate(ratios) if r and (i == 0 or ratios[i - 1] != r)]
    ratio1 = [i for i in owners if ratios[i] == 1]
    return dataclasses.replace(
        base,
        num_hidden_layers=len(ratios),
        num_nextn_predict_layers=0,
        compress_ratios=list(ratios),
        kv_source_layer_ids=owners,
        index_source_layer_ids=owners,
        candidate_source_layer_id=ratio1[0] if ratio1 else owners[0],
        engram_layer_ids=[1],
        engram_num_embeddings=base.engram_num_embeddings[:1],
    )


def main(argv: list[str] | None = None) -> int:
    """Train and report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", required=True, help="comma-separated ratios, or quality40")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--max-pairs", type=int, default=16)
    ap.add_argument("--batch-seqs", type=int, default=16)
    ap.add_argument("--seq-tokens", type=int, default=640)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--time-limit", type=float, default=0.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-share", type=float, default=0.0, help="copies among long documents")
    ap.add_argument(
        "--fill-long", action="store_true", help="recall lists to each sequence's end, no sums"
    )
    ap.add_argument(
        "--init-checkpoint", default=None, help="go on from these weights (--ratios quality40)"
    )
    args = ap.parse_args(argv)
    if args.ratios == "quality40":
        cfg = config_from_cache_spec(resolve_spec("quality40"))
    else:
        cfg = schedule_config([int(r) for r in args.ratios.split(",")])
    opts = TrainOptions(
        steps=args.steps,
        batch_seqs=args.batch_seqs,
        seq_tokens=args.seq_tokens,
        dense_steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        copy_share=args.copy_share,
        fill_long=args.fill_long,
        init_checkpoint=args.init_checkpoint,
        max_recall_pairs=args.max_pairs,
        recall_questions=8,
        time_limit_s=args.time_limit,
    )
    log = train(cfg, "quality40", args.out, opts, args.device)
    summary = {k: log[k] for k in log if not isinstance(log[k], list)}
    print(json.dumps({"ratios": args.ratios, **summary}, default=str)[:2000])
    print(f"wrote {Path(args.out) / 'train_log.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
