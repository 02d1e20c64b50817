"""Where the decode mHC site's time goes, on one GPU (MEDIUM widths, or ``--spec``'s).

    python3 benchmarks/probe_site.py [--spec medium] [--tokens 1,64] [--no-gemm] [--out F]

The site kernel takes far longer than its bytes at decode (14 us at one token at flash widths
on an H100, 28-34 at medium widths before the split form). This times, per token count, the
forms with parts taken away: the split form whole (one launch, its last program finishing),
its first pass alone (two launches, the finishing one skipped), with one Sinkhorn iteration
instead of the model's, without the FP8 epilogue, with 64 and 256 lanes a program instead of
``SPLIT_LANES``, and (as the runtime runs it, no FP8 epilogue) with the finishing program's
norm pass in wider chunks (``NORM_CHUNK_LANES``); the products form with the model's
iterations and with one. The differences
say which part holds the time. Rows: ``ms`` (CUDA-graph replays), ``floor_ms`` (the call's bytes
over the copy bandwidth measured here) and ``of_floor``; writes JSON (``$OUT/probe_site.json``
or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_moe import time_ms
from ceilings import copy_bandwidth_bytes_per_s
from report_io import write_report


def site_bytes(N: int, D: int, hc: int = 4) -> int:
    """Bytes one site call must move: bf16 streams and weight, float32 pre-mix and parameters
    in; the normed row, its FP8 codes and scales, pre/post/C out."""
    mixes = (2 + hc) * hc
    params = (mixes * hc * D + mixes + 3) * 4 + D * 2
    return (
        N * hc * D * 2 + N * hc * 4 + params + N * D * (2 + 1) + N * (D // 32) * 4 + N * mixes * 4
    )


def w8a8_bytes(out: int, inp: int) -> int:
    """Bytes of a one-row W8A8 call: E4M3 weight, its 32 x 32 scales, the bf16 row in and out."""
    return out * inp + -(-out // 32) * (inp // 32) + inp * 2 + out * 2


class _Skipped:
    """A kernel stand-in whose launches do nothing (times the other launch alone)."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def gemm_rows(cfg, rows: list, bw: float) -> None:
    """The W8A8 linear at one row, K = hidden (``wq_a``'s shape): the FP8 mode with the
    quantizer in the prologue, with codes quantized before, and the bf16 mode (dequantized
    operands, one ``tl.dot`` per 128 or 256 lanes instead of one per 32)."""
    from bench_gemm_moe import _fp8_weight

    from v41plan.runtime.kernels.triton_gemm import GemmConfig, w8a8_linear
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    D, q = cfg.hidden_size, cfg.q_lora_rank
    codes, scales = _fp8_weight(q, D)
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    xq, xs = act_quant_fp8(x)
    cases = [
        ("fp8, quantizer fused, bk 64", {"dot": "fp8"}, GemmConfig(16, 32, 64), False),
        ("fp8, quantized before, bk 64", {"dot": "fp8"}, GemmConfig(16, 32, 64), True),
        ("fp8, quantized before, bk 256", {"dot": "fp8"}, GemmConfig(16, 32, 256), True),
        ("bf16 operands, bk 128", {"dot": "bf16"}, GemmConfig(16, 32, 128), False),
        ("bf16 operands, bk 256", {"dot": "bf16"}, GemmConfig(16, 32, 256), False),
        ("bf16 operands, bn 16 bk 256", {"dot": "bf16"}, GemmConfig(16, 16, 256), False),
    ]
    for label, kw, tile, pre in cases:
        if pre:
            call = lambda kw=kw, tile=tile: w8a8_linear(
                xq, codes, scales, torch.bfloat16, x_scales=xs, config=tile, **kw
            )
        else:
            call = lambda kw=kw, tile=tile: w8a8_linear(
                x, codes, scales, torch.bfloat16, config=tile, **kw
            )
        try:
            ms, how = time_ms(call)
        except Exception as exc:  # noqa: BLE001 - a failing case is a row
            rows.append({"case": f"w8a8 {q}x{D} {label}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        fl = w8a8_bytes(q, D) / bw * 1e3
        rows.append(
            {"case": f"w8a8 {q}x{D} {label}", "tokens": 1, "ms": ms, "timing": how,
             "floor_ms": fl, "of_floor": fl / ms}
        )  # fmt: skip
        print(f"   1 {'w8a8 ' + label:>32} {ms * 1e3:>8.1f} us", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="medium")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--no-gemm", action="store_true", help="skip the W8A8 rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_site.py needs a CUDA device", file=sys.stderr)
        return 2
    from v41plan.geometry.resolve import resolve_spec
    from v41plan.model.config import config_from_cache_spec
    from v41plan.model.layers import HcParams
    from v41plan.runtime.kernels import triton_dense as td
    from v41plan.validation.provenance import provenance

    cfg = config_from_cache_spec(resolve_spec(args.spec))
    D, hc, iters = cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters
    g = torch.Generator(device="cuda").manual_seed(0)
    mixes = (2 + hc) * hc
    p = HcParams(
        torch.randn(mixes, hc * D, generator=g, device="cuda") * 0.02,
        torch.randn(mixes, generator=g, device="cuda"),
        torch.rand(3, generator=g, device="cuda") + 0.5,
    )
    w = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
    bw = copy_bandwidth_bytes_per_s()
    rows: list[dict] = []
    forms = {"split": ("split", 1, 128, 4), "products": ("products", 1, 128, 4)}
    forms["split64"] = ("split", 1, 64, 2)  # a program's lanes are at least its chunk
    # (label, form, Sinkhorn iterations, FP8 epilogue, finishing launch skipped, lanes, lanes a
    # round trip of the finishing program's norm pass)
    lanes0, chunk0 = td.SPLIT_LANES, td.NORM_CHUNK_LANES
    cases = [
        ("split whole", "split", iters, True, False, lanes0, chunk0),
        ("split first pass alone", "split", iters, True, True, lanes0, chunk0),
        ("split, 1 Sinkhorn iteration", "split", 1, True, False, lanes0, chunk0),
        ("split, no FP8 epilogue", "split", iters, False, False, lanes0, chunk0),
        ("split, 64 lanes a program (2 warps)", "split64", iters, True, False, 64, chunk0),
        ("split, 256 lanes a program", "split", iters, True, False, 256, chunk0),
        ("products whole", "products", iters, True, False, lanes0, chunk0),
        ("products, 1 Sinkhorn iteration", "products", 1, True, False, lanes0, chunk0),
    ]
    # the runtime's sites (no FP8 epilogue) with the norm pass in fewer, wider round trips
    cases += [
        (f"split, no FP8 epilogue, norm {c} lanes a trip", "split", iters, False, False, lanes0, c)
        for c in (2048, 4096, 8192)
    ]
    saved = list(td.SITE_CONFIGS), list(td.SITE_CONFIGS_WIDE), td.SPLIT_ONE_LAUNCH
    finish = td._mhc_site_finish_kernel
    for N in [int(t) for t in args.tokens.split(",")]:
        X = torch.randn(N, hc, D, generator=g, device="cuda").to(torch.bfloat16)
        pre = torch.rand(N, hc, generator=g, device="cuda") + cfg.hc_eps
        for label, form, its, quant, skip, lanes, chunk in cases:
            # a finite bound: the split form sizes its arrival counters from the tables
            td.SITE_CONFIGS[:] = td.SITE_CONFIGS_WIDE[:] = [(4096, forms[form])]
            td.SPLIT_ONE_LAUNCH = not skip  # alone: two launches, the second skipped
            td.SPLIT_LANES, td.NORM_CHUNK_LANES = lanes, chunk
            td._mhc_site_finish_kernel = _Skipped() if skip else finish
            fn = td.mhc_site_fp8 if quant else td.mhc_site
            try:
                ms, how = time_ms(
                    lambda fn=fn, its=its, X=X, pre=pre: fn(
                        X, pre, p, w, hc, its, cfg.hc_eps, cfg.rms_norm_eps
                    )
                )
                fl = site_bytes(N, D) / bw * 1e3
                rows.append(
                    {"case": label, "tokens": N, "ms": ms, "timing": how, "floor_ms": fl,
                     "of_floor": fl / ms}
                )  # fmt: skip
                print(f"{N:>4} {label:>32} {ms * 1e3:>8.1f} us", flush=True)
            except Exception as exc:  # noqa: BLE001 - a failing case is a row
                rows.append({"case": label, "tokens": N, "error": f"{type(exc).__name__}: {exc}"})
            finally:
                td.SITE_CONFIGS[:], td.SITE_CONFIGS_WIDE[:] = saved[0], saved[1]
                td.SPLIT_ONE_LAUNCH, td.SPLIT_LANES = saved[2], lanes0
                td.NORM_CHUNK_LANES = chunk0
                td._mhc_site_finish_kernel = finish
    if not args.no_gemm:
        gemm_rows(cfg, rows, bw)
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(),
        "spec": args.spec,
        "copy_bytes_per_s": bw,
        "rows": rows,
    }
    write_report(report, args.out, "probe_site.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
