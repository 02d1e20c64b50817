"""W8A8 linear and grouped W4A8 MoE at a spec's widths (default ``flash_slice``), on one GPU.

    python3 benchmarks/bench_gemm_moe.py [--spec flash_slice] [--quick] [--out report.json]

Ceilings measured first, in this process: copy bandwidth (2 GiB, read + write counted), the
bf16 matmul rate and the FP8 GEMM rate (``torch._scaled_mm`` with row-wise scales), all at
8192^3. Then, each row timed by CUDA-graph replay (eager where a capture fails; the row says
which), median of several repetitions:

- ``w8a8 <name> M=8192``: the linear at prefill shapes in each mode (``fp8``: FP8 tensor cores,
  activation quantizer fused; ``fp8.prequant``: codes from ``act_quant_fp8``; ``bf16``: exact
  dequantized bf16 operands; ``mm``: the prefill mode behind ``MM_ROWS``, the exact values
  through ``torch.mm``, the quantizer's and the weight's dequantization launches included),
  floor ``2MNK / FP8 rate``; peer ``_scaled_mm`` row-wise, same shape (per-row scales: coarser
  than the published 32-lane ones). Goal ``of_floor >= 0.5``. ``w8a8 wq_b M=1024|2048``: the
  ``mm`` mode against ``fp8.prequant`` where ``MM_ROWS`` starts. ``w8a8_swiglu shared
  M=8192``: the shared expert's gate/up, SwiGLU and FP8 codes, the kernel (``fp8``) against
  the ``mm`` mode, floor ``4MNK / FP8 rate``.
- ``w8a8 <name> M=1|64``: decode shapes, floor the weight bytes / copy bandwidth.
- ``moe decode64`` / ``moe prefill8k``: one MoE layer (routing, shared expert, routed experts)
  with ``GroupedMoE`` W4A8 (the runtime's dot mode, bf16 on CUDA, then fp8; ``--quick``: the
  runtime's alone); floor ``max(bytes / copy BW, FLOPs
  / FP8 rate)``, the bytes of the distinct experts the batch selects (FP4 codes + E8M0 scales)
  plus the shared expert and gate; peers timed in the same run: ``GroupedMoE`` torch
  (``torch._grouped_mm`` bf16 over the selected experts) and the dense-over-experts
  ``layers.MoE`` (bf16). Goal ``of_floor >= 0.5``.

Prints a table; writes JSON (``device``, ``torch``, ``triton``, ``commit``, ``spec``,
``ceilings``, ``resident_bytes``/``checkpoint_bytes`` of the layer, ``rows`` with ``ms``,
``floor_ms``, ``of_floor``, ``peer``, ``peer_ms``) to ``--out`` or ``$OUT/bench_gemm_moe.json``.
A failing row is reported and the run goes on. Bounded: about 2 minutes on an H200 (``--quick``
about 1), most of it Triton compiles. ``--sweep`` adds ``sweep ...`` rows (``sweep_rows``):
tiles and splits of both kernels against the shipped defaults (marked ``{}``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import bf16_matmul_flop_per_s, copy_bandwidth_bytes_per_s
from report_io import write_report

TARGET_MS = 60.0
"""Rough device time per measurement repetition."""


def _commit() -> str:
    """The commit of the tree measured: ``provenance``'s (``V41PLAN_COMMIT`` where the caller
    names it: a device machine's copy can carry a stale ``.git``), else ``unknown``."""
    from v41plan.validation.provenance import provenance

    return provenance().get("commit") or "unknown"


def time_ms(fn, graph: bool = True, reps: int = 5) -> tuple[float, str]:
    """Median ms per call of ``fn`` (CUDA-graph replays when it captures) and how it ran."""
    fn()
    torch.cuda.synchronize()
    run, how = fn, "eager"
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, how = g.replay, "graph"
        except Exception as exc:  # noqa: BLE001 (the row records why it ran eager)
            how = f"eager (capture failed: {type(exc).__name__})"
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    n = max(1, min(2000, int(TARGET_MS / one)))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times), how


def fp8_rowwise_flop_per_s(n: int = 8192) -> float:
    """``torch._scaled_mm`` FP8 E4M3 GEMM rate with row-wise float32 scales, bf16 output."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    ms, _ = time_ms(
        lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
        graph=False,
    )
    return 2 * n**3 / (ms * 1e-3)


def _rowwise_peer(M: int, N: int, K: int):
    """A ``_scaled_mm`` row-wise call of the same shape (M padded to 16)."""
    m = max(16, -(-M // 16) * 16)
    a = torch.randn(m, K, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, N, device="cuda")
    return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _fp8_weight(N: int, K: int):
    from v41plan.model.quant import quantize_fp8_weight

    return quantize_fp8_weight(torch.randn(N, K, device="cuda") * K**-0.5)


def _gemm_call(fn, args: tuple, dot: str, config):
    """``fn(*args, dot=dot, config=config)`` as a closure over its own arguments."""
    return lambda: fn(*args, dot=dot, config=config)


def _timed_row(rows: list, label: str, deadline: float, fn, **fields) -> None:
    """``fn`` timed into a row of ``rows`` (``fields`` with ``floor_ms``, then ``ms``,
    ``of_floor``), or a row with its error (printed) or the time budget's skip."""
    if time.monotonic() > deadline:
        rows.append({"name": label, "error": "skipped: time budget"})
        return
    try:
        ms, how = time_ms(fn)
    except Exception as exc:  # noqa: BLE001 (report the row, keep going)
        rows.append({"name": label, "error": f"{type(exc).__name__}: {exc}"[:400]})
        traceback.print_exc()
        return
    rows.append({"name": label, **fields, "ms": ms, "of_floor": fields["floor_ms"] / ms,
                 "peer": None, "peer_ms": None, "timing": how})  # fmt: skip


