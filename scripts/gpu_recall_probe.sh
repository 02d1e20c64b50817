#!/usr/bin/env bash
# Recall recipes for the 4-layer probe (scripts/copy_learning_probe.py), eight at once on one
# CUDA device, each for TIME_LIMIT seconds; writes $OUT/probe_<name>.json and prints, per
# recipe, the share of recall answer tokens right (argmax in the step's own batch) over time.
#   OUT=/tmp/p TIME_LIMIT=500 scripts/gpu_recall_probe.sh
set -euo pipefail
OUT=${OUT:-/tmp/v41plan_recall_probe}
TIME_LIMIT=${TIME_LIMIT:-500}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
common=(--device cuda --steps 100000 --dense-steps 100000 --batch-seqs 16 --seq-tokens 512
    --recall-share 1 --recall-keys task --min-pairs 6 --max-pairs 16 --threads 1
    --time-limit "$TIME_LIMIT")
declare -A recipes=(
    [q1]="--recall-questions 1"
    [q8]="--recall-questions 8"
    [r8]="--recall-questions 8 --recall-form repeat"
    [q8_pairs48]="--recall-questions 8 --min-pairs 40 --max-pairs 48 --seq-tokens 640"
    [q8_lr1e-3]="--recall-questions 8 --lr 1e-3"
    [q8_6layers]="--recall-questions 8 --layers 6"
    [q8_topk]="--recall-questions 8 --dense-steps 500"  # 1500 (the committed report) never switched
    [q8_copies]="--recall-questions 8 --recall-share 0.5 --max-filler 120"
)
for name in "${!recipes[@]}"; do
    # shellcheck disable=SC2086
    python3 scripts/copy_learning_probe.py "${common[@]}" ${recipes[$name]} \
        --out "$OUT/probe_$name.json" > "/tmp/probe_$name.log" 2>&1 &
done
wait || true
for name in "${!recipes[@]}"; do tail -n 2 "/tmp/probe_$name.log"; done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print("| recipe | steps | s/step | recall right at 10/25/50/75/100% of the run | copies past |")
print("|---|---:|---:|---|---:|")
for f in sorted(pathlib.Path(sys.argv[1]).glob("probe_*.json")):
    rows = json.load(open(f))["rows"]
    n = len(rows)
    at = [rows[min(n - 1, int(n * p))]["recall"] for p in (0.1, 0.25, 0.5, 0.75, 1.0)]
    last = rows[-1]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    print(f"| {f.stem[6:]} | {last['step'] + 1} | {last['s'] / (last['step'] + 1):.3f} | "
          f"{' / '.join(fmt(v) for v in at)} | {fmt(last['past'])} |")
PY
