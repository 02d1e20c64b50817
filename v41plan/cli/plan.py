"""``v41plan plan SPEC --batch FILE.json [--json]``: print the plan of a described step.

Input (``FILE.json``, or ``-`` for stdin)::

    {"phase": "prefill" | "decode",
     "requests": [{"prompt_len": 300, "start": 256, "chunk_len": 44, "prefix_hit": 256}],
     "running_bs": 4, "running_tokens": 512}            # optional widths

Per request, ``phase`` (overrides the step's), ``prefix_hit`` (default 0), ``full_rows``
(every row through every layer for this request, default false) and ``fresh_slot`` are
optional; ``fresh_slot`` defaults to true for a resume at a hit (``start == prefix_hit >
0``) under encoder replay (the ``replay`` transfer rebuilds such a slot). ``start`` is where the
scheduler resumed before any back-off. Slots and block tables are synthetic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from v41plan.cli.args import Refused, spec_arg
from v41plan.planner.stages import PHASES

_REQUEST_KEYS = {
    "prompt_len",
    "start",
    "chunk_len",
    "prefix_hit",
    "fresh_slot",
    "phase",
    "full_rows",
}


class BatchError(ValueError):
    """A batch description that is not valid JSON of the documented shape."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``v41plan plan``."""
    p.add_argument("spec", help="spec path (specs/tiny.yaml) or compiled spec name (tiny)")
    p.add_argument(
        "--batch", required=True, help="batch description JSON file ('-' for stdin); required"
    )
    p.add_argument("--json", action="store_true", help="print JSON (default: a readable table)")
    p.add_argument(
        "--no-decoder-swa-bounded-replay",
        dest="decoder_replay",
        action="store_false",
        default=None,
        help="plan with decoder bounded replay off (default: the spec's rule, on)",
    )
    p.add_argument(
        "--no-encoder-swa-bounded-replay",
        dest="encoder_replay",
        action="store_false",
        default=None,
        help="plan with the copy transfer, encoder bounded replay off (default: the spec's "
        "rule, on)",
    )


