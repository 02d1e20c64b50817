"""The decode step's largest kernels at flash_slice widths, launched eagerly for a profiler:
the routed experts' grouped W4A8 launches (``_gate_up_kernel``, ``_down_kernel``) at 1 and 64
tokens and the W8A8 linear (``_w8a8_kernel``) of ``wq_b`` and ``wo_b`` at 1 and 64 rows, each
``--reps`` times after a warm-up, in that order, one NVTX range a case.

    python3 benchmarks/probe_decode_kernels.py [--reps 3]
    OUT=/tmp/f STEPS=ncu scripts/gpu_flash_slice.sh     # under Nsight Compute

``scripts/gpu_flash_slice.sh``'s ``ncu`` step runs it under Nsight Compute (hardware counters:
memory throughput, occupancy, warp stall reasons) and keeps the CSV. Alone it prints each
case's mean time per call (CUDA events over the eager launches, launch gaps included: not a
benchmark figure)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def cases(cfg) -> list[tuple[str, object]]:
    """(name, callable) for every probed launch; inputs built once."""
    from bench_gemm_moe import _fp8_weight, _moe_layer

    from v41plan.runtime.kernels.triton_gemm import w8a8_linear
    from v41plan.runtime.kernels.triton_moe import grouped_moe_w4a8
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8
    from v41plan.runtime.resident import GroupedMoE

    D = cfg.hidden_size
    res, _ = _moe_layer(cfg)
    moe = GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot="bf16")
    out = []
    for n in (1, 64):
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        ids, wts = moe.route(x)
        xq, xs = act_quant_fp8(x)
        out.append(
            (
                f"moe routed decode{n}",
                lambda a=(xq, xs, ids, wts): grouped_moe_w4a8(
                    *a, moe.w1, moe.w3, moe.w2, 0, moe.limit, torch.bfloat16
                ),
            )
        )
    shapes = {
        "wq_b": (cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank),
        "wo_b": (D, cfg.o_groups * cfg.o_lora_rank),
    }
    for name, (N, K) in shapes.items():
        wc, ws = _fp8_weight(N, K)
        for m in (1, 64):
            xq, xs = act_quant_fp8(torch.randn(m, K, device="cuda", dtype=torch.bfloat16))
            out.append(
                (
                    f"w8a8 {name} M={m}",
                    lambda a=(xq, wc, ws, torch.bfloat16, xs): w8a8_linear(*a),
                )
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="flash_slice")
    ap.add_argument("--reps", type=int, default=3, help="launches of each case after a warm-up")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_kernels.py needs a CUDA device")
        return 1
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.config import config_from_cache_spec

    cfg = config_from_cache_spec(load_cache_spec(args.spec))
    todo = cases(cfg)
    for _, fn in todo:  # compile every kernel before any profiled launch
        fn()
    torch.cuda.synchronize()
    for name, fn in todo:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.nvtx.range_push(name)
        start.record()
        for _ in range(args.reps):
            fn()
        end.record()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"{name:22} {start.elapsed_time(end) / args.reps * 1e3:9.1f} us a call (eager)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
