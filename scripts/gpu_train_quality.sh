#!/usr/bin/env bash
# Train the quality checkpoint on a CUDA machine in one call (run from the repository root),
# then score the quality table there (EVAL_S > 0). Without STEPS a short calibration run times
# a dense and a sparse step first, and the real run takes as many steps as fit BUDGET_S seconds
# (a quarter of them dense). The real run's command is printed and recorded in its
# train_log.json: rerunning it reproduces the schedule.
#   OUT=/tmp/q STEPS=560 EVAL_S=170 scripts/gpu_train_quality.sh
# Optional: SPEC (a compiled spec's name, default quality40: the GPU image has no compiler, so a
# spec file must be compiled into v41plan/generated first), NAME (the checkpoint folder under OUT,
# default the spec's name), DENSE (dense-attention steps; default a quarter of STEPS), INIT (a
# checkpoint to go on from), LR, SEED, TIME_LIMIT (seconds of training, then write what it has),
# COPY_SHARE, SHORT_COPY_SHARE, MAX_FILLER, MAX_PAIRS, RECALL_Q, MIN_CODE, MAX_CODE, FILL_LONG
# (set: long documents to each sequence's end instead of sums) (the corpus mixture, `v41plan
# train --help`).
set -euo pipefail
OUT=${OUT:-/tmp/v41plan_quality}
SPEC=${SPEC:-quality40}
NAME=${NAME:-$(basename "$SPEC" .yaml)}  # SPEC may be a file where the compiler is installed
BUDGET_S=${BUDGET_S:-420}
BATCH=${BATCH:-16}
SEQ=${SEQ:-640}
STEPS=${STEPS:-}
EVAL_S=${EVAL_S:-0}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
echo "provenance: $(python3 -m v41plan.validation.provenance)" | tee "$OUT/train.log"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/train.log"
if [ -z "$STEPS" ]; then
    t0=$SECONDS
    python3 -m v41plan train --spec "$SPEC" --out "$OUT/calibration" --steps 24 --dense-steps 12 \
        --batch-seqs "$BATCH" --seq-tokens "$SEQ" 2>&1 | tee -a "$OUT/train.log"
    left=$((BUDGET_S - (SECONDS - t0)))
    STEPS=$(python3 - "$OUT/calibration/train_log.json" "$left" <<'PY'
import json, statistics, sys
log = json.load(open(sys.argv[1]))
t = log["step_end_s"]
d = [b - a for a, b in zip(t, t[1:])]
dense = statistics.median(d[1:11])  # step 0 and step 12 include a capture
sparse = statistics.median(d[13:])
per = 0.25 * dense + 0.75 * sparse
left = float(sys.argv[2]) - 2 * log["setup_s"] - 2 * log["capture_s"] - 20
print(f"calibration: dense {dense:.3f} s/step, sparse {sparse:.3f} s/step", file=sys.stderr)
print(max(50, int(left / per) // 10 * 10))
PY
)
    # a device call brings back at most 8 files: keep the calibration's log, drop its checkpoint
    mv "$OUT/calibration/train_log.json" "$OUT/calibration_log.json" && rm -rf "$OUT/calibration"
fi
dense=${DENSE:-$((STEPS / 4))}
extra=()
[ -n "${INIT:-}" ] && extra+=(--init-checkpoint "$INIT")
[ -n "${LR:-}" ] && extra+=(--lr "$LR")
[ -n "${SEED:-}" ] && extra+=(--seed "$SEED")
[ -n "${TIME_LIMIT:-}" ] && extra+=(--time-limit "$TIME_LIMIT")
[ -n "${COPY_SHARE:-}" ] && extra+=(--copy-share "$COPY_SHARE")
[ -n "${SHORT_COPY_SHARE:-}" ] && extra+=(--short-copy-share "$SHORT_COPY_SHARE")
[ -n "${MAX_FILLER:-}" ] && extra+=(--max-filler-chars "$MAX_FILLER")
[ -n "${MAX_PAIRS:-}" ] && extra+=(--max-recall-pairs "$MAX_PAIRS")
[ -n "${RECALL_Q:-}" ] && extra+=(--recall-questions "$RECALL_Q")
[ -n "${MIN_CODE:-}" ] && extra+=(--min-code-letters "$MIN_CODE")
[ -n "${MAX_CODE:-}" ] && extra+=(--max-code-letters "$MAX_CODE")
[ -n "${FILL_LONG:-}" ] && extra+=(--fill-long)
echo "== v41plan train --spec $SPEC --steps $STEPS --dense-steps $dense --batch-seqs $BATCH --seq-tokens $SEQ ${extra[*]}" | tee -a "$OUT/train.log"
python3 -m v41plan train --spec "$SPEC" --out "$OUT/$NAME" --steps "$STEPS" --dense-steps "$dense" \
    --batch-seqs "$BATCH" --seq-tokens "$SEQ" "${extra[@]}" 2>&1 | tee -a "$OUT/train.log"
if [ "$EVAL_S" -gt 0 ]; then
    echo "== quality table (cuda, up to $EVAL_S s)" | tee -a "$OUT/train.log"
    timeout "$EVAL_S" python3 -m v41plan.validation.quality_table --checkpoint "$OUT/$NAME" \
        --spec "$SPEC" --device cuda --out "$OUT/quality_table.json" 2>&1 | tee -a "$OUT/train.log" || true
fi
