#!/usr/bin/env bash
# GPU validation in one command (run from the repository root on a CUDA machine):
#   GPU tests, validate_runtime --graph for tiny40 and medium, the decode and prefill benchmarks.
# Reports land in $OUT (default reports/gpu); the log and every JSON report record the tree's
# provenance (v41plan/validation/provenance.py). STEPS picks a subset, in this order:
#   STEPS="profile tests tiny40 ckpt decode prefill medium fasttests crosscheck compiled paths startup tiles site kernels dense gemm sampler serve scorer dspark dsparkbench" \
#     TRANSFER=both scripts/gpu_validate.sh
# Step limits are overridable as LIMIT_<step> (seconds). The whole list runs past one 10-minute
# device call (measured on an H200: tests about 190 s, kernels 70 s, tiny40 both transfers about 230 s, ckpt 20 s,
# decode 60 s at b693dc4 (over 150 s at 218721c: its eager rows are launch-bound), prefill 150 s, medium (float64) about 240 s per transfer); split it, e.g.
# STEPS="tests tiny40", then STEPS="ckpt decode prefill", then STEPS="ckpt medium".
set -u -o pipefail
OUT=${OUT:-reports/gpu}
STEPS=${STEPS:-"tests tiny40 ckpt decode prefill medium"}
CKPT=${CKPT:-/tmp/v41plan_medium_ckpt}
TRANSFER=${TRANSFER:-both}  # validate_runtime --transfer (replay, copy or both)
CASES=${CASES:-}  # validate_runtime --cases (a comma-separated subset; default: every case)
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/gpu_validate.log"
status=0

run_step() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name ($(date -u +%H:%M:%S)): $*" | tee -a "$LOG"
    local t0=$SECONDS
    local override="LIMIT_$name"
    timeout "${!override:-$limit}" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee -a "$LOG"
# the tree that runs, hashed here (verify at the checkout: python -m v41plan.validation.provenance
# --check $OUT/gpu_validate.log); every JSON report records it too
echo "provenance: $(python3 -m v41plan.validation.provenance)" | tee -a "$LOG"

run_step profile 200 python3 scripts/gpu_profile_step.py --out "$OUT/gpu_profile_step.json"
# GPU_TESTS: the test files or node ids of the step (default: all of tests/gpu, which took over
# 300 s on 2026-12-02: split it, e.g. GPU_TESTS=tests/gpu/test_compiled_gpu.py, then the rest).
# No log capture: torch's DEBUG trace records buried the failures' tracebacks.
run_step tests 420 python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider -p no:logging \
    --tb=short -rfE --durations=15
# one report per transfer when TRANSFER names one (medium's two transfers need two device calls)
SUFFIX=$([ "$TRANSFER" = both ] && echo "" || echo "_$TRANSFER")${CASES:+_cases}
CASE_ARGS=(${CASES:+--cases "$CASES"})
# GRAPH_MODE: validate_runtime --cudagraph-mode of the tiny40 and medium steps (FULL or PIECEWISE)
GRAPH_MODE=${GRAPH_MODE:-FULL}
MODE_SUFFIX=$([ "$GRAPH_MODE" = FULL ] && echo "" || echo "_$(echo "$GRAPH_MODE" | tr A-Z a-z)")
run_step tiny40 300 python3 -m v41plan.validation.validate_runtime --spec specs/tiny40.yaml --graph --device cuda \
    --cudagraph-mode "$GRAPH_MODE" --transfer "$TRANSFER" "${CASE_ARGS[@]}" \
    --output "$OUT/validate_tiny40_graph$MODE_SUFFIX$SUFFIX.json"
run_step ckpt 240 python3 -m v41plan init-checkpoint --spec specs/medium.yaml --out "$CKPT"
# decode: over the ckpt step's checkpoint when there is one, else the seeded random weights
run_step decode 300 python3 benchmarks/bench_decode.py $([ -d "$CKPT" ] && echo --checkpoint "$CKPT") \
    --engine-steps "${ENGINE_STEPS:-20}" --out "$OUT/bench_decode.json"
run_step prefill 150 python3 benchmarks/bench_prefill.py --checkpoint "$CKPT" --out "$OUT/bench_prefill.json"
run_step medium 540 python3 -m v41plan.validation.validate_runtime --spec specs/medium.yaml --graph --device cuda \
    --cudagraph-mode "$GRAPH_MODE" --dtype float64 --transfer "$TRANSFER" "${CASE_ARGS[@]}" --checkpoint "$CKPT" \
    --output "$OUT/validate_medium_graph$MODE_SUFFIX$SUFFIX.json"
run_step fasttests 300 python3 -m pytest tests/gpu/test_fast_paths_gpu.py -q -s -p no:cacheprovider --durations=5
run_step crosscheck 120 python3 scripts/crosscheck_backend.py --out "$OUT/crosscheck_tiny40.json"
run_step compiled 300 python3 -m pytest tests/gpu/test_compiled_gpu.py \
    "tests/gpu/test_fast_paths_gpu.py::test_engine_auto_kernels_graph_tokens_equal_eager" \
    -q -s -p no:cacheprovider --durations=8
# VARIANTS: bench_decode_paths variants (all seven run past one device call; about 70-110 s each)
run_step paths 420 python3 benchmarks/bench_decode_paths.py --variants "${VARIANTS:-resident,dense_compiled,compiled}" \
    ${BATCH_SIZES:+--batch-sizes "$BATCH_SIZES"} --out "$OUT/bench_decode_paths.json"
run_step startup 420 python3 benchmarks/bench_startup.py --out "$OUT/bench_startup.json"
run_step tiles 480 python3 benchmarks/sweep_decode_tiles.py --budget-s 400 --out "$OUT/sweep_decode_tiles.json"
run_step site 90 python3 benchmarks/probe_site.py --out "$OUT/probe_site.json"
run_step kernels 200 python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json"
run_step dense 120 python3 benchmarks/bench_dense_kernels.py --out "$OUT/bench_dense_kernels.json"
run_step gemm 200 python3 benchmarks/bench_gemm_moe.py --spec flash_slice --out "$OUT/bench_gemm_moe.json"
run_step sampler 120 python3 benchmarks/bench_sampler.py --out "$OUT/bench_sampler.json"
# the OpenAI server under load; FastAPI, uvicorn and pydantic travel as wheels in .whl (carry it;
# benchmarks/bench_serve.py says how to fetch them)
run_step serve 240 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PYTHONPATH python3 benchmarks/bench_serve.py \
    --spec medium --checkpoint "$0" --device cuda --rate 4 --num-requests 100 --duration-s 30 \
    --out "$1/bench_serve.json"' "$CKPT" "$OUT"
run_step scorer 120 python3 benchmarks/bench_scorer.py --spec medium --device cuda --out "$OUT/bench_scorer.json"
# DSpark: validate_runtime --speculative under FULL graphs on tiny40_dspark (float64: greedy ties
# away), its tokens against the eager runner's and the plain engine's; then the step costs on medium
run_step dspark 300 python3 -m v41plan.validation.validate_runtime --spec specs/tiny40_dspark.yaml --graph \
    --device cuda --speculative --transfer "$TRANSFER" "${CASE_ARGS[@]}" \
    --output "$OUT/validate_tiny40_dspark_graph$SUFFIX.json"
run_step dsparkbench 300 python3 benchmarks/bench_dspark.py ${BATCH_SIZES:+--batch-sizes "$BATCH_SIZES"} \
    --steps 8 --context 256 --out "$OUT/bench_dspark.json"
exit $status
