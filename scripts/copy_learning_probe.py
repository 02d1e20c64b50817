"""Can a small V4.1 learn to copy a code from past its window? A CPU probe of the training path.

    python scripts/copy_learning_probe.py [--layers 4] [--steps 500] [--dense-steps 300] \
        [--min-filler 5] [--max-filler 40] [--window 32] [--out FILE.json]

Trains ``model.train.TrainModel`` (the published arithmetic, straight-through quantizers, the
indexer's KL loss) on copy documents (``quality_tasks.copy_doc``, filler drawn from
``--min-filler`` to ``--max-filler`` characters) and ``--recall-share`` recall lists of
``--min-pairs`` to ``--max-pairs`` pairs (as ``kv_recall_doc`` draws them; none by default;
``--recall-form repeat`` asks ``recall: KEY=`` instead of the task's question; ``--recall-keys``
picks five-letter word keys, the task's first ones, ``letters`` 24 capitals, or ``task`` its
one-letter keys with four-digit values;
``--recall-questions`` above 1 asks that many questions a list), at quality40's widths cut to
``--layers`` layers: two window-only layers, then ratio-1 layers (the first one owns the
compressed rows and the index, the rest reuse them). The first ``--dense-steps`` attend to
every visible compressed row, the rest to the index top-k, as ``v41plan train`` does. Every
25 steps it prints the share of answer letters the step's own batch predicted (argmax), split
by whether the code lay inside the window of the row that copies it, and the share of recall
answer tokens, and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.geometry.resolve import resolve_spec
from v41plan.model.checkpoint import engram_token_map
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.model.train import Batch, TrainModel, engram_rows
from v41plan.validation.provenance import provenance
from v41plan.validation.quality_tasks import RECALL_KEYS, copy_doc
from v41plan.validation.training import Corpus

KEY_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


WORD_KEYS = [
    "amber", "basil", "cedar", "delta", "ember", "flint", "grove", "haven", "ivory", "jade",
    "karma", "lunar", "maple", "nexus", "onyx", "pearl", "quill", "raven", "sable", "tango",
    "umber", "viola", "willow", "xenon", "yarrow", "zephyr", "acorn", "birch", "coral", "dune",
]  # fmt: skip
"""The recall task's first keys: five-letter words, five tokens each."""


def _key_pool(keys: str) -> list[str] | str:
    return {"words": WORD_KEYS, "letters": KEY_LETTERS, "task": RECALL_KEYS}[keys]


def _value_range(keys: str) -> tuple[int, int]:
    """Values of a list: four digits with the task's keys (as ``kv_recall_doc``), else three."""
    return (1000, 10000) if keys == "task" else (100, 1000)


