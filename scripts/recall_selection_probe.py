"""Whether the index's top-k selects the recalled pair's rows: the recall task's question, per
index layer, under the training forward with the index top-k.

    python scripts/recall_selection_probe.py --checkpoint DIR [--pairs 16,48] [--docs 20] \
        [--out reports/cpu/recall_selection_probe.json]

Documents come from ``recall_mc_probe.recall_docs`` (the same seed, so the same documents as
its multiple choice); each runs as its context and its true answer. At the row that predicts the
answer's lead digit (the answer's first byte is a space), for every layer that runs its own
top-k (roles ``full`` and ``reindex``): how often the selection holds the compressed row with
the value's lead digit (``value_hit``), the row with its key (``key_hit``), the median rank of
the lead digit's row among the visible rows' index scores (0: the best), and in the target the
index's KL loss trains toward (the heads' mean attention over every visible compressed row) that
row's median rank and mean mass: whether the attention itself looks there. A pair ``K=1234;``
starts at a multiple of 8 bytes, so at ratio 2 its key and its lead digit lie in two different
compressed rows (``[K, =]``, ``[1, 2]``), at ratio 1 in two different rows too: the index must
find the digit's row by what that row's latent carries of the key two tokens before it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recall_mc_probe import recall_docs, write_report

from v41plan.geometry.resolve import resolve_spec
from v41plan.model import train as T
from v41plan.model.checkpoint import engram_token_map, read_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.validation.provenance import provenance


@contextlib.contextmanager
def _record_selections(model: T.TrainModel):
    """Capture, per layer, the index scores each top-k selects from; restores the module's
    ``topk_ids`` and the model's ``_attention`` after the body."""
    seen: dict = {}
    layer = {"L": None}
    attention, topk, index_kl = model._attention, T.topk_ids, model._index_kl

    def _attention(L, x, ctx):
        layer["L"] = L
        return attention(L, x, ctx)

    def _topk(scores, k):
        seen[layer["L"]] = {"scores": scores.detach().clone(), **seen.get(layer["L"], {})}
        return topk(scores, k)

    def _index_kl(q, comp, scores, hidden, scale, ctx):
        # the KL's target, as _index_kl builds it: the heads' mean attention over the rows
        with torch.no_grad():
            B, S = ctx.B, ctx.S
            N, H, d = q.shape
            logits = torch.einsum("bshd,bmd->bshm", q.reshape(B, S, H, d).float(), comp.float())
            logits = (logits * scale).reshape(N, H, -1).masked_fill(hidden[:, None], T.NEG_INF)
            target = torch.softmax(logits, -1).nan_to_num(0.0).mean(1)
        seen.setdefault(layer["L"], {})["target"] = target
        return index_kl(q, comp, scores, hidden, scale, ctx)

    model._attention = _attention
    model._index_kl = _index_kl
    T.topk_ids = _topk
    try:
        yield seen
    finally:
        T.topk_ids = topk
        del model._attention, model._index_kl


def answer_marks(doc: dict) -> tuple[int, int, int]:
    """(the row predicting the answer's lead digit, the asked key's byte, the lead digit's byte)
    of a recall document: the answer is a space and the value, the pair ``K=1234;``."""
    key = doc["context"].split("question: what is ")[1][0]
    start = doc["context"].index(f"{key}=")  # the pair's first byte
    return len(doc["context"].encode()), start, start + 2


def probe(model, host, docs: list[dict]) -> dict:
    """Per index layer: value and key hit rates and the lead digit row's median rank."""
    cfg = model.cfg
    eos = cfg.eos_token_id
    rows = [list(d["context"].encode()) + list(d["choices"][d["label"]].encode()) for d in docs]
    marks = [answer_marks(d) for d in docs]
    s = max(len(r) for r in rows) + 1
    s += s % 2
    tok = np.full((len(rows), s + 1), eos, dtype=np.int64)
    for i, r in enumerate(rows):
        tok[i, : len(r)] = r
    batch = T.Batch(
        torch.from_numpy(tok[:, :s]),
        torch.from_numpy(tok[:, 1:]),
        torch.from_numpy(T.engram_rows(host, tok[:, :s])),
    )
    with _record_selections(model) as seen, torch.no_grad():
        model.forward(batch, dense=False)
    out = {}
    for L, got in sorted(seen.items()):
        ratio = cfg.layers[L].ratio
        m = got["scores"].shape[1]
        sc = got["scores"].reshape(len(rows), s, m)
        tg = got["target"].reshape(len(rows), s, m)
        v_hit, k_hit, ranks, t_ranks, t_mass = [], [], [], [], []
        for i, (qrow, key_byte, lead_byte) in enumerate(marks):
            row, want = sc[i, qrow], tg[i, qrow]
            top = set(torch.topk(row, cfg.index_topk).indices.tolist())
            v_row, k_row = lead_byte // ratio, key_byte // ratio
            v_hit.append(v_row in top)
            k_hit.append(k_row in top)
            ranks.append(int((row > row[v_row]).sum()))
            t_ranks.append(int((want > want[v_row]).sum()))
            t_mass.append(float(want[v_row]))
        out[L] = {
            "ratio": ratio,
            "role": cfg.layers[L].role,
            "value_hit": float(np.mean(v_hit)),
            "key_hit": float(np.mean(k_hit)),
            "value_rank_median": statistics.median(ranks),
            "target_rank_median": statistics.median(t_ranks),
            "target_mass_mean": float(np.mean(t_mass)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Print a table a list length and write the report; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--spec", default="quality40")
    ap.add_argument("--pairs", default="16,48", help="comma-separated list lengths")
    ap.add_argument("--docs", type=int, default=20, help="documents a list length")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = config_from_cache_spec(resolve_spec(args.spec))
    host = EngramHost(cfg, engram_token_map(cfg))
    rows = []
    for pairs in (int(p) for p in args.pairs.split(",")):
        model = T.TrainModel(cfg, 0, "cpu", init_state=read_state(args.checkpoint))
        layers = probe(model, host, recall_docs(pairs, args.docs))
        rows.append({"pairs": pairs, "docs": args.docs, "layers": layers})
        print(f"pairs {pairs}, {args.docs} documents, top-{cfg.index_topk}")
        print("  layer ratio role      value_hit key_hit value_rank target_rank target_mass")
        for L, r in layers.items():
            print(
                f"  {L:5d} {r['ratio']:5d} {r['role']:9s} {r['value_hit']:9.2f} "
                f"{r['key_hit']:7.2f} {r['value_rank_median']:10.1f} "
                f"{r['target_rank_median']:11.1f} {r['target_mass_mean']:11.3f}"
            )
    report = {
        "provenance": provenance(),
        "checkpoint": args.checkpoint,
        "spec": args.spec,
        "index_topk": cfg.index_topk,
        "rows": rows,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
