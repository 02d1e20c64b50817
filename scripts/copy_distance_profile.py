"""How far back can a checkpoint copy? Copy documents by filler length, through the engine.

    python scripts/copy_distance_profile.py --checkpoint DIR [--spec quality40] \
        [--fillers 0,4,8,16,32,64,100,120,200,420] [--docs 12] [--device cpu] [--out FILE.json]

For each filler length, ``--docs`` copy documents (``quality_tasks.copy_doc``, their own seed)
are scored letter by letter by ``V41PlanLM.loglikelihood`` (one request a letter,
the code's earlier letters given): the answer's log-likelihood a letter (a uniform guess over
the 24 letters is log(1/24) = -3.18), the share of documents whose every letter is the greedy
choice, the share greedy at each of the 8 places of the code, and the rows from the code's
first letter to the row that predicts it (the window is the spec's ``sliding_window``).
Writes the rows and the provenance to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from v41plan.validation.lm_eval_model import V41PlanLM
from v41plan.validation.provenance import provenance
from v41plan.validation.quality_tasks import copy_doc


def main(argv: list[str] | None = None) -> int:
    """Score and report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--fillers", default="0,4,8,16,32,64,100,120,200,420")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--device", default="cpu", help="the engine's device: cpu or cuda")
    ap.add_argument("--out", default="reports/cpu/copy_distance_profile.json")
    args = ap.parse_args(argv)
    lm = V41PlanLM(args.spec, args.checkpoint, progress=False, device=args.device, max_num_seqs=16)
    rows = []
    print(
        f"{'filler':>6} {'rows back':>9} {'ll/letter':>9} {'all greedy':>10} "
        f"{'greedy at each place':>39} {'s':>4}"
    )
    for filler in (int(f) for f in args.fillers.split(",")):
        t0 = time.perf_counter()
        rng = random.Random(f"copy distance profile:{filler}")
        docs = [copy_doc(rng, filler) for _ in range(args.docs)]
        n = len(docs[0]["answer"])
        requests = [(d["prompt"] + d["answer"][:j], d["answer"][j]) for d in docs for j in range(n)]
        scores = lm.loglikelihood(requests)
        greedy = [[scores[i * n + j][1] for j in range(n)] for i in range(len(docs))]
        d0 = docs[0]["prompt"]
        # from the code's first letter to the prompt's last row, which predicts it
        rows_back = len(d0.encode()) - 1 - (d0.index("code: ") + len("code: "))
        row = {
            "filler_chars": filler,
            "rows_back": rows_back,
            "loglik_per_letter": sum(ll for ll, _ in scores) / len(scores),
            "all_greedy": sum(all(g) for g in greedy) / len(docs),
            "greedy_by_place": [sum(g[j] for g in greedy) / len(docs) for j in range(n)],
            "docs": len(docs),
        }
        rows.append(row)
        places = " ".join(f"{x:.2f}" for x in row["greedy_by_place"])
        print(
            f"{filler:>6} {rows_back:>9} {row['loglik_per_letter']:>9.3f} "
            f"{row['all_greedy']:>10.2f} {places:>39} {time.perf_counter() - t0:>4.0f}",
            flush=True,
        )
    report = {
        "checkpoint": args.checkpoint,
        "spec": args.spec,
        "device": args.device,
        "uniform_guess_loglik": math.log(1 / 24),
        "provenance": provenance(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