def recall_doc(rng: random.Random, pairs: int, form: str, keys: str) -> dict:
    """A recall document ``{"context", "choices", "label"}`` as ``kv_recall_doc`` draws it,
    with keys from ``keys``'s pool (``words``: the task's first five-letter keys;
    ``letters``: 24 capitals; ``task``: the task's one-letter keys), and with
    ``form == "repeat"`` the list closed by ``recall: KEY=`` instead of the question (the
    list's own ``KEY=``: a head that finds the key's earlier occurrence and takes what follows
    answers it)."""
    names = rng.sample(_key_pool(keys), k=min(pairs, len(_key_pool(keys))))
    values = [rng.randrange(*_value_range(keys)) for _ in names]
    q = rng.randrange(0, max(1, len(names) // 3))  # as kv_recall_doc: outside the window
    lines = " ".join(f"{k}={v};" for k, v in zip(names, values, strict=True))
    key, value = names[q], str(values[q])
    if form == "repeat":
        return {"context": f"{lines}\nrecall: {key}=", "choices": [value], "label": 0}
    ask = f"question: what is {key}? answer:"
    return {"context": f"{lines}\n{ask}", "choices": [f" {value}"], "label": 0}


def multi_recall_text(
    rng: random.Random, pairs: int, form: str, keys: str, questions: int, window: int
) -> tuple[str, list[int]]:
    """A recall list followed by ``questions`` questions (or ``recall: KEY=`` lines), each on
    another key of the whole list with its answer: the multi-query form of the lookup, many
    answers a list. Returns the text and a mark a character: 3 on an answer whose value in
    the list lies past the ``window`` of the row that predicts it, 4 inside it, else 0."""
    pool = _key_pool(keys)
    names = rng.sample(pool, k=min(pairs, len(pool)))
    values = [str(rng.randrange(*_value_range(keys))) for _ in names]
    starts, text = [], ""
    for k, v in zip(names, values, strict=True):
        starts.append(len(text) + len(k) + 1)
        text += f"{k}={v}; "
    text = text.rstrip()
    marks = [0] * len(text)
    for q in rng.sample(range(len(names)), k=min(questions, len(names))):
        ask = (
            f"\nrecall: {names[q]}="
            if form == "repeat"
            else f"\nquestion: what is {names[q]}? answer: "
        )
        text += ask
        past = len(text) - 1 - starts[q] >= window
        text += values[q]
        marks += [0] * len(ask) + [3 if past else 4] * len(values[q])
    return text, marks


CODE_TO_REPEAT_ROWS = 26
"""Rows from a code letter to the row that copies it, without filler (``copy_doc``'s text)."""


def probe_config(layers: int, window: int):
    """quality40 cut to ``layers`` layers (2 window-only, then ratio 1), Engram at layer 1."""
    base = config_from_cache_spec(resolve_spec("quality40"))
    return dataclasses.replace(
        base,
        num_hidden_layers=layers,
        num_nextn_predict_layers=0,
        compress_ratios=[0, 0] + [1] * (layers - 2),
        kv_source_layer_ids=[2],
        index_source_layer_ids=[2],
        candidate_source_layer_id=2,
        engram_layer_ids=[1],
        engram_num_embeddings=base.engram_num_embeddings[:1],
        sliding_window=window,
    )


def main(argv: list[str] | None = None) -> int:
    """Train and report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--dense-steps", type=int, default=300)
    ap.add_argument("--batch-seqs", type=int, default=8)
    ap.add_argument("--seq-tokens", type=int, default=128)
    ap.add_argument("--min-filler", type=int, default=5)
    ap.add_argument("--max-filler", type=int, default=40)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument(
        "--recall-share", type=float, default=0.0, help="recall documents among the copies"
    )
    ap.add_argument("--min-pairs", type=int, default=6, help="shortest recall list (pairs)")
    ap.add_argument("--max-pairs", type=int, default=10, help="longest recall list (pairs)")
    ap.add_argument("--recall-form", default="question", choices=["question", "repeat"])
    ap.add_argument(
        "--recall-questions",
        type=int,
        default=1,
        help="questions a recall list (above 1: the multi-query form, keys from the whole list)",
    )
    ap.add_argument("--recall-keys", default="words", choices=["words", "letters", "task"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (eager steps on either)")
    ap.add_argument(
        "--corpus",
        default="probe",
        choices=["probe", "train"],
        help="train: draw the batches from v41plan train's corpus instead (its copy share, "
        "--max-pairs, --recall-questions; sums fill each sequence), its marks mapped to these",
    )
    ap.add_argument(
        "--time-limit", type=float, default=0.0, help="stop after this many seconds (0: none)"
    )
    ap.add_argument("--out", default="reports/cpu/copy_learning_probe.json")
    args = ap.parse_args(argv)
    if args.layers < 3:
        ap.error("--layers must be at least 3 (two window layers, then ratio 1)")
    torch.set_num_threads(args.threads)
    if not 4 <= args.min_pairs <= args.max_pairs:
        ap.error(
            f"--min-pairs {args.min_pairs}, --max-pairs {args.max_pairs}: want 4 <= min <= max"
        )
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    cfg = probe_config(args.layers, args.window)
    model = TrainModel(cfg, args.seed, dev)
    host = EngramHost(cfg, engram_token_map(cfg))
    rng = random.Random(f"copy-probe:{args.seed}")
    B, S = args.batch_seqs, args.seq_tokens

    corpus = None
    if args.corpus == "train":
        corpus = Corpus(
            cfg,
            args.seed + 1,
            S,
            1.0 - args.recall_share,
            0.0,
            max_filler_chars=max(args.max_filler, 5),
            max_recall_pairs=args.max_pairs,
            recall_questions=args.recall_questions,
        )
    # v41plan train's answer kinds (sum, copy in/past window, recall, recall_more) as marked here
    train_marks = np.array([0, 5, 1, 2, 3, 3], dtype=np.int64)

    def batch() -> tuple[np.ndarray, np.ndarray]:
        if corpus is not None:
            tok, ans = corpus.batch(B)
            return tok, train_marks[ans.astype(np.int64)]
        rows, marks = [], []
        for _ in range(B):
            ids, kind = [], []
            while len(ids) <= S:
                if rng.random() < args.recall_share:
                    try:
                        pairs = rng.randint(args.min_pairs, args.max_pairs)
                        if args.recall_questions > 1:
                            text, m = multi_recall_text(
                                rng,
                                pairs,
                                args.recall_form,
                                args.recall_keys,
                                args.recall_questions,
                                cfg.sliding_window,
                            )
                            ids += [*text.encode(), cfg.eos_token_id]
                            kind += [*m, 0]
                            continue
                        d = recall_doc(rng, pairs, args.recall_form, args.recall_keys)
                    except ValueError:  # a short list without three other distinct values
                        continue
                    answer = d["choices"][d["label"]]
                    t = [*(d["context"] + answer).encode(), cfg.eos_token_id]
                    ids += t
                    kind += [0] * (len(t) - 1 - len(answer)) + [3] * len(answer) + [0]
                    continue
                filler = rng.randint(args.min_filler, args.max_filler)
                d = copy_doc(rng, filler)
                t = [*(d["prompt"] + d["answer"]).encode(), cfg.eos_token_id]
                inside = CODE_TO_REPEAT_ROWS + filler < cfg.sliding_window
                ids += t
                kind += [0] * (len(t) - 9) + [1 if inside else 2] * 8 + [0]
            rows.append(ids[: S + 1])
            marks.append(kind[: S + 1])
        return np.asarray(rows), np.asarray(marks)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    log, t0 = [], time.perf_counter()
    print(
        "| step | attention | loss | index KL | copied letters right, inside the window "
        "| past it | recall answer tokens right | in-window recall (multi-query) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for step in range(args.steps):
        last = step == args.steps - 1 or (
            args.time_limit > 0 and time.perf_counter() - t0 > args.time_limit
        )
        tok, kind = batch()
        b = Batch(
            torch.from_numpy(tok[:, :S]).to(dev),
            torch.from_numpy(tok[:, 1:]).to(dev),
            torch.from_numpy(engram_rows(host, tok[:, :S])).to(dev),
        )
        dense = step < args.dense_steps
        logits, aux = model.forward(b, dense=dense)
        k = torch.from_numpy(kind[:, 1:]).reshape(-1).to(dev)
        w = torch.where(k > 0, 5.0, 1.0)
        per = F.cross_entropy(logits, b.targets.reshape(-1), reduction="none")
        loss = (per * w).sum() / w.sum() + aux["index_kl"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        model.update_router_bias(aux["expert_load"].detach(), 1e-3)
        if step % 25 == 0 or last:
            right = (logits.argmax(-1) == b.targets.reshape(-1)).float()
            share = {
                name: (right[k == v].mean().item() if bool((k == v).any()) else None)
                for name, v in (("inside", 1), ("past", 2), ("recall", 3), ("recall_inside", 4))
            }
            row = {
                "step": step,
                "dense": dense,
                "loss": loss.item(),
                "index_kl": aux["index_kl"].item(),
                **share,
                "s": time.perf_counter() - t0,
            }
            log.append(row)
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            print(
                f"| {step} | {'dense' if dense else 'top-k'} | {row['loss']:.3f} | "
                f"{row['index_kl']:.3f} | {fmt(share['inside'])} | {fmt(share['past'])} | "
                f"{fmt(share['recall'])} | {fmt(share['recall_inside'])} |",
                flush=True,
            )
        if last:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "options": vars(args),
        "layers": [(i.ratio, i.role) for i in cfg.layers],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "provenance": provenance(),
        "rows": log,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
