#!/usr/bin/env bash
# Recall in its multi-query form from fresh weights on cut layer schedules and on quality40's
# own (scripts/recall_depth_probe.py), all at once on one CUDA device for TIME_LIMIT seconds;
# copies each train_log.json to $OUT/depth_<name>.json and prints recall over time.
# EXTRA (e.g. "--fill-long") goes to every run; SET=fill runs the second set: no sums after
# the lists at 4 layers (with and without copies) and 14, and the 4-layer probe's eager step on
# v41plan train's batches (corpus or step?). The 40 layers need the device alone (about 0.55 s
# a step): scripts/recall_depth_probe.py --ratios quality40 --fill-long (reports/gpu/
# recall_depth_fill.json: from fresh weights they learn recall, the committed checkpoint does
# not).
#   OUT=/tmp/d TIME_LIMIT=420 scripts/gpu_recall_depth.sh
#   OUT=/tmp/d TIME_LIMIT=420 SET=fill scripts/gpu_recall_depth.sh
set -euo pipefail
OUT=${OUT:-/tmp/v41plan_recall_depth}
TIME_LIMIT=${TIME_LIMIT:-420}
SET=${SET:-depth}
EXTRA=${EXTRA:-}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ "$SET" = fill ]; then
    declare -A schedules=(
        [r1x2_fill]="--ratios 0,0,1,1 --fill-long"
        [r1x2_fill_copies]="--ratios 0,0,1,1 --fill-long --copy-share 0.3"
        [r2x6_r1x6_fill]="--ratios 0,0,2,2,2,2,2,2,1,1,1,1,1,1 --fill-long"
    )
else
    declare -A schedules=(
        [r1x2]="--ratios 0,0,1,1"
        [r2x2_r1x2]="--ratios 0,0,2,2,1,1"
        [r2x6_r1x6]="--ratios 0,0,2,2,2,2,2,2,1,1,1,1,1,1"
        [quality40]="--ratios quality40"
    )
fi
for name in "${!schedules[@]}"; do
    # shellcheck disable=SC2086
    python3 scripts/recall_depth_probe.py ${schedules[$name]} $EXTRA --out "/tmp/depth_$name" \
        --time-limit "$TIME_LIMIT" > "$OUT/depth_$name.log" 2>&1 &
done
if [ "$SET" = fill ]; then
    # the probe's eager step on v41plan train's batches (sums after each list), 4 layers
    python3 scripts/copy_learning_probe.py --corpus train --device cuda --steps 100000 \
        --dense-steps 100000 --batch-seqs 16 --seq-tokens 640 --recall-share 1 --max-pairs 16 \
        --recall-questions 8 --threads 1 --time-limit "$TIME_LIMIT" \
        --out "$OUT/probe_q8_train_corpus.json" > /tmp/probe_train_corpus.log 2>&1 &
fi
wait || true
[ "$SET" = fill ] && awk 'NR <= 2 || NR % 4 == 0' /tmp/probe_train_corpus.log | tail -n 14
for name in "${!schedules[@]}"; do
    cp "/tmp/depth_$name/train_log.json" "$OUT/depth_$name.json" || tail -n 5 "$OUT/depth_$name.log"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print("| schedule | steps | s/step | recall_more right, steps 1-50 / 200 / 400 / 600 / last 50 | recall |")
print("|---|---:|---:|---|---:|")
for f in sorted(pathlib.Path(sys.argv[1]).glob("depth_*.json")):
    d = json.load(open(f))
    k = d["answer_kinds"].index("recall_more")
    h, t = d["answer_hits"], d["answer_tokens"]
    def acc(a, b, j=k):
        a, b = max(0, a), min(len(h), b)
        n = sum(t[i][j] for i in range(a, b))
        return "-" if a >= b or not n else f"{sum(h[i][j] for i in range(a, b)) / n:.2f}"
    n = len(h)
    at = [acc(0, 50), acc(150, 200), acc(350, 400), acc(550, 600), acc(n - 50, n)]
    r = d["answer_kinds"].index("recall")
    print(f"| {f.stem[6:]} | {n} | {d['s_per_step']:.3f} | {' / '.join(at)} | {acc(n - 50, n, r)} |")
PY
