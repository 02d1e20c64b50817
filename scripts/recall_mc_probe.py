"""The recall task's multiple choice at several list lengths, scored three ways: the training
forward with dense attention (every visible compressed row), the training forward with the
index top-k (what sparse training steps run), and the engine (``V41PlanLM``, as the quality
table scores).

    python scripts/recall_mc_probe.py --checkpoint DIR [--pairs 8,16,48] [--docs 20] \
        [--no-engine] [--device cpu] [--out reports/cpu/recall_mc_probe.json]

Documents come from the task's own generator (``quality_tasks.kv_recall_doc``) with a seed of
their own, one question on a key of the list's first third. Training accuracy on answer digits
overstates this score: the three wrong choices are values of the same list, so a lookup that
lands on the wrong pair still writes a well-formed value, and after the first digit is forced
the rest follow from it. Where dense and top-k differ, the index's selection is what loses the
answer; where the training forward and the engine differ, the engine's formats or paths do.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.geometry.resolve import resolve_spec
from v41plan.model.checkpoint import engram_token_map, read_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.model.train import Batch, TrainModel, engram_rows
from v41plan.validation.provenance import provenance
from v41plan.validation.quality_tasks import kv_recall_doc


def recall_docs(pairs: int, n: int) -> list[dict]:
    """``n`` multiple-choice recall documents of ``pairs`` pairs (their own seed)."""
    rng = random.Random(f"v41plan recall mc probe:{pairs}")
    return [kv_recall_doc(rng, pairs) for _ in range(n)]


def _accuracy(docs: list[dict], lls: list[float]) -> float:
    """Share of documents whose largest-log-likelihood choice (first on ties) is the label."""
    hits = [int(np.argmax(lls[4 * i : 4 * i + 4])) == d["label"] for i, d in enumerate(docs)]
    return float(np.mean(hits))


def train_forward_lls(model: TrainModel, host: EngramHost, docs: list[dict], dense: bool):
    """Each choice's log-likelihood after its context under the training forward."""
    eos = model.cfg.eos_token_id
    rows, spans = [], []
    for d in docs:
        ctx = list(d["context"].encode())
        for c in d["choices"]:
            rows.append(ctx + list(c.encode()))
            spans.append((len(ctx), len(c.encode())))
    s = max(len(r) for r in rows) + 1
    s += s % 2  # ratio-2 pairs close inside the sequence
    tok = np.full((len(rows), s + 1), eos, dtype=np.int64)
    for i, r in enumerate(rows):
        tok[i, : len(r)] = r
    dev = model.device
    batch = Batch(
        torch.from_numpy(tok[:, :s]).to(dev),
        torch.from_numpy(tok[:, 1:]).to(dev),
        torch.from_numpy(engram_rows(host, tok[:, :s])).to(dev),
    )
    with torch.no_grad():
        logits, _ = model.forward(batch, dense=dense)
    lp = F.log_softmax(logits.float(), -1).reshape(len(rows), s, -1).cpu()
    out = []
    for i, (a, n) in enumerate(spans):
        t = torch.tensor(rows[i][a : a + n])
        out.append(lp[i, a - 1 : a - 1 + n].gather(-1, t[:, None]).sum().item())
    return out


def write_report(report: dict, out: str | None) -> None:
    """Write ``report`` as JSON to ``out`` (its folders made; nothing without ``out``)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    """Print a line a list length and write the report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--pairs", default="8,16,48", help="comma-separated list lengths")
    ap.add_argument("--docs", type=int, default=20, help="documents a list length")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine's scores")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (training forward and engine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = config_from_cache_spec(resolve_spec(args.spec))
    host = EngramHost(cfg, engram_token_map(cfg))
    model = TrainModel(cfg, 0, args.device, init_state=read_state(args.checkpoint))
    lm = None
    if not args.no_engine:
        from v41plan.validation.lm_eval_model import V41PlanLM

        lm = V41PlanLM(
            args.spec, args.checkpoint, progress=False, device=args.device,
            max_num_seqs=64, max_num_batched_tokens=8192,
        )  # fmt: skip
    rows = []
    for pairs in (int(p) for p in args.pairs.split(",")):
        docs = recall_docs(pairs, args.docs)
        row = {"pairs": pairs, "docs": len(docs)}
        for name, dense in (("train_dense", True), ("train_topk", False)):
            row[name] = _accuracy(docs, train_forward_lls(model, host, docs, dense))
        if lm is not None:
            reqs = [(d["context"], c) for d in docs for c in d["choices"]]
            row["engine"] = _accuracy(docs, [ll for ll, _ in lm.loglikelihood(reqs)])
        rows.append(row)
        print(
            f"pairs {pairs:3d}  docs {len(docs)}  "
            + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)),
            flush=True,
        )
    report = {
        "provenance": provenance(),
        "checkpoint": args.checkpoint,
        "spec": args.spec,
        "index_topk": cfg.index_topk,
        "chance": 0.25,
        "device": args.device,
        "rows": rows,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
