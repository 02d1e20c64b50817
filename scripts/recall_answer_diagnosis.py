"""What a checkpoint predicts where `v41plan train`'s recall lists are answered, beside fresh
weights: the answers' loss, accuracy and entropy, the recall loss's gradient by tensor kind,
and the greedy answers next to the true ones.

    python scripts/recall_answer_diagnosis.py --checkpoint checkpoints/quality40 \
        [--seqs 4] [--seed 61] [--out reports/cpu/recall_answer_diagnosis.json]

The batch is the training corpus's own (``validation.training.Corpus``: lists of 6 to 16
pairs, eight questions a list, long documents to the end, as ``--fill-long
--recall-questions 8``), through the training forward with dense attention on the CPU. Only
the further questions' answer tokens (``recall_more``) are scored. Low entropy with a high
loss means the weights answer confidently and wrongly (a learned answer format, not a lookup);
a gradient far below the fresh weights' would mean the loss cannot move them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from v41plan.geometry.resolve import resolve_spec
from v41plan.model.checkpoint import engram_token_map, read_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.model.train import Batch, TrainModel, engram_rows
from v41plan.validation.provenance import provenance
from v41plan.validation.training import ANSWER_KINDS, Corpus

S = 640
"""Tokens a sequence (``v41plan train``'s default)."""


def _kind(name: str) -> str:
    """A master's tensor kind: its name without the layer index, to two parts."""
    parts = re.sub(r"layers\.\d+\.", "", name).split(".")
    return ".".join(parts[:2])


def _text(ids: list[int]) -> str:
    return "".join(chr(x) if 32 <= x < 127 else "|" for x in ids)


def diagnose(cfg, state, batch, answer, seed: int) -> dict:
    """One weight set's figures over ``batch`` (ids, targets, Engram rows)."""
    ids, targets, rows = batch
    m = TrainModel(cfg, seed, "cpu", init_state=state)
    logits, _ = m.forward(Batch(ids, targets, rows), dense=True)
    per = F.cross_entropy(logits, targets.reshape(-1), reduction="none")
    sel = answer.reshape(-1) == ANSWER_KINDS.index("recall_more") + 1
    loss = per[sel].mean()
    loss.backward()
    grad, weight = defaultdict(float), defaultdict(float)
    for k, v in m.masters.items():
        if v.grad is not None:
            grad[_kind(k)] += v.grad.float().pow(2).sum().item()
        weight[_kind(k)] += v.detach().float().pow(2).sum().item()
    pred = logits.detach().argmax(-1).reshape(targets.shape)
    examples = []
    for b in range(min(2, ids.shape[0])):
        at = (answer[b] == ANSWER_KINDS.index("recall_more") + 1).nonzero().flatten().tolist()
        examples.append(
            {
                "targets": _text([int(targets[b, i]) for i in at[:24]]),
                "greedy": _text([int(pred[b, i]) for i in at[:24]]),
            }
        )
    lg = logits.detach()[sel]
    return {
        "answer_tokens": int(sel.sum()),
        "loss": loss.item(),
        "accuracy": (lg.argmax(-1) == targets.reshape(-1)[sel]).float().mean().item(),
        "entropy": torch.distributions.Categorical(logits=lg).entropy().mean().item(),
        "all_token_loss": per.detach().mean().item(),
        "grad_norm_by_kind": {k: grad[k] ** 0.5 for k in sorted(grad, key=lambda k: -grad[k])},
        "weight_norm_by_kind": {k: weight[k] ** 0.5 for k in sorted(weight)},
        "examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    """Print and write the report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = config_from_cache_spec(resolve_spec(args.spec))
    corpus = Corpus(
        cfg, args.seed, S, 0.0, 0.3, max_filler_chars=420, max_recall_pairs=16,
        code_letters=(8, 8), recall_questions=8, fill_long=True,
    )  # fmt: skip
    tok, ans = corpus.batch(args.seqs)
    host = EngramHost(cfg, engram_token_map(cfg))
    batch = (
        torch.from_numpy(tok[:, :S]),
        torch.from_numpy(tok[:, 1:]),
        torch.from_numpy(engram_rows(host, tok[:, :S])),
    )
    answer = torch.from_numpy(ans[:, 1:]).long()
    report = {"provenance": provenance(), "checkpoint": args.checkpoint, "spec": args.spec}
    for name, state in (("checkpoint", read_state(args.checkpoint)), ("fresh", None)):
        r = report[name] = diagnose(cfg, state, batch, answer, args.seed)
        top = list(r["grad_norm_by_kind"].items())[:6]
        print(
            f"{name}: {r['answer_tokens']} answer tokens, loss {r['loss']:.3f}, accuracy "
            f"{r['accuracy']:.3f}, entropy {r['entropy']:.3f} (all tokens: loss "
            f"{r['all_token_loss']:.3f}); largest gradients "
            + ", ".join(f"{k} {v:.2g}" for k, v in top)
        )
        for ex in r["examples"]:
            print(f"   answers {ex['targets']}\n   greedy  {ex['greedy']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
