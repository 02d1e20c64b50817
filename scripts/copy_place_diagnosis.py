"""Which places of a copied code a checkpoint misses, and whether its index is the cause.

    python scripts/copy_place_diagnosis.py --checkpoint DIR [--spec quality40] \
        [--fillers 64,200] [--docs 3] [--shifts 0,1] [--out FILE.json]

Runs held-out copy documents (``quality_tasks.copy_doc``, their own seed) through the training
forward (``model.train.TrainModel``, the served arithmetic) on the CPU, each shifted by
``--shifts`` leading ``eos`` rows (so the code's letters pair differently in the ratio-2
compressed rows), and prints for every place of the code:

- the log-likelihood of the true letter with the index top-k (as served) and with every
  visible compressed row (the dense forward: no selection), so a place missed both ways is
  missing from the attention, not dropped by the index;
- for each index-owning layer, the code's places its top-k covers at the row that predicts
  that place.

Writes the rows and the provenance to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

import v41plan.model.train as train_model
from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.checkpoint import engram_token_map, read_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.validation.provenance import provenance
from v41plan.validation.quality_tasks import COPY_CODE_LETTERS, copy_doc

SPECS = Path(__file__).resolve().parents[1] / "specs"
CODE_OFFSET = len("code: ")
"""Rows before the code's first letter in a copy document."""


def main(argv: list[str] | None = None) -> int:
    """Diagnose and report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--fillers", default="64,200")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--shifts", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="reports/cpu/copy_place_diagnosis.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_from_cache_spec(load_cache_spec_unchecked(str(SPECS / f"{args.spec}.yaml")))
    model = train_model.TrainModel(cfg, 0, init_state=read_state(args.checkpoint))
    host = EngramHost(cfg, engram_token_map(cfg))
    owners = [i.index for i in cfg.layers if i.role in ("full", "reindex")]
    picks: list[torch.Tensor] = []
    topk = train_model.topk_ids

    def recording_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
        top = topk(scores, k)
        picks.append(top)
        return top

    train_model.topk_ids = recording_topk  # owners call it in layer order, once each
    rows = []
    rng = random.Random("copy place diagnosis")
    for filler in [int(f) for f in args.fillers.split(",")]:
        for _ in range(args.docs):
            doc = copy_doc(rng, filler)
            for shift in [int(s) for s in args.shifts.split(",")]:
                text = (doc["prompt"] + doc["answer"]).encode()
                ids = [cfg.eos_token_id] * shift + list(text) + [cfg.eos_token_id]
                S = (len(ids) - 1) // 2 * 2  # ratio-2 pairs close inside the sequence
                tok = np.asarray([ids[: S + 1]])
                batch = train_model.Batch(
                    torch.from_numpy(tok[:, :S]),
                    torch.from_numpy(tok[:, 1:]),
                    torch.from_numpy(train_model.engram_rows(host, tok[:, :S])),
                )
                first = shift + len(doc["prompt"])  # the repeat's first letter
                code = shift + CODE_OFFSET  # the code's first letter
                ll = {}
                for dense in (False, True):
                    picks.clear()
                    with torch.no_grad():
                        logits, _ = model.forward(batch, dense=dense)
                    lp = torch.log_softmax(logits.double(), -1)
                    ll[dense] = [
                        float(lp[first - 1 + p, tok[0, first + p]])
                        for p in range(COPY_CODE_LETTERS)
                    ]
                    if not dense:
                        sparse_picks = list(picks)
                covered = {}
                for L, top in zip(owners, sparse_picks, strict=True):
                    r = cfg.layers[L].ratio
                    covered[L] = []
                    for p in range(COPY_CODE_LETTERS):
                        sel = [x for x in top[first - 1 + p].tolist() if x >= 0]
                        at = {x * r + j for x in sel for j in range(r)}
                        covered[L].append(
                            [q + 1 for q in range(COPY_CODE_LETTERS) if code + q in at]
                        )
                rows.append(
                    {
                        "filler_chars": filler,
                        "shift": shift,
                        "code": doc["answer"],
                        "loglik_top_k": ll[False],
                        "loglik_dense": ll[True],
                        "places_covered_by_layer": {str(k): v for k, v in covered.items()},
                    }
                )
                fmt = " ".join(f"{v:6.2f}" for v in ll[False])
                fmt_d = " ".join(f"{v:6.2f}" for v in ll[True])
                print(f"filler {filler:4d} shift {shift}  top-k {fmt}\n{'':19s}dense {fmt_d}")
    for row in rows[-len(args.shifts.split(",")) :]:
        print(
            f"\nshift {row['shift']}: the code's places each index top-k covers at the rows "
            "predicting places 1 | 2 | 3 (the last document)"
        )
        for L, cov in row["places_covered_by_layer"].items():
            print(f"  layer {L:>2}: {cov[0]} | {cov[1]} | {cov[2]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "checkpoint": args.checkpoint,
        "spec": args.spec,
        "torch": torch.__version__,
        "provenance": provenance(),
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
