"""The README's two performance tables, recomputed from the committed benchmark JSON.

    python scripts/readme_floor_tables.py                  # print both tables (markdown)
    python scripts/readme_floor_tables.py --write README.md
    python scripts/readme_floor_tables.py --check README.md   # exit 1 if the README differs

Measured times and ceilings come from ``reports/gpu/bench_decode.json`` and
``bench_prefill.json`` as committed; the floors are recomputed with the current formula
(``benchmarks/medium_model.step_floor``) over the plans those benchmarks ran (rebuilt here with
``plan_step``: a decode step of ``batch`` requests at ``context`` tokens, one fresh prefill of
``tokens``), so a change of the formula changes the tables without a GPU. Where a run measured
no FP8 matmul rate, its shipped-format floor counts the W8A8/W4A8 FLOPs at the bf16 rate (the
``fp8 rate`` line under each table says which). Runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DECODE_HEADER = (
    "| batch | eager ms | FULL graph step ms (host prep + replay) | replay ms (device) "
    "| eager / graph step | eager / replay | floor ms (shipped formats) | floor ms (bf16 weights) "
    "| replay: floor / measured | replay: bf16 floor / measured |"
)
PREFILL_HEADER = (
    "| decoder replay | ms | tokens/s | layer-rows run | TFLOP (counted) | of it W8A8/W4A8 "
    "| floor ms (shipped formats) | floor ms (bf16 weights) | floor / measured "
    "| bf16 floor / measured |"
)


def _floors(spec, cfg, plan, report: dict) -> dict:
    from medium_model import pool_row_bytes, step_floor

    kv = report.get("kv_cache_dtype", "bf16")
    ix = report.get("index_cache_dtype", "fp8")
    rows = pool_row_bytes(spec.geometry(kv, ix))
    return step_floor(cfg, plan, report["ceilings"], rows=rows, index_cache_dtype=ix)


def _rate_line(report: dict) -> str:
    fp8 = report["ceilings"].get("fp8_flop_per_s")
    if fp8:
        return f"fp8 rate: {fp8 / 1e12:.0f} TFLOP/s, measured in the run."
    return (
        "fp8 rate: not measured in this run; the shipped-format floor counts its W8A8/W4A8 "
        "FLOPs at the bf16 rate."
    )


def decode_table(report: dict) -> str:
    """The decode table of ``bench_decode.json``."""
    from medium_model import load_spec

    from v41plan.model.config import config_from_cache_spec
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    spec = load_spec()
    cfg = config_from_cache_spec(spec)
    P = spec.replay.hash_block_tokens
    lines = [DECODE_HEADER, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        bs, ctx = r["batch"], r["context"]
        need = -(-(ctx + 8) // P)
        step = StepInput(
            tuple(
                RequestInput(
                    slot=i,
                    block_table=tuple(range(i * need, (i + 1) * need)),
                    prompt_len=ctx,
                    start=ctx,
                    chunk_len=1,
                    phase="decode",
                )
                for i in range(bs)
            )
        )
        f = _floors(spec, cfg, plan_step(step, spec), report)
        fl, fl16 = f["floor_s"] * 1e3, f["floor_bf16_s"] * 1e3
        lines.append(
            f"| {bs} | {r['eager_ms']:.1f} | {r['graph_step_ms']:.1f} | {r['replay_ms']:.1f} "
            f"| {r['eager_ms'] / r['graph_step_ms']:.1f}x | {r['eager_ms'] / r['replay_ms']:.1f}x "
            f"| {fl:.3f} | {fl16:.3f} | {fl / r['replay_ms']:.2%} | {fl16 / r['replay_ms']:.2%} |"
        )
    return "\n".join(lines) + "\n\n" + _rate_line(report)


def prefill_table(report: dict) -> str:
    """The prefill table of ``bench_prefill.json``."""
    from medium_model import load_spec

    from v41plan.model.config import config_from_cache_spec
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    spec = load_spec()
    cfg = config_from_cache_spec(spec)
    P = spec.replay.hash_block_tokens
    lines = [PREFILL_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        n = r["tokens"]
        req = RequestInput(
            slot=0,
            block_table=tuple(range(-(-n // P) + 1)),
            prompt_len=n,
            start=0,
            chunk_len=n,
            phase="prefill",
            fresh_slot=True,
        )
        plan = plan_step(StepInput((req,)), spec, decoder_replay=r["decoder_replay"])
        f = _floors(spec, cfg, plan, report)
        fl, fl16 = f["floor_s"] * 1e3, f["floor_bf16_s"] * 1e3
        rows_run = sum(
            len(plan.layer_rows.get((info.index, "attention"), ())) for info in cfg.layers
        )
        if rows_run != r["rows_run"]:
            raise SystemExit(
                f"the rebuilt plan runs {rows_run} layer-rows, the run {r['rows_run']}"
            )
        lines.append(
            f"| {'on' if r['decoder_replay'] else 'off'} | {r['ms']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {r['rows_run']:,} | {f['flops'] / 1e12:.2f} | {f['fp8_flops'] / 1e12:.2f} "
            f"| {fl:.2f} | {fl16:.2f} | {fl / r['ms']:.2%} | {fl16 / r['ms']:.2%} |"
        )
    return "\n".join(lines) + "\n\n" + _rate_line(report)


def replace_table(text: str, header: str, table: str) -> str:
    """``text`` with the table whose header starts like ``header`` (its first two columns), and
    the ``fp8 rate:`` line after it when there is one, replaced by ``table``."""
    prefix = "|".join(header.split("|")[:3]) + "|"
    start = text.index(prefix)
    lines = text[start:].split("\n")
    n = 0
    while n < len(lines) and lines[n].startswith("|"):
        n += 1
    if n + 1 < len(lines) and lines[n] == "" and lines[n + 1].startswith("fp8 rate:"):
        n += 2
    return text[:start] + table + "\n" + "\n".join(lines[n:])


def main(argv: list[str] | None = None) -> int:
    """Print the tables, or write or check them in a README."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default=str(ROOT / "reports/gpu/bench_decode.json"))
    ap.add_argument("--prefill", default=str(ROOT / "reports/gpu/bench_prefill.json"))
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="README")
    g.add_argument("--check", metavar="README")
    args = ap.parse_args(argv)
    decode = decode_table(json.loads(Path(args.decode).read_text()))
    prefill = prefill_table(json.loads(Path(args.prefill).read_text()))
    if not (args.write or args.check):
        print(decode + "\n\n" + prefill)
        return 0
    path = Path(args.write or args.check)
    text = path.read_text()
    new = replace_table(replace_table(text, DECODE_HEADER, decode), PREFILL_HEADER, prefill)
    if args.write:
        path.write_text(new)
        return 0
    if new != text:
        print(f"{path}: the performance tables differ from the committed JSON's; run --write")
        return 1
    print(f"{path}: the performance tables match the committed JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
