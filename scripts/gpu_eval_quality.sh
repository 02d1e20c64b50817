#!/usr/bin/env bash
# Score a trained checkpoint on a CUDA machine in one call (run from the repository root): the
# recall multiple choice at the task's list lengths (scripts/recall_mc_probe.py), the copies by
# distance (scripts/copy_distance_profile.py) and the quality table's default and random-weight
# rows (v41plan.validation.quality_table), each under its own time limit so that one slow part
# leaves the others' reports. Writes recall_mc.json, copy_profile.json, quality_table.json and
# eval.log to OUT.
#   CKPT=/tmp/S5b/quality40w SPEC=quality40w OUT=$OUT scripts/gpu_eval_quality.sh
# Optional: DOCS (documents a recall list length and a copy filler, default 20), LIMIT (the
# table's documents a task, default 20), ROWS (the table's rows, default "default,random
# weights"; "all" for every row), EACH_S (seconds each part may take, default 150), DEVICE
# (default cuda; cpu runs the same parts here, slowly).
set -uo pipefail
CKPT=${CKPT:?CKPT: the checkpoint folder}
SPEC=${SPEC:-quality40w}
OUT=${OUT:-/tmp/v41plan_eval}
DOCS=${DOCS:-20}
LIMIT=${LIMIT:-20}
ROWS=${ROWS:-default,random weights}
EACH_S=${EACH_S:-150}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log="$OUT/eval.log"
echo "provenance: $(python3 -m v41plan.validation.provenance)" | tee "$log"
echo "checkpoint: $CKPT  spec: $SPEC" | tee -a "$log"
rows=(--rows "$ROWS")
[ "$ROWS" = all ] && rows=()
run() {  # name, then the command: its output to the log, its status said, never fatal
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$log"
    timeout "$EACH_S" "$@" 2>&1 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}
run recall_mc python3 scripts/recall_mc_probe.py --checkpoint "$CKPT" --spec "$SPEC" \
    --pairs 16,48 --docs "$DOCS" --device "$DEVICE" --out "$OUT/recall_mc.json"
run copy_profile python3 scripts/copy_distance_profile.py --checkpoint "$CKPT" --spec "$SPEC" \
    --fillers 16,64,120,200,420 --docs "$DOCS" --device "$DEVICE" --out "$OUT/copy_profile.json"
run quality_table python3 -m v41plan.validation.quality_table --checkpoint "$CKPT" \
    --spec "$SPEC" --limit "$LIMIT" --device "$DEVICE" "${rows[@]}" --out "$OUT/quality_table.json"
exit 0