def _int(d: dict, key: str, where: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if v is None:
        raise BatchError(f"{where}: missing {key!r}")
    if isinstance(v, bool) or not isinstance(v, int):
        raise BatchError(f"{where}: {key!r} must be an integer, got {v!r}")
    if v < 0:
        raise BatchError(f"{where}: {key!r} must be >= 0, got {v}")
    return v


def parse_batch(doc, spec, encoder_replay: bool):
    """A ``StepInput`` from the documented JSON shape (synthetic slots and block tables)."""
    from v41plan.planner.step import RequestInput, StepInput

    if not isinstance(doc, dict):
        raise BatchError("the batch must be a JSON object with 'phase' and 'requests'")
    phase = doc.get("phase", "prefill")
    if phase not in ("prefill", "decode"):
        raise BatchError(f"'phase' must be 'prefill' or 'decode', got {phase!r}")
    reqs = doc.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise BatchError("'requests' must be a non-empty list")
    unknown = set(doc) - {"phase", "requests", "running_bs", "running_tokens"}
    if unknown:
        raise BatchError(f"unknown batch keys: {', '.join(sorted(unknown))}")
    page = next(iter(spec.geometries.values())).page_tokens
    out = []
    next_page = 0
    for i, r in enumerate(reqs):
        where = f"request {i}"
        if not isinstance(r, dict):
            raise BatchError(f"{where}: must be an object")
        extra = set(r) - _REQUEST_KEYS
        if extra:
            raise BatchError(f"{where}: unknown keys: {', '.join(sorted(extra))}")
        prompt_len = _int(r, "prompt_len", where)
        start = _int(r, "start", where)
        chunk_len = _int(r, "chunk_len", where)
        hit = _int(r, "prefix_hit", where, 0)
        rphase = r.get("phase", phase)
        if rphase not in ("prefill", "decode"):
            raise BatchError(f"{where}: 'phase' must be 'prefill' or 'decode', got {rphase!r}")
        fresh = r.get("fresh_slot", rphase == "prefill" and encoder_replay and 0 < hit == start)
        full = r.get("full_rows", False)
        if not isinstance(fresh, bool) or not isinstance(full, bool):
            raise BatchError(f"{where}: 'fresh_slot' and 'full_rows' must be true or false")
        pages = -(-(start + chunk_len) // page)
        out.append(
            RequestInput(
                slot=i,
                block_table=tuple(range(next_page, next_page + pages)),
                prompt_len=prompt_len,
                start=start,
                chunk_len=chunk_len,
                phase=rphase,
                prefix_hit=hit,
                fresh_slot=fresh,
                full_rows=full,
            )
        )
        next_page += pages
    widths = {
        k: _int(doc, k, "batch") if k in doc else None for k in ("running_bs", "running_tokens")
    }
    return StepInput(tuple(out), **widths)


def _span(lo: int, hi: int) -> list[int] | None:
    """Inclusive ``[first, last]`` of ``[lo, hi)``, or None when empty."""
    return [lo, hi - 1] if hi > lo else None


def describe(plan, window: int) -> dict:
    """The documented JSON view of a ``StepPlan`` (``window``: the spec's W)."""
    table = plan.table
    reqs = []
    for i in range(plan.scheduled_bs):
        fs, end = int(plan.forward_start[i]), int(plan.forward_end[i])
        tail = int(plan.tail_start[i])
        if plan.is_decode[i]:
            phase = "decode"
        else:
            phase = "prefill_final" if plan.is_final_chunk[i] else "prefill_nonfinal"
        column = PHASES[int(plan.row_phase[i])]  # a full_rows request follows every row
        by_set = {"all": _span(fs, end), "tail": _span(max(fs, end - window), end),
                  "last": _span(end - 1, end), "none": None}  # fmt: skip
        stages = [
            {"layers": e["layers"], "sub_step": e["sub_step"], "rows": by_set[e["rows"]]}
            for e in table.ranges(column, include_none=True)
        ]
        groups = []
        for r, c in sorted(plan.compress.items()):
            sel = c.batch_ids == i
            rows = c.compressed_rows[sel]
            groups.append({
                "ratio": r,
                "compressed_rows": [int(rows[0]), int(rows[-1])] if len(rows) else None,
                "count": len(rows),
                "first_from_tail": bool(c.first_from_tail[sel].any()),
                "tail_store": bool((c.tail_store_batch_ids == i).any()),
            })  # fmt: skip
        reqs.append({
            "phase": phase,
            "full_rows": column == "decode" and phase != "decode",
            "prompt_len": int(plan.prompt_lens[i]),
            "resume": int(plan.resume_points[i]),
            "prefix_hit": int(plan.prefix_hits[i]),
            "forward_start": fs,
            "forward_end": end,
            "rows": end - fs,
            "is_final_chunk": bool(plan.is_final_chunk[i]),
            "tail": _span(tail, end) if tail >= 0 else None,
            "swa_replay_start": int(plan.swa_replay_start[i]),
            "encoder_window_floor": int(plan.encoder_window_floor[i]),
            "write_from": int(plan.write_from[i]),
            "cached_until": int(plan.cached_until[i]),
            "swa_cached_until": int(plan.swa_cached_until[i]),
            "last_row": end - 1,
            "last_flat_row": int(plan.last_rows[i]),
            "cu_seqlens_q": [int(plan.cu_seqlens_q[i]), int(plan.cu_seqlens_q[i + 1])],
            "history_ids": [int(x) for x in plan.history_ids[i]],
            "history_from_plan": bool(plan.history_from_plan[i]),
            "compress": groups,
            "stages": stages,
        })  # fmt: skip
    return {
        "spec": table.spec_name,
        "graph_key": list(plan.graph_key),
        "decoder_replay": plan.decoder_replay,
        "encoder_replay": table.encoder_replay,
        "running_bs": plan.running_bs,
        "running_tokens": plan.running_tokens,
        "scheduled_bs": plan.scheduled_bs,
        "scheduled_tokens": plan.scheduled_tokens,
        "graph_stages": [
            {"name": g.name, "layers": [g.first_layer, g.last_layer]} for g in table.stages
        ],
        "tail_rows": len(plan.tail_rows),
        "requests": reqs,
    }


def render_text(d: dict) -> str:
    """A compact human-readable view of ``describe``'s output."""
    lines = [
        (
            f"spec {d['spec']}: graph key {tuple(d['graph_key'])}, {d['scheduled_bs']} requests, "
            f"{d['scheduled_tokens']} rows; decoder replay {'on' if d['decoder_replay'] else 'off'}"
        ),
        "graph stages: "
        + ", ".join(f"{g['name']} {g['layers'][0]}..{g['layers'][1]}" for g in d["graph_stages"]),
    ]
    for i, r in enumerate(d["requests"]):
        tail = f"[{r['tail'][0]}, {r['tail'][1]}]" if r["tail"] else "none"
        lines.append(
            f"request {i} ({r['phase']}): forward [{r['forward_start']}, {r['forward_end']}) "
            f"resume {r['resume']} hit {r['prefix_hit']}; tail {tail}; swa_replay_start "
            f"{r['swa_replay_start']}; write_from {r['write_from']}; cached_until "
            f"{r['cached_until']}; last row {r['last_row']}"
        )
        for e in r["stages"]:
            rows = f"[{e['rows'][0]}, {e['rows'][1]}]" if e["rows"] else "-"
            lay = e["layers"]
            layers = f"{lay[0]}" if lay[0] == lay[1] else f"{lay[0]}..{lay[1]}"
            lines.append(f"    layers {layers:>7}  {e['sub_step']:<10} rows {rows}")
    return "\n".join(lines)


def read_batch(path: str):
    """The parsed JSON of ``--batch`` (a file, or ``-`` for stdin); ``BatchError`` otherwise."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BatchError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot look up
        raise BatchError(f"cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise BatchError("JSON nested too deeply") from None


def run(args: argparse.Namespace) -> int:
    """Plan the batch and print it; a bad spec or batch is refused in one line (exit 2)."""
    from v41plan.planner.step import PlanError, plan_step

    spec = spec_arg(args.spec)
    try:
        doc = read_batch(args.batch)
        enc = (
            spec.replay.encoder_swa_bounded_replay
            if args.encoder_replay is None
            else args.encoder_replay
        )
        step = parse_batch(doc, spec, enc)
        plan = plan_step(step, spec, decoder_replay=args.decoder_replay, encoder_replay=enc)
    except (BatchError, PlanError) as exc:
        raise Refused(f"--batch {args.batch}: {exc}") from None
    d = describe(plan, spec.dims.sliding_window)
    print(json.dumps(d, indent=2) if args.json else render_text(d))
    return 0
