#!/usr/bin/env bash
# The flash_slice measurements on one H200 (run from the repository root): a random checkpoint
# in the published formats (init-checkpoint, kept in ckpt/ between device calls: ignored by git,
# 35 GB), then the decode step by FULL-graph replay on the CUDA default path (resident weights,
# Triton kernels, compiled dense pieces), an 8K prefill with decoder replay on and off, and the
# W8A8 linear / grouped W4A8 MoE benchmark; optional steps: "kernels" (the GPU tests of the
# quantized GEMMs, the grouped MoE and the mHC sites), "sweep" (the grouped MoE's tile and mode
# sweep and the W8A8 prefill tiles alone, $OUT/bench_gemm_moe_sweep.json), "sites" (the mHC
# site forms at flash widths, $OUT/bench_dense_flash_sites.json), "checks" (the GPU tests of the
# LM head, the router, the split site and the sparse attention), "attn1" (the batch-1 flash
# decode attention's head blocks and key splits, $OUT/bench_kernels_attn_t1.json), "split1" (a
# split-K linear ending in one launch against two, $OUT/probe_split_launch.json), "woa" (the
# grouped wo_a on its FP8 weight against the bf16 bmm, $OUT/probe_wo_a.json) and "attn" (the
# flash decode attention's sweep forms at 64 rows and one row,
# $OUT/bench_kernels_attn_sweep.json) and "ncu" (Nsight Compute's counters of the routed
# experts' and two W8A8 decode launches, benchmarks/probe_decode_kernels.py,
# $OUT/ncu_decode_kernels.csv; Firecracker machines only), "ncuattn" (the same counters of the
# flash decode attention at 64 rows, $OUT/ncu_attention.csv, and its stall reasons,
# $OUT/ncu_attention_stalls.csv) and "streams" (the GPU test of the
# shared expert on a side stream) and "mm" (the W8A8 prefill rows' mm mode: GPU tests and the
# --quick rows, $OUT/bench_gemm_moe_mm.json). On an H100 too (35 GB resident).
# STEPS picks a subset:
#   OUT=/tmp/f STEPS="ckpt decode" scripts/gpu_flash_slice.sh    # one device call
#   OUT=/tmp/f STEPS="prefill gemm" scripts/gpu_flash_slice.sh   # the next
#   DECODE_VARIANTS=compiled,compiled_split_two_launches STEPS=decode ...  # a flag's A/B, one process
#   DECODE_BATCHES=1 ...   # the decode batch sizes (default 1,64)
#   STEPS="streams ckpt decode" DECODE_VARIANTS=compiled,compiled_one_stream ...
#   STEPS="ckpt decode" DECODE_VARIANTS=compiled,compiled_unfolded_scales,compiled_decode_fp8_rows ...
#   STEPS="mm ckpt prefill" PREFILL_FLAG=kernels.triton_gemm.MM_ROWS=None ...  # the mm mode:
#       its GPU tests and bench rows ($OUT/bench_gemm_moe_mm.json), the 8K prefill's A/B
#   STEPS="ckpt decode" DECODE_BATCHES=64
#   DECODE_VARIANTS=compiled,compiled_unresolved,compiled_fixed_splits,compiled_unresolved_fixed,compiled
#       # A/B/../A (a later variant of a process has run faster whichever it was; rows:
#       # run_index): here the attention without its selected ids resolved to plane offsets
#       # first (triton_backend.RESOLVE_SELECTED) and without its splits balanced over each
#       # row's own blocks (triton_backend.BALANCED_SPLITS), alone and together
# Reports: $OUT/bench_decode_flash_slice.json, bench_prefill_flash_slice.json,
# bench_gemm_moe_flash_slice.json (each with resident_bytes and checkpoint_bytes).
set -u -o pipefail
OUT=${OUT:-reports/gpu}
STEPS=${STEPS:-"ckpt decode prefill gemm"}
CKPT=${CKPT:-ckpt/flash_slice}
WORKERS=${WORKERS:-12}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
has() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
run() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S)): $*"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
echo "provenance: $(python3 -m v41plan.validation.provenance)"
if has kernels; then
    run kernels-resident 200 python3 -m pytest -q -x tests/gpu/test_resident_gpu.py -k "grouped or w8a8"
    run kernels-moe 150 python3 -m pytest -q tests/runtime/test_grouped_moe.py tests/runtime/test_triton_gemm.py
    run kernels-sites 150 python3 -m pytest -q tests/gpu/test_triton_dense_gpu.py -k "split or site"
fi
if has checks; then  # the GPU tests of the LM head, the router, the split site, the attention
    run checks 150 python3 -m pytest -q tests/gpu/test_resident_gpu.py \
        tests/gpu/test_triton_dense_gpu.py -k "head or router or split"
    run checks-attention 120 python3 -m pytest -q tests/runtime/test_triton_kernels.py \
        -k "attention or window"
