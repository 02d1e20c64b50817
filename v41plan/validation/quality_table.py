"""The README's quality table: the shipped tasks scored under each engine setting.

    python -m v41plan.validation.quality_table --checkpoint checkpoints/quality40w \\
        [--spec quality40w] [--limit 100] [--device cpu] [--jobs 2] \\
        [--out reports/cpu/quality_table.json]

Rows (the trained model unless said; the default engine is bf16 main KV, fp8 index, both
replays on):

- ``default``: as served.
- ``decoder replay off``: ``decoder_swa_bounded_replay=False``.
- ``prefix hit: encoder replay`` / ``prefix hit: copy transfer``: every generation prompt runs
  once for one token first, so the scored generation resumes from the prefix cache through the
  encoder replay or the copy transfer (``prefix_hit`` of ``V41PlanLM``; the row records the
  hit tokens, restores and replayed rows that happened). These rows prefill in 128-token
  chunks, so the copy transfer has checkpoint images on the hash-block grid to resume from.
- ``main fp4 / index fp8`` ... : the other main/index format pairs.
- ``random weights``: the spec's seeded random checkpoint, the chance baseline.

Scores come from ``V41PlanLM`` directly, with the requests and metrics lm-eval derives from the
shipped task files (so the table runs where lm-eval is not installed, the GPU image included);
``lm_eval --model v41plan`` over the same tasks gives the same numbers.

The multiple-choice task is scored by log-likelihood through every prompt row (the
``prompt_logprobs`` path runs without decoder replay and without prefix hits), so only the
format rows and the random baseline move it; replay rows concern the generation tasks.

One column is not an lm-eval task: ``copy_places``, copies whose code lies 34 to 146 rows
behind its repeat (past the 32-row window, short of the shipped copy task's 446), generated
greedily as ``copy_gen`` is, scored by the share of the code's places that the answer gets
right. Exact match would score 0 on a model that misses one place in eight; this column is
the long-context generation the replay and format rows can move.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from v41plan.validation.lm_eval_model import TASKS_DIR, V41PlanLM
from v41plan.validation.quality_tasks import GENERATION, TASK_METRICS, copy_doc

METRICS = TASK_METRICS
"""Each task's metric (lm-eval's name)."""
TASKS = tuple(METRICS)
COPY_PLACES = "copy_places"
"""The column of copies 34 to 146 rows back, scored place by place (not an lm-eval task)."""
COPY_PLACES_FILLER_CHARS = (8, 120)
"""Their filler: the code's first letter 26 + filler rows behind the row that copies it."""
COPY_PLACES_DOCS = 100
"""Its documents without ``--limit`` (as many as each shipped task has)."""
COLUMNS = (*TASKS, COPY_PLACES)
CHANCE = {
    "v41plan_kv_recall_mc": 0.25,
    "v41plan_copy_gen": 0.0,
    "v41plan_arith_gen": 0.0,
    COPY_PLACES: 1 / 24,
}
"""Chance level of each column (four choices; exact match of a free generation; one of the
code's 24 letters at each place)."""

_HIT = {"prefix_hit": True, "max_num_batched_tokens": 128}
"""Prefix-hit rows prefill in 128-token chunks: a non-final chunk ends on the hash-block grid
and leaves a checkpoint image there, which the copy transfer needs to resume from (a prompt
prefilled whole leaves none, and its hit recomputes); both transfers run alike."""

ROWS: list[tuple[str, dict, bool]] = [
    ("default", {}, True),
    ("random weights", {}, False),
    ("decoder replay off", {"decoder_swa_bounded_replay": False}, True),
    ("prefix hit: encoder replay", {**_HIT, "encoder_swa_bounded_replay": True}, True),
    ("prefix hit: copy transfer", {**_HIT, "encoder_swa_bounded_replay": False}, True),
    ("main bf16 / index fp4", {"index_cache_dtype": "fp4"}, True),
    ("main fp4 / index fp8", {"kv_cache_dtype": "fp4"}, True),
    ("main fp4 / index fp4", {"kv_cache_dtype": "fp4", "index_cache_dtype": "fp4"}, True),
]
"""(row name, ``V41PlanLM`` options, trained checkpoint?)."""


def load_docs(task: str, limit: int | None) -> list[dict]:
    """The first ``limit`` shipped documents of ``task`` (all without a limit)."""
    path = TASKS_DIR / f"{task.removeprefix('v41plan_')}.jsonl"
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    return docs if limit is None else docs[:limit]


def copy_places_docs(n: int) -> list[dict]:
    """The ``copy_places`` column's ``n`` documents (their own seed)."""
    rng = random.Random("v41plan quality table: copy places")
    return [copy_doc(rng, rng.randint(*COPY_PLACES_FILLER_CHARS)) for _ in range(n)]


def score_copy_places(lm, n: int) -> dict:
    """``copy_places``: greedy answers to ``n`` copy prompts under ``copy_gen``'s generation
    settings; each document scores the share of its code's places the answer matches."""
    until, max_toks = GENERATION["copy_gen"]
    docs = copy_places_docs(n)
    kw = {"until": until, "max_gen_toks": max_toks, "do_sample": False}
    outs = lm.generate_until([(d["prompt"], dict(kw)) for d in docs])
    hits = [
        sum(a == b for a, b in zip(o, d["answer"])) / len(d["answer"])
        for o, d in zip(outs, docs, strict=True)
    ]
    return _mean_stderr(hits)


