"""Decoder-replay deviation against a full prefill, and the index-query rounding difference.

    python benchmarks/replay_deviation.py [--spec tiny40] [--lengths 96,160,256,384] [--decodes 8]

For each prompt the paged runtime prefills it in one forward twice, with decoder SWA bounded
replay off (a full prefill: every layer on every row) and on (the decoder on the last W rows,
the last layer's query on the last row), then teacher-forces ``--decodes`` decode steps in
both. Printed per prompt: max and mean |logit error| relative to the largest |logit| of the
full prefill, and top-1 agreement, at the prompt's last row and over the decode steps (whose
decoder rings hold the replayed rows). Random weights (``init-checkpoint`` arithmetic,
seed 0), float32, main KV bf16, index plane fp8.

The second table measures the index query's rounding: the published model FP4-rounds the index
query and key alike (E2M1 with E8M0 per 32 lanes); the FP8 plane's paged scorer rounds the
query itself to E4M3 with one fp32 scale per (row, head), against E4M3 keys with one fp32 scale
per row. It compares the dense reference under both (same weights, float64, full prefill):
the fraction of index top-k lists that are identical, and the logit deviation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.reference import ReferenceModel
from v41plan.planner.step import RequestInput, StepInput, plan_step
from v41plan.runtime.paged_model import RuntimeModel

ROOT = Path(__file__).resolve().parent.parent


def _errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max, mean) |a - b| relative to max |b|, and whether the argmax agrees."""
    scale = b.abs().max().item()
    d = (a - b).abs()
    return d.max().item() / scale, d.mean().item() / scale, bool(a.argmax() == b.argmax())


def replay_table(spec, w, eng, cfg, lengths, decodes, dtype) -> list[dict]:
    """Per prompt length: the replayed forward against the full prefill."""
    rows = []
    page = spec.geometry().page_tokens
    for n in lengths:
        ids = np.random.default_rng(n).integers(0, 256, n + decodes)
        table = tuple(range((n + decodes) // page + 1))
        out = {}
        for on in (False, True):
            m = RuntimeModel(
                spec,
                w,
                eng,
                kv_cache_dtype="bf16",
                index_cache_dtype="fp8",
                num_pages=len(table) + 1,
                num_slots=2,
                max_tokens=n,
                max_bs=1,
                table_width=len(table),
                dtype=dtype,
                cfg=cfg,
            )
            m.pools.reset_slot(1)
            plan = plan_step(StepInput((RequestInput(1, table, n, 0, n),)), spec, decoder_replay=on)
            logits = [m.forward(plan, ids[:n]).logits[0]]
            for k in range(decodes):
                p = plan_step(
                    StepInput((RequestInput(1, table, n, n + k, 1, phase="decode"),)),
                    spec,
                    decoder_replay=on,
                )
                logits.append(m.forward(p, ids[n + k : n + k + 1]).logits[0])
            decoder_rows = sum(
                v
                for (L, s), v in m.row_counts.items()
                if L >= spec.last_kv_source and s in ("attention", "ffn")
            )
            out[on] = (logits, decoder_rows)
        last = _errors(out[True][0][0], out[False][0][0])
        dec = [_errors(a, b) for a, b in zip(out[True][0][1:], out[False][0][1:])]
        rows.append(
            {
                "prompt": n,
                "last_max": last[0],
                "last_mean": last[1],
                "last_top1": last[2],
                "dec_max": max((e[0] for e in dec), default=0.0),
                "dec_mean": statistics.fmean(e[1] for e in dec) if dec else 0.0,
                "dec_top1": sum(e[2] for e in dec) / max(len(dec), 1),
                "rows_on": out[True][1],
                "rows_off": out[False][1],
            }
        )
    return rows


def query_rounding_table(cfg, w, eng, lengths) -> list[dict]:
    """Published FP4 index q/k against the FP8 plane's rounding, dense reference, float64."""
    out = []
    for n in lengths:
        ids = np.random.default_rng(n).integers(0, 256, n)
        runs = {}
        for fmt in (None, "fp8"):
            ref = ReferenceModel(cfg, w, eng, torch.float64, index_cache_dtype=fmt)
            runs[fmt] = (ref.prefill(ids), {k: v.clone() for k, v in ref.selections.items()})
        (l4, s4), (l8, s8) = runs[None], runs["fp8"]
        same = [bool((s4[k][i] == s8[k][i]).all()) for k in s4 for i in range(n)]
        overlap = [
            len(set(s4[k][i].tolist()) & set(s8[k][i].tolist()) - {-1})
            / max(len(set(s4[k][i].tolist()) - {-1}), 1)
            for k in s4
            for i in range(n)
        ]
        err = _errors(l8[-1], l4[-1])
        out.append(
            {
                "prompt": n,
                "lists_identical": sum(same) / len(same),
                "ids_shared": statistics.fmean(overlap),
                "last_max": err[0],
                "last_mean": err[1],
                "top1": err[2],
                "top1_all_rows": float((l8.argmax(-1) == l4.argmax(-1)).double().mean()),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Print both tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="tiny40", help="spec name under specs/ (default tiny40)")
    ap.add_argument("--lengths", default="96,160,256,384", help="prompt lengths, comma-separated")
    ap.add_argument(
        "--decodes", type=int, default=8, help="teacher-forced decode steps after each prompt"
    )
    ap.add_argument(
        "--query-lengths", default="160,384", help="prompt lengths of the query-rounding table"
    )
    args = ap.parse_args(argv)
    spec = load_cache_spec_unchecked(str(ROOT / "specs" / f"{args.spec}.yaml"))
    cfg = config_from_cache_spec(spec)
    t0 = time.perf_counter()
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    w64 = ckpt.process(torch.float64)
    eng = ckpt.engram_host()
    lengths = [int(x) for x in args.lengths.split(",")]
    W = spec.dims.sliding_window
    print(
        f"# decoder replay vs full prefill: spec {args.spec}, W={W}, "
        f"PAGE={spec.geometry().page_tokens}, "
        f"random weights seed 0, float32, bf16 main / fp8 index"
    )
    print(
        "| prompt | last-row max err | last-row mean err | last-row top-1 | decode max err | "
        "decode mean err "
        "| decode top-1 | decoder rows on/off |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in replay_table(spec, w64, eng, cfg, lengths, args.decodes, torch.float32):
        print(
            f"| {r['prompt']} | {r['last_max']:.3e} | {r['last_mean']:.3e} "
            f"| {'yes' if r['last_top1'] else 'no'} "
            f"| {r['dec_max']:.3e} | {r['dec_mean']:.3e} | {r['dec_top1']:.0%} | "
            f"{r['rows_on']}/{r['rows_off']} |"
        )
    qlens = [int(x) for x in args.query_lengths.split(",")]
    print()
    print(
        "# index-query rounding: FP8 plane (scorer rounds q to E4M3 per row/head) vs published "
        "FP4 q/k;"
        " dense reference, float64"
    )
    print(
        "| prompt | top-k lists identical | ids shared | last-row max err | last-row mean err | "
        "last-row top-1 "
        "| top-1 over rows |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in query_rounding_table(cfg, w64, eng, qlens):
        print(
            f"| {r['prompt']} | {r['lists_identical']:.1%} | {r['ids_shared']:.1%} | "
            f"{r['last_max']:.3e} "
            f"| {r['last_mean']:.3e} | {'yes' if r['top1'] else 'no'} | {r['top1_all_rows']:.1%} |"
        )
    print(
        "\n(errors are relative to the largest |logit| of the baseline; "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