def w8a8_rows(cfg, ceil, quick: bool, rows: list, deadline: float) -> None:
    """The W8A8 linear at prefill and decode shapes."""
    from v41plan.runtime.kernels.triton_gemm import GemmConfig, w8a8_linear
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shapes = {
        "wq_a": (cfg.q_lora_rank, D),
        "wq_b": (H * d, cfg.q_lora_rank),
        "wkv": (d, D),
        "wo_b": (D, cfg.o_groups * cfg.o_lora_rank),
        "shared.w1": (cfg.moe_intermediate_size, D),
        "shared.w2": (D, cfg.moe_intermediate_size),
    }
    if quick:
        shapes = {k: shapes[k] for k in ("wq_b", "wo_b", "shared.w1")}
    M = 8192
    # None first: the runtime's own choice (on sm_90 the TMA prefill tile for pre-quantized
    # rows), then pointer tiles
    sweep = {
        "fp8": [None, GemmConfig(128, 128, 32, 8, 4), GemmConfig(128, 256, 32, 8, 3)],
        "bf16": [None, GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3)],
    }
    best: dict[str, GemmConfig] = {}
    for i, (name, (N, K)) in enumerate(shapes.items()):
        wc, ws = _fp8_weight(N, K)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq, xs = act_quant_fp8(x)
        flops = 2 * M * N * K
        floor_ms = flops / ceil["fp8_flop_per_s"] * 1e3
        try:
            peer_ms = time_ms(_rowwise_peer(M, N, K))[0]
        except Exception as exc:  # noqa: BLE001
            peer_ms = None
            print(f"peer _scaled_mm {M}x{N}x{K}: {type(exc).__name__}: {exc}")
        variants = [("fp8", True), ("fp8", False), ("bf16", False), ("mm", True)]
        for dot, fused in variants:
            label = f"w8a8 {name} M={M} {dot}{'' if fused else '.prequant'}"
            if time.monotonic() > deadline:
                rows.append({"name": label, "error": "skipped: time budget"})
                continue
            try:
                cands = sweep.get(dot, [None]) if (i == 0 and not quick) else [best.get(dot)]
                res = []
                for c in cands:
                    args = (
                        (x, wc, ws, torch.bfloat16) if fused else (xq, wc, ws, torch.bfloat16, xs)
                    )
                    ms, how = time_ms(_gemm_call(w8a8_linear, args, dot, c))
                    res.append((ms, how, c))
                ms, how, c = min(res, key=lambda r: r[0])
                best.setdefault(dot, c)
                rows.append(
                    {
                        "name": label,
                        "shape": [M, N, K],
                        "ms": ms,
                        "tflops": flops / ms / 1e9,
                        "floor_ms": floor_ms,
                        "of_floor": floor_ms / ms,
                        "peer": "torch._scaled_mm rowwise",
                        "peer_ms": peer_ms,
                        "timing": how,
                        "config": "default" if c is None else c.__dict__,
                    }
                )
            except Exception as exc:  # noqa: BLE001 (report the row, keep going)
                rows.append({"name": label, "error": f"{type(exc).__name__}: {exc}"[:400]})
                traceback.print_exc()
    # the shared expert's gate/up + SwiGLU + FP8 codes at prefill rows, its two modes
    from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

    N, K = shapes["shared.w1"]
    w1, w3 = _fp8_weight(N, K), _fp8_weight(N, K)
    xq, xs = act_quant_fp8(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    floor_ms = 4 * M * N * K / ceil["fp8_flop_per_s"] * 1e3
    for dot in ("fp8", "mm"):
        fn = lambda dot=dot: w8a8_swiglu(xq, xs, w1, w3, 10.0, torch.bfloat16, dot=dot)
        _timed_row(rows, f"w8a8_swiglu shared M={M} {dot}", deadline, fn, shape=[M, 2 * N, K],
                   floor_ms=floor_ms)  # fmt: skip
    for name in ("wq_b", "wo_b"):  # where MM_ROWS starts
        N, K = shapes[name]
        wc, ws = _fp8_weight(N, K)
        for Mm in (1024, 2048):
            x = torch.randn(Mm, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = act_quant_fp8(x)
            floor_ms = 2 * Mm * N * K / ceil["fp8_flop_per_s"] * 1e3
            for dot, args in (("fp8", (xq, wc, ws, torch.bfloat16, xs)), ("mm", (x, wc, ws))):
                label = f"w8a8 {name} M={Mm} {dot}{'.prequant' if dot == 'fp8' else ''}"
                fn = _gemm_call(w8a8_linear, args, dot, None)
                _timed_row(rows, label, deadline, fn, shape=[Mm, N, K], floor_ms=floor_ms)
    for name in ("wq_b", "wo_b"):
        N, K = shapes.get(name, (0, 0))
        if not N:
            continue
        wc, ws = _fp8_weight(N, K)
        wbytes = wc.numel() + ws.numel()
        for Md in (1, 64):
            label = f"w8a8 {name} M={Md} fp8"
            if time.monotonic() > deadline:
                rows.append({"name": label, "error": "skipped: time budget"})
                continue
            try:
                x = torch.randn(Md, K, device="cuda", dtype=torch.bfloat16)
                ms, how = time_ms(lambda x=x, wc=wc, ws=ws: w8a8_linear(x, wc, ws, dot="fp8"))
                floor_ms = (wbytes + 2 * Md * (N + K)) / ceil["copy_bytes_per_s"] * 1e3
                peer_ms = time_ms(_rowwise_peer(Md, N, K))[0]
                rows.append(
                    {
                        "name": label,
                        "shape": [Md, N, K],
                        "ms": ms,
                        "floor_ms": floor_ms,
                        "of_floor": floor_ms / ms,
                        "peer": "torch._scaled_mm rowwise (M padded to 16)",
                        "peer_ms": peer_ms,
                        "timing": how,
                    }
                )
            except Exception as exc:  # noqa: BLE001
                rows.append({"name": label, "error": f"{type(exc).__name__}: {exc}"[:400]})
                traceback.print_exc()


def _moe_layer(cfg, seed: int = 0):
    """(resident weights, bf16 dequantized weights) of one MoE layer ``layers.0.ffn`` at the
    spec's widths: random FP4 experts drawn in storage format on the device."""
    from v41plan.model.quant import QuantWeight, e8m0_encode

    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(seed)

    def fp4(out: int, inp: int) -> QuantWeight:
        shape = (E, out, inp // 2)
        codes = torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8)
        base = round(math.log2(inp**-0.5 / 2.93))
        field = torch.randint(-1, 2, (E, out, inp // 32), generator=g, device="cuda") + base
        scales = e8m0_encode(torch.pow(2.0, field.to(torch.float32)))
        return QuantWeight(codes.view(torch.int8), scales, "fp4")

    def fp8(out: int, inp: int) -> QuantWeight:
        return QuantWeight(*_fp8_weight(out, inp), "fp8")

    p = "layers.0.ffn."
    res = {
        p + "gate.weight": (torch.randn(E, D, device="cuda", generator=g) * D**-0.5).to(
            torch.bfloat16
        ),
        p + "gate.bias": torch.randn(E, device="cuda", generator=g) * 0.05,
        p + "experts.w1": fp4(I, D),
        p + "experts.w3": fp4(I, D),
        p + "experts.w2": fp4(D, I),
        p + "shared_experts.w1.weight": fp8(I, D),
        p + "shared_experts.w3.weight": fp8(I, D),
        p + "shared_experts.w2.weight": fp8(D, I),
    }
    deq = {
        k: (v.dequantize(torch.bfloat16) if isinstance(v, QuantWeight) else v)
        for k, v in res.items()
    }
    return res, deq


def moe_rows(cfg, ceil, quick: bool, rows: list, deadline: float, report: dict) -> None:
    """One MoE layer at decode batch 64 and an 8K prefill, against its floor and two peers."""
    from v41plan.model.layers import MoE
    from v41plan.model.quant import weight_nbytes
    from v41plan.runtime.kernels.triton_moe import default_moe_dot
    from v41plan.runtime.resident import GroupedMoE

    res, deq = _moe_layer(cfg)
    E, D, I, k = (
        cfg.n_routed_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
    )
    expert_bytes = res["layers.0.ffn.experts.w1"].nbytes // E * 3  # one expert, w1 + w3 + w2
    fixed_bytes = sum(
        weight_nbytes({n: v}) for n, v in res.items() if ".experts.w" not in n
    )  # shared expert, gate
    report["resident_bytes"] = weight_nbytes(res)
    report["bf16_bytes"] = weight_nbytes(deq)
    report["checkpoint_bytes"] = report["resident_bytes"]  # one layer's published tensors
    # the runtime's dot mode first (--quick: it alone), then the other
    first = default_moe_dot(torch.device("cuda"))
    modes = [first] + ([] if quick else [m for m in ("fp8", "bf16") if m != first])
    ours = {m: GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot=m) for m in modes}
    grouped = GroupedMoE(cfg, deq, "layers.0", torch.bfloat16, impl="torch", mm_impl="grouped_mm")
    dense = MoE(cfg, deq, "layers.0", torch.bfloat16)
    for label, n in (("decode64", 64), ("prefill8k", 8192)):
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        ids = ours[first].route(x)[0]
        e_act = int(torch.unique(ids).numel())
        nbytes = e_act * expert_bytes + fixed_bytes + n * D * 2 * 2
        flops = 2 * n * (k + 1) * 3 * D * I + 2 * n * E * D
        floor_ms = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["fp8_flop_per_s"]) * 1e3
        peers = {}
        for pname, mod in (("grouped_mm bf16", grouped), ("dense-over-experts bf16", dense)):
            if time.monotonic() > deadline:
                continue
            try:
                peers[pname] = time_ms(lambda mod=mod, x=x: mod(x))[0]
            except Exception as exc:  # noqa: BLE001
                peers[pname] = f"{type(exc).__name__}: {exc}"[:200]
                traceback.print_exc()
        for dot, mod in ours.items():
            name = f"moe {label} w4a8 {dot}"
            if time.monotonic() > deadline:
                rows.append({"name": name, "error": "skipped: time budget"})
                continue
            try:
                ms, how = time_ms(lambda mod=mod, x=x: mod(x))
                pm = peers.get("grouped_mm bf16")
                rows.append(
                    {
                        "name": name,
                        "tokens": n,
                        "experts_selected": e_act,
                        "ms": ms,
                        "floor_ms": floor_ms,
                        "of_floor": floor_ms / ms,
                        "floor_bytes": nbytes,
                        "floor_flops": flops,
                        "peer": "grouped_mm bf16",
                        "peer_ms": pm if isinstance(pm, float) else None,
                        "peers_ms": peers,
                        "timing": how,
                    }
                )
            except Exception as exc:  # noqa: BLE001
                rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
                traceback.print_exc()


def _decode_rows(M: int, N: int, K: int, wc, ws, ceil) -> tuple:
    """``M`` random rows quantized as the runtime quantizes them (``(codes, scales)``) and the
    ``[N, K]`` FP8 linear's bytes floor at those rows (weight, input and bf16 output)."""
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    xq, xs = act_quant_fp8(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    nbytes = wc.numel() + ws.numel() + M * (2 * N + K)
    return xq, xs, nbytes / ceil["copy_bytes_per_s"] * 1e3


def _sweep_row(rows: list, name: str, fn, floor_ms: float, config, deadline: float) -> None:
    """Time ``fn`` as one sweep row (or record why it did not run)."""
    if time.monotonic() > deadline:
        rows.append({"name": name, "error": "skipped: time budget"})
        return
    try:
        ms, how = time_ms(fn)
        rows.append(
            {
                "name": name,
                "ms": ms,
                "floor_ms": floor_ms,
                "of_floor": floor_ms / ms,
                "peer": None,
                "peer_ms": None,
                "timing": how,
                "config": config.__dict__ if config is not None else None,
            }
        )
    except Exception as exc:  # noqa: BLE001 (report the row, keep going)
        rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
        traceback.print_exc()


def sweep_rows(
    cfg, ceil, rows: list, deadline: float, parts=("w8a8", "w8a8_decode", "moe")
) -> None:
    """Tiles and splits against the defaults (``--sweep``): the W8A8 linear at prefill shapes
    (pre-quantized input) over tiles, at decode shapes with the default split-K against none,
    and the routed experts (``grouped_moe_w4a8``) at decode 1 / 64 and an 8K prefill over
    ``MoEConfig`` tiles. ``{}`` marks the shipped default."""
    import dataclasses

    from v41plan.runtime.kernels.triton_gemm import (
        GemmConfig,
        default_config,
        split_k_for,
        w8a8_linear,
    )
    from v41plan.runtime.kernels.triton_moe import (
        MoEConfig,
        default_moe_config,
        grouped_moe_w4a8,
    )
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8
    from v41plan.runtime.resident import GroupedMoE

    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shapes = {
        "wq_a": (cfg.q_lora_rank, D),
        "wq_a+wkv": (cfg.q_lora_rank + d, D),
        "wq_b": (H * d, cfg.q_lora_rank),
        "wkv": (d, D),
        "wo_b": (D, cfg.o_groups * cfg.o_lora_rank),
        "shared.w2": (D, cfg.moe_intermediate_size),
    }
    tiles = [
        None,
        GemmConfig(128, 128, 64, 8, 4),
        # operand tiles by TMA descriptors (one 32-lane block a step)
        GemmConfig(128, 128, 32, 8, 4, tma=True),
        GemmConfig(128, 128, 32, 8, 6, tma=True),
        GemmConfig(128, 64, 32, 4, 4, tma=True),
        GemmConfig(64, 128, 32, 4, 4, tma=True),
        GemmConfig(128, 64, 32, 4, 6, tma=True),
        GemmConfig(64, 64, 32, 4, 4, tma=True),
    ]
    # bf16 operands: the block scales applied to the decoded tiles, one dot per K step (by
    # pointers, and by TMA descriptors at 64 and 128 lanes a step)
    bf16_tiles = [
        None,
        GemmConfig(128, 128, 64, 8, 4, tma=True),
        GemmConfig(128, 128, 128, 8, 3, tma=True),
        GemmConfig(128, 64, 128, 4, 4, tma=True),
        GemmConfig(128, 256, 64, 8, 3, tma=True),
    ]

    def moe_sweep() -> None:
        res, _ = _moe_layer(cfg)
        moe = GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot="fp8")
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        expert_bytes = res["layers.0.ffn.experts.w1"].nbytes // E * 3
        moe_tiles = {  # (dot mode, decode or prefill): tiles
            ("fp8", "decode"): [None],
            ("fp8", "prefill"): [None],
            # bf16 operands: the scales applied to the decoded tiles, one dot per K step
            ("bf16", "decode"): [
                None,
                MoEConfig(16, 32, 64, 128, 4, 3),
                MoEConfig(16, 32, 64, 256, 4, 3),
                MoEConfig(16, 64, 64, 128, 4, 4),
                MoEConfig(16, 64, 128, 256, 8, 3),
                # raw tiles loaded a K step ahead (the decode's loads feed the FP4 decode, not
                # the dot, so the pipeliner leaves them alone)
                MoEConfig(16, 32, 64, 256, 4, 3, prefetch=True),
                # even and odd lanes apart: two codes decoded per instruction, bf16 activations
                MoEConfig(16, 32, 64, 256, 4, 3, pairs=True),
                MoEConfig(16, 32, 64, 128, 4, 3, pairs=True),
                MoEConfig(16, 64, 64, 256, 4, 3, pairs=True),
                MoEConfig(16, 32, 64, 256, 2, 3, pairs=True),
                MoEConfig(16, 32, 64, 128, 4, 3, prefetch=True, pairs=True),
                # pairs with the tiles by TMA descriptors
                MoEConfig(16, 32, 64, 256, 4, 3, pairs=True, tma=True),
                MoEConfig(16, 32, 64, 256, 4, 4, pairs=True, tma=True),
                MoEConfig(16, 32, 64, 128, 4, 4, pairs=True, tma=True),
                MoEConfig(16, 32, 128, 256, 4, 3, pairs=True, tma=True),
                MoEConfig(16, 64, 64, 256, 4, 3, pairs=True, tma=True),
                MoEConfig(16, 32, 64, 512, 4, 3, pairs=True, tma=True),
            ],
            ("bf16", "prefill"): [
                None,
                MoEConfig(64, 128, 128, 128, 8, 3),
                MoEConfig(128, 128, 128, 64, 8, 3),
                MoEConfig(64, 64, 64, 128, 4, 3),
                MoEConfig(128, 128, 128, 64, 8, 3, prefetch=True),
                MoEConfig(64, 128, 128, 128, 8, 3, prefetch=True),
                MoEConfig(128, 128, 128, 64, 8, 3, pairs=True),
                MoEConfig(128, 128, 128, 128, 8, 3, pairs=True),
                MoEConfig(64, 128, 128, 128, 8, 3, pairs=True),
                MoEConfig(128, 128, 128, 64, 8, 3, pairs=True, tma=True),
                MoEConfig(128, 128, 128, 128, 8, 3, pairs=True, tma=True),
                MoEConfig(64, 128, 128, 128, 8, 3, pairs=True, tma=True),
                MoEConfig(128, 128, 128, 64, 8, 4, pairs=True, tma=True),
            ],
        }
        for label, n in (("decode1", 1), ("decode64", 64), ("prefill8k", 8192)):
            x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
            ids, wts = moe.route(x)
            xq, xs = act_quant_fp8(x)
            e_act = int(torch.unique(ids).numel())
            nbytes = e_act * expert_bytes + n * D * 2 * 2
            flops = 2 * n * k * 3 * D * I
            floor_ms = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["fp8_flop_per_s"]) * 1e3
            for dot in ("fp8", "bf16"):
                for c in moe_tiles[dot, "prefill" if n > 1024 else "decode"]:
                    tag = (
                        "{}"
                        if c is None
                        else (
                            f"{c.block_m}x{c.block_n}/{c.block_n_down}x{c.block_k} "
                            f"w{c.num_warps} s{c.num_stages}{' prefetch' if c.prefetch else ''}"
                            f"{' pairs' if c.pairs else ''}{' tma' if c.tma else ''}"
                        )
                    )
                    fn = lambda c=c, a=(xq, xs, ids, wts), dot=dot: grouped_moe_w4a8(
                        *a, moe.w1, moe.w3, moe.w2, 0, moe.limit, torch.bfloat16, dot=dot, config=c,
                    )  # fmt: skip
                    name = f"sweep moe routed {label} {dot} {tag}"
                    _sweep_row(rows, name, fn, floor_ms, c, deadline)

    def moe_kernels() -> None:
        """Per-kernel device time of the routed experts (one profiled graph replay) at decode
        1 / 64 with the pairs tiles and with pairs + tma: where the TMA form's time goes."""
        from bench_decode_paths import _kernel_table

        res, _ = _moe_layer(cfg)
        moe = GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot="bf16")
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        expert_bytes = res["layers.0.ffn.experts.w1"].nbytes // E * 3
        for label, n, bn in (("decode1", 1, 32), ("decode64", 64, 64)):
            x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
            ids, wts = moe.route(x)
            xq, xs = act_quant_fp8(x)
            # moe_sweep's floor of the routed experts, against the kernels' busy time
            nbytes = int(torch.unique(ids).numel()) * expert_bytes + n * D * 2 * 2
            flops = 2 * n * k * 3 * D * I
            floor_ms = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["fp8_flop_per_s"]) * 1e3
            for tma in (False, True):
                c = MoEConfig(16, bn, 64, 256, 4, 3, pairs=True, tma=tma)
                name = f"kernels moe routed {label} pairs{' tma' if tma else ''}"
                if time.monotonic() > deadline:
                    rows.append({"name": name, "error": "skipped: time budget"})
                    continue
                try:
                    fn = lambda c=c, a=(xq, xs, ids, wts): grouped_moe_w4a8(
                        *a, moe.w1, moe.w3, moe.w2, 0, moe.limit, torch.bfloat16, dot="bf16",
                        config=c,
                    )  # fmt: skip
                    g = torch.cuda.CUDAGraph()
                    fn()
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g):
                        fn()
                    table, busy = _kernel_table(g.replay, 5, 8)
                    rows.append({"name": name, "kernel_table": table, "kernel_busy_ms": busy,
                                 "ms": busy, "floor_ms": floor_ms, "of_floor": floor_ms / busy,
                                 "config": c.__dict__})  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
                    traceback.print_exc()

    def moe_occupancy() -> None:
        """The routed experts' decode forms at 1, 8 and 64 tokens against the default: a cap of
        128 registers a thread (four programs a multiprocessor, not three), 128-lane K steps
        (fewer registers, other sums), narrower down tiles (more programs, the same sums); each
        row says whether its output equals the default's bit for bit."""
        res, _ = _moe_layer(cfg)
        moe = GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot="bf16")
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        expert_bytes = res["layers.0.ffn.experts.w1"].nbytes // E * 3
        for label, n in (("decode1", 1), ("decode8", 8), ("decode64", 64)):
            x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
            ids, wts = moe.route(x)
            xq, xs = act_quant_fp8(x)
            nbytes = int(torch.unique(ids).numel()) * expert_bytes + n * D * 2 * 2
            floor_ms = nbytes / ceil["copy_bytes_per_s"] * 1e3
            base = default_moe_config(n * k, "bf16", D, I)
            forms = {
                "{}": base,
                "maxnreg128": dataclasses.replace(base, max_registers=128),
                "down bn32": dataclasses.replace(base, block_n_down=32),
                "maxnreg128 down bn32": dataclasses.replace(
                    base, max_registers=128, block_n_down=32
                ),
                "maxnreg128 s4": dataclasses.replace(base, max_registers=128, num_stages=4),
                "bk128": dataclasses.replace(base, block_k=128),
                "bk128 s4": dataclasses.replace(base, block_k=128, num_stages=4),
            }
            ref = None
            for tag, c in forms.items():
                fn = lambda c=c, a=(xq, xs, ids, wts): grouped_moe_w4a8(
                    *a, moe.w1, moe.w3, moe.w2, 0, moe.limit, torch.bfloat16, dot="bf16",
                    config=c,
                )  # fmt: skip
                _sweep_row(rows, f"occupancy moe routed {label} {tag}", fn, floor_ms, c, deadline)
                if rows[-1].get("ms") is None:
                    continue
                out = fn()
                ref = out if ref is None else ref
                rows[-1]["bit_identical"] = bool(torch.equal(out, ref))

    if "moe" in parts:  # first: the rows the kernels' next step depends on
        moe_sweep()
    if "moe_kernels" in parts:
        moe_kernels()
    if "moe_occupancy" in parts:
        moe_occupancy()
    M = 8192
    for name in ("wq_b", "wo_b") if "w8a8" in parts else ():
        N, K = shapes[name]
        wc, ws = _fp8_weight(N, K)
        xq, xs = act_quant_fp8(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
        floor_ms = 2 * M * N * K / ceil["fp8_flop_per_s"] * 1e3
        for dot, cands in (("fp8", tiles), ("bf16", bf16_tiles)):
            for c in cands:
                tag = (
                    "{}"
                    if c is None
                    else f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
                    + (" tma" if c.tma else "")
                )
                fn = lambda a=(xq, wc, ws, torch.bfloat16, xs, dot), c=c: w8a8_linear(*a, config=c)
                name_ = f"sweep w8a8 {name} M={M} prequant {dot} {tag}"
                _sweep_row(rows, name_, fn, floor_ms, c, deadline)
    for name, (N, K) in shapes.items() if "w8a8_decode" in parts else ():
        wc, ws = _fp8_weight(N, K)
        wbytes = wc.numel() + ws.numel()
        for Md in (1, 64):
            x = torch.randn(Md, K, device="cuda", dtype=torch.bfloat16)
            floor_ms = (wbytes + 2 * Md * (N + K)) / ceil["copy_bytes_per_s"] * 1e3
            base = default_config(Md, N, K, "fp8")
            for c in (base, dataclasses.replace(base, split_k=1)):
                tag = f"split {c.split_k}" + (" {}" if c is base else "")
                fn = lambda x=x, wc=wc, ws=ws, c=c: w8a8_linear(x, wc, ws, config=c)
                _sweep_row(rows, f"sweep w8a8 {name} M={Md} {tag}", fn, floor_ms, c, deadline)

                # the input quantized by its own launch first (the same codes), timed with it
                def pre(x=x, wc=wc, ws=ws, c=c):
                    xq, xs = act_quant_fp8(x)
                    return w8a8_linear(xq, wc, ws, torch.bfloat16, xs, config=c)

                _sweep_row(
                    rows, f"sweep w8a8 {name} M={Md} {tag} prequant", pre, floor_ms, c, deadline
                )
    for name, (N, K) in shapes.items() if "w8a8_decode_tiles" in parts else ():
        # decode tiles on pre-quantized rows (the runtime's form): rows, K step, depth and warps
        # with the default's lanes and splits, so every row must keep the default's bits
        wc, ws = _fp8_weight(N, K)
        for Md in (1, 64):
            xq, xs, floor_ms = _decode_rows(Md, N, K, wc, ws, ceil)
            base = default_config(Md, N, K, "fp8")
            forms = [(16, 64, 4, 4), (16, 128, 4, 4), (16, 256, 3, 4), (16, 128, 6, 4)]
            if Md > 16:
                forms += [(64, 64, 4, 4), (64, 128, 3, 4), (64, 128, 4, 4), (64, 128, 4, 8)]
                forms += [(64, 256, 3, 4), (32, 128, 4, 4), (32, 256, 3, 4)]
            cands = [base] + [
                dataclasses.replace(base, block_m=bm, block_k=bk, num_stages=st, num_warps=w)
                for bm, bk, st, w in forms
                if (bm, bk, st, w) != (base.block_m, base.block_k, base.num_stages, base.num_warps)
            ]
            # twice the splits (other sums: their bits are not compared)
            cands += [
                dataclasses.replace(base, block_k=bk, split_k=2 * base.split_k) for bk in (64, 128)
            ]
            ref = w8a8_linear(xq, wc, ws, torch.bfloat16, xs, config=base)
            for c in cands:
                tag = (
                    f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} "
                    f"split {c.split_k}" + (" {}" if c is base else "")
                )
                fn = lambda a=(xq, wc, ws, torch.bfloat16, xs), c=c: w8a8_linear(*a, config=c)
                _sweep_row(rows, f"tiles w8a8 {name} M={Md} {tag}", fn, floor_ms, c, deadline)
                if rows[-1].get("ms") is not None and c.split_k == base.split_k:
                    rows[-1]["bit_identical"] = bool(torch.equal(fn(), ref))
    for name in ("wq_b", "wo_b", "shared.w2", "wq_a+wkv") if "w8a8_decode_tma" in parts else ():
        # decode rows by TMA descriptors (GemmConfig.tma, with the pointer kernel's K splits):
        # the fp8 mode at 16 and 64 rows a tile, the bf16 mode's exact operands at wide steps
        N, K = shapes[name]
        wc, ws = _fp8_weight(N, K)
        for Md in (1, 64):
            xq, xs, floor_ms = _decode_rows(Md, N, K, wc, ws, ceil)
            base = default_config(Md, N, K, "fp8")
            forms = [  # (dot, block_m, block_n, block_k, stages)
                ("fp8", 16, 64, 32, 4), ("fp8", 16, 64, 32, 8), ("fp8", 16, 32, 32, 6),
                ("fp8", 64, 64, 32, 4), ("fp8", 64, 128, 32, 4), ("bf16", 16, 64, 128, 4),
                ("bf16", 64, 64, 128, 4), ("bf16", 64, 128, 64, 4),
            ]  # fmt: skip
            cands = [("fp8", base)]
            for dot, bm, bn, bk, st in forms:
                c = GemmConfig(bm, bn, bk, num_warps=4, num_stages=st, tma=True)
                cands.append((dot, dataclasses.replace(c, split_k=split_k_for(N, K, c))))
            ref = w8a8_linear(xq, wc, ws, torch.bfloat16, xs, config=base)
            for dot, c in cands:
                tag = f"{dot} {c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages}"
                tag += f" split {c.split_k}" + (" tma" if c.tma else " {}")
                fn = lambda a=(xq, wc, ws, torch.bfloat16, xs, dot), c=c: w8a8_linear(*a, config=c)
                _sweep_row(rows, f"tma w8a8 {name} M={Md} {tag}", fn, floor_ms, c, deadline)
                if rows[-1].get("ms") is not None:
                    rows[-1]["max_rel_diff"] = float(
                        (fn().float() - ref.float()).abs().max() / ref.float().abs().max()
                    )
    if "swiglu_launch" in parts:  # the shared expert's split-K end: its own launch or a second
        from v41plan.runtime.kernels import triton_gemm
        from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

        I = cfg.moe_intermediate_size
        wc, ws = _fp8_weight(I, D)
        floor_ms = 2 * (wc.numel() + ws.numel()) / ceil["copy_bytes_per_s"] * 1e3
        saved = triton_gemm.SPLIT_ONE_LAUNCH
        try:
            for Md in (1, 8, 16, 17, 64):
                xq, xs = act_quant_fp8(torch.randn(Md, D, device="cuda", dtype=torch.bfloat16))
                fn = lambda a=(xq, xs, (wc, ws), (wc, ws), 10.0, torch.bfloat16): [
                    t.view(torch.uint8) for t in w8a8_swiglu(*a)
                ]
                outs = []
                for one in (False, True):
                    triton_gemm.SPLIT_ONE_LAUNCH = one
                    c = default_config(Md, I, D, "fp8")
                    tag = "one launch" if one else "two launches"
                    _sweep_row(rows, f"swiglu shared.w13 M={Md} {tag}", fn, floor_ms, c, deadline)
                    outs.append(fn())
                if rows[-1].get("ms") is not None:
                    rows[-1]["bit_identical"] = all(
                        torch.equal(a, b) for a, b in zip(*outs, strict=True)
                    )
        finally:
            triton_gemm.SPLIT_ONE_LAUNCH = saved
    for name in ("wq_b", "wo_b", "shared.w2") if "w8a8_decode_bf16" in parts else ():
        # 17 to 64 rows of a wide weight: the default's fp8 mode (a scaled product each 32-lane
        # block) against bf16 operands (exact; one dot a K step), at the default's splits
        N, K = shapes[name]
        wc, ws = _fp8_weight(N, K)
        for Md in (32, 64):
            xq, xs, floor_ms = _decode_rows(Md, N, K, wc, ws, ceil)
            base = default_config(Md, N, K, "fp8")
            forms = [(64, 64, 4, 4), (64, 128, 3, 4), (64, 128, 4, 8), (128, 64, 4, 4)]
            forms += [(128, 128, 3, 8), (32, 64, 4, 4)]
            cands = [("fp8", base)] + [
                (
                    "bf16",
                    dataclasses.replace(base, block_n=bn, block_k=bk, num_stages=st, num_warps=w),
                )
                for bn, bk, st, w in forms
            ]
            for dot, c in cands:
                tag = f"{dot} {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
                tag += f" split {c.split_k}" + (" {}" if c is base else "")
                fn = lambda a=(xq, wc, ws, torch.bfloat16, xs, dot), c=c: w8a8_linear(*a, config=c)
                _sweep_row(rows, f"modes w8a8 {name} M={Md} {tag}", fn, floor_ms, c, deadline)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="flash_slice")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no config sweep")
    ap.add_argument("--budget-s", type=float, default=160.0, help="skip rows past this")
    ap.add_argument(
        "--sweep", action="store_true", help="also tiles and splits against the defaults"
    )
    ap.add_argument(
        "--sweep-parts",
        default="w8a8,w8a8_decode,moe",
        help="the sweep's parts: w8a8 (prefill tiles), w8a8_decode (split-K), w8a8_decode_tiles "
        "(decode rows' tiles at the default's splits), w8a8_decode_bf16 (17-64 rows in the bf16 "
        "mode), w8a8_decode_tma (decode rows by TMA descriptors, split K), "
        "swiglu_launch (the shared expert's split-K end in one launch or two), moe, "
        "moe_kernels (the routed experts' kernels one by one), moe_occupancy (decode forms: a "
        "register cap, narrower tiles, shorter K steps)",
    )
    ap.add_argument("--no-main", action="store_true", help="the sweep's rows alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_moe.py needs a CUDA device")
        return 1
    import triton

    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.config import config_from_cache_spec

    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cfg = config_from_cache_spec(load_cache_spec(args.spec))
    ceil = {
        "copy_bytes_per_s": copy_bandwidth_bytes_per_s(),
        "bf16_flop_per_s": bf16_matmul_flop_per_s(),
        "fp8_flop_per_s": fp8_rowwise_flop_per_s(),
    }
    from v41plan.validation.provenance import provenance

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "provenance": provenance(),
        "spec": args.spec,
        "ceilings": ceil,
    }
    rows: list = []
    for part in (
        lambda: None if args.no_main else w8a8_rows(cfg, ceil, args.quick, rows, deadline),
        lambda: None if args.no_main else moe_rows(cfg, ceil, args.quick, rows, deadline, report),
        lambda: (
            sweep_rows(cfg, ceil, rows, deadline, args.sweep_parts.split(","))
            if args.sweep
            else None
        ),
    ):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 (a broken part leaves the others' rows)
            rows.append({"name": "setup", "error": f"{type(exc).__name__}: {exc}"[:400]})
            traceback.print_exc()
    report["rows"] = rows
    report["wall_s"] = time.monotonic() - t0
    print(
        f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
        f"commit {report['commit']}  spec {args.spec}"
    )
    print(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, fp8 rowwise "
        f"{ceil['fp8_flop_per_s'] / 1e12:.0f} TFLOP/s"
    )
    write_report(report, args.out, "bench_gemm_moe.json")  # first: a printing slip loses nothing
    print(f"{'row':44} {'ms':>9} {'floor ms':>9} {'of_floor':>8} {'peer ms':>9}  timing")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:44} ERROR {r['error']}")
            continue
        if "kernel_table" in r:  # the moe_kernels part: device time by kernel
            print(
                f"{r['name']:44} kernels busy {r['kernel_busy_ms']:.4f} ms  "
                f"of_floor {r['of_floor']:.3f}"
            )
            for k in r["kernel_table"]:
                print(f"{'':8}{k['us']:9.1f} us {k['calls']:5.1f} x {k['kernel'][:70]}")
            continue
        pm = r.get("peer_ms")
        pm_s = f"{pm:9.3f}" if isinstance(pm, float) else f"{'-':>9}"
        print(
            f"{r['name']:44} {r['ms']:9.3f} {r['floor_ms']:9.3f} {r['of_floor']:8.3f} "
            f"{pm_s}  {r['timing']}" + ("" if r.get("bit_identical", True) else "  BITS DIFFER")
        )
        if "peers_ms" in r:
            print(f"{'':44} peers: {r['peers_ms']}")
    print(f"wall {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