def _mean_stderr(hits: list[float]) -> dict:
    err = float(np.std(hits, ddof=1) / np.sqrt(len(hits))) if len(hits) > 1 else None
    return {"value": float(np.mean(hits)), "stderr": err, "docs": len(hits)}


def score_tasks(lm, limit: int | None) -> dict:
    """Each task's metric over its shipped documents, scored as lm-eval scores the shipped
    task files (``tests/validation/test_quality_table.py`` checks the two agree): the choice
    of largest log-likelihood (first on ties) for ``acc``, the generation cut at the task's
    ``until`` strings equal to the answer for ``exact_match``; stderr is the sample one."""
    out = {}
    for task in TASKS:
        docs = load_docs(task, limit)
        name = task.removeprefix("v41plan_")
        if name in GENERATION:
            until, max_toks = GENERATION[name]
            kw = {"until": until, "max_gen_toks": max_toks, "do_sample": False}
            outs = lm.generate_until([(d["prompt"], dict(kw)) for d in docs])
            hits = [float(o == d["answer"]) for o, d in zip(outs, docs, strict=True)]
        else:
            reqs = [(d["context"], c) for d in docs for c in d["choices"]]
            lls = [ll for ll, _greedy in lm.loglikelihood(reqs)]
            hits, k = [], 0
            for d in docs:
                n = len(d["choices"])
                hits.append(float(int(np.argmax(lls[k : k + n])) == d["label"]))
                k += n
        out[task] = _mean_stderr(hits)
    return out


def score(spec: str, checkpoint: str | None, options: dict, limit: int | None, device: str):
    """Each task's metric for one engine setting, with the resumption stats."""
    engine = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, **options}
    lm = V41PlanLM(spec, checkpoint, progress=False, device=device, **engine)
    scores = score_tasks(lm, limit)
    scores[COPY_PLACES] = score_copy_places(lm, COPY_PLACES_DOCS if limit is None else limit)
    return scores, dict(lm.resumed)


def _score_row(spec, checkpoint, options, limit, device, threads):
    """One row in a worker process: its scores, resumption stats and seconds."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    scores, resumed = score(spec, checkpoint, options, limit, device)
    return scores, resumed, round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    """Score every row, print the table, write the JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="the trained checkpoint directory")
    ap.add_argument(
        "--spec", default="quality40w", help="the checkpoint's spec (default quality40w)"
    )
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default=None, help="comma-separated row names (default every row)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="rows scored at once, each in its own process with cores/jobs threads (default 1)",
    )
    ap.add_argument("--out", default="reports/cpu/quality_table.json")
    args = ap.parse_args(argv)
    from v41plan.validation.provenance import provenance

    wanted = None if args.rows is None else [r.strip() for r in args.rows.split(",")]
    known = [name for name, _, _ in ROWS]
    unknown = [r for r in wanted or () if r not in known]
    if unknown:
        ap.error(f"unknown rows {unknown}; the rows are {known}")
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    todo = [row for row in ROWS if wanted is None or row[0] in wanted]
    rows: list[dict] = []
    report = {
        "spec": args.spec,
        "checkpoint": args.checkpoint,
        "limit": args.limit,
        "device": args.device,
        "chance": CHANCE,
        "rows": rows,
        "provenance": provenance(),
        "command": "python -m v41plan.validation.quality_table " + " ".join(argv or sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def record(name, options, trained, scores, resumed, seconds):
        row = {"row": name, "options": options, "trained": trained, "scores": scores}
        if options.get("prefix_hit"):
            row["resumed"] = resumed
        row["seconds"] = seconds
        rows.append(row)
        cells = "  ".join(f"{t.removeprefix('v41plan_')} {scores[t]['value']:.3f}" for t in COLUMNS)
        print(f"{name:28s} {cells}  ({seconds:.0f} s)", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # after every row

    def job(options, trained, threads):
        ck = args.checkpoint if trained else None
        return (args.spec, ck, options, args.limit, args.device, threads)

    if args.jobs == 1:
        for name, options, trained in todo:
            record(name, options, trained, *_score_row(*job(options, trained, 0)))
    else:
        # spawn: a forked child would inherit the parent's torch thread pool state
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = [
                (name, options, trained, pool.submit(_score_row, *job(options, trained, threads)))
                for name, options, trained in todo
            ]
            for name, options, trained, fut in futures:
                record(name, options, trained, *fut.result())
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The report as the README's table."""
    cols = [t for t in COLUMNS if all(t in r["scores"] for r in report["rows"])]
    head = "| setting | " + " | ".join(t.removeprefix("v41plan_") for t in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for r in report["rows"]:
        cells = []
        for t in cols:
            s = r["scores"][t]
            err = f" ± {s['stderr']:.3f}" if isinstance(s.get("stderr"), float) else ""
            cells.append(f"{s['value']:.3f}{err}")
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
    chance = " | ".join(f"{report['chance'][t]:.2f}" for t in cols)
    lines.append(f"| chance | {chance} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