fi
if has mm; then  # the W8A8 prefill rows' mm mode (MM_ROWS): its GPU tests, then its bench rows
    run mm-tests 90 python3 -m pytest -q tests/runtime/test_triton_gemm.py \
        -k "mm_mode or act_values or swiglu_is_the_shared or prefill_rows_take"
    run mm 150 python3 benchmarks/bench_gemm_moe.py --spec flash_slice --quick --budget-s 110 \
        --out "$OUT/bench_gemm_moe_mm.json"
    python3 scripts/print_rows.py "$OUT/bench_gemm_moe_mm.json"
fi
if has streams; then  # the shared expert on a side stream: the same bits, eager and replayed
    run streams 120 python3 -m pytest -q tests/gpu/test_shared_stream_gpu.py
fi
if has sweep; then
    run sweep 360 python3 benchmarks/bench_gemm_moe.py --spec flash_slice --sweep --no-main \
        --sweep-parts "${SWEEP_PARTS:-moe,w8a8,w8a8_decode}" --budget-s "${SWEEP_S:-300}" \
        --out "$OUT/bench_gemm_moe_sweep.json"
    python3 scripts/print_rows.py "$OUT/bench_gemm_moe_sweep.json"
fi
if has sites; then
    run sites 120 python3 benchmarks/bench_dense_kernels.py --spec flash_slice --tokens 1,16,32,64 \
        --ops site,site_fp8,expand_site --no-compile --budget-s 90 \
        --site-configs "split,1,128,4;products,1,128,4" --out "$OUT/bench_dense_flash_sites.json"
fi
if has ckpt; then
    if [ -f "$CKPT/model.safetensors.index.json" ]; then
        echo "== ckpt: $CKPT is there"
    else
        df -h . | tail -n 1
        run ckpt 420 python3 -m v41plan init-checkpoint --spec flash_slice --out "$CKPT" \
            --workers "$WORKERS"
        du -sh "$CKPT"
    fi
fi
if has decode; then
    # two variants (a flag's A/B) take about 2 x 200 s
    run decode 560 python3 benchmarks/bench_decode_paths.py --spec flash_slice \
        --checkpoint "$CKPT" --variants "${DECODE_VARIANTS:-compiled}" --batch-sizes "${DECODE_BATCHES:-1,64}" \
        --kernel-table 12 --out "$OUT/bench_decode_flash_slice.json"
fi
if has attn1; then  # batch-1 flash decode attention: head blocks and key splits
    run attn1 90 python3 benchmarks/bench_kernels.py --only "sweep flash T=1" \
        --out "$OUT/bench_kernels_attn_t1.json"
fi
if has woa; then  # the grouped wo_a on its FP8 weight: GPU tests, then against the bf16 bmm
    run woa-tests 150 python3 -m pytest -q tests/runtime/test_triton_gemm.py -k "w8a16 or split"
    run woa 150 python3 benchmarks/probe_wo_a.py --out "$OUT/probe_wo_a.json"
fi
if has attn; then  # the flash decode attention's forms at 64 rows and at one row (8K context)
    run attn 240 python3 benchmarks/bench_kernels.py --only "attention decode sweep flash" \
        --out "$OUT/bench_kernels_attn_sweep.json"
fi
if has split1; then  # the split-K linear's end in one launch against two (bits compared)
    run split1 90 python3 benchmarks/probe_split_launch.py --out "$OUT/probe_split_launch.json"
fi
if has ncu; then  # hardware counters of the decode's largest kernels (Nsight Compute, one each)
    # probe_decode_kernels.py launches 8 matching kernels to warm up, then 8 once each
    run ncu 300 ncu --clock-control none --kernel-name "regex:_gate_up_kernel|_down_kernel|_w8a8_kernel" \
        --launch-skip 8 --launch-count 8 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --csv --page details --log-file "$OUT/ncu_decode_kernels.csv" \
        python3 benchmarks/probe_decode_kernels.py --reps 1
fi
if has ncuattn; then  # the flash decode attention's stall reasons (64 rows, 8K context)
    run ncuattn 300 ncu --clock-control none --kernel-name sparse_attention_kernel \
        --launch-skip 4 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --csv --page details --log-file "$OUT/ncu_attention.csv" \
        python3 benchmarks/bench_kernels.py --only "attention decode flash bf16" \
        --out "$OUT/bench_kernels_ncu_attention.json"
    # the warp-state section's raw metrics: the per-reason stall counts the details page omits
    run ncuattn-stalls 300 ncu --clock-control none --kernel-name sparse_attention_kernel \
        --launch-skip 4 --launch-count 1 --section WarpStateStats --page raw --csv \
        --log-file "$OUT/ncu_attention_stalls.csv" \
        python3 benchmarks/bench_kernels.py --only "attention decode flash bf16" \
        --out "$OUT/bench_kernels_ncu_attention.json"
fi
if has prefill; then
    run prefill 360 python3 benchmarks/bench_prefill.py --spec flash_slice --checkpoint "$CKPT" \
        --variant resident --tokens 8192 --kernel-table 25 ${PREFILL_FLAG:+--flag "$PREFILL_FLAG"} \
        --out "$OUT/bench_prefill_flash_slice.json"
fi
if has gemm; then
    run gemm 240 python3 benchmarks/bench_gemm_moe.py --spec flash_slice \
        --out "$OUT/bench_gemm_moe_flash_slice.json"
fi
exit $status
