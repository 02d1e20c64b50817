"""Tile sweep of the decode step's heaviest kernels at the MEDIUM widths, on one GPU.

    python3 benchmarks/sweep_decode_tiles.py [--tokens 1,8,64] [--budget-s 400] [--out F]

The kernel table of ``bench_decode_paths.py`` names three kernels that take most of a medium
decode replay at batch 1: the mHC site (about 37 us a call), the W8A8 linear (about 9 us) and
the grouped MoE's gate/up GEMM (about 25 us), each far above its bytes. This sweep times, per
decode batch width and shape, the shipped tile choice against alternatives:

- ``site``: the decode site forms (``mhc_site_fp8`` and ``mhc_expand_site_fp8``, what decode
  runs): ``products`` (one program per token) and ``split`` (``SPLIT_LANES`` lanes per
  first-pass program, then a finishing program per token) at several widths. Outputs against
  the ``products`` form's (max abs difference; both are within the module's stated bound).
- ``w8a8 <name>``: every W8A8 linear shape of a medium layer over ``GemmConfig`` tiles. A tile
  with the shipped tile's rows (``block_m``) must give its output bit for bit (the K order is
  the same); one with other rows may differ in the last bits (measured on the H200: the FP8
  tensor-core accumulation depends on the tile's row count), which its row states
  (``same_block_m``, ``max_abs_diff``).
- ``moe``: the grouped W4A8 MoE layer (routing, gate/up, down, combine, shared expert) over
  ``MoEConfig`` tiles, bit-identity against the shipped tiles as above.

Each row: ``ms`` (CUDA-graph replays, median), ``floor_ms`` (the bytes the call must move over
the copy bandwidth measured here), ``of_floor``, and ``speedup`` over the shipped choice. Prints
the best tile per shape; writes JSON (``$OUT/sweep_decode_tiles.json`` or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_moe import _fp8_weight, _moe_layer, time_ms
from ceilings import copy_bandwidth_bytes_per_s
from report_io import write_report


def _same(a, b) -> tuple[bool, float]:
    """(bit-identical, max abs difference) of two outputs (tensors or tuples of them)."""
    a = a if isinstance(a, tuple | list) else (a,)
    b = b if isinstance(b, tuple | list) else (b,)
    equal, diff = True, 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            continue
        x, y = x.contiguous(), y.contiguous()
        equal = equal and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        if x.dtype.is_floating_point and x.element_size() > 1:
            diff = max(diff, float((x.float() - y.float()).abs().max()))
    return equal, diff


def _row(rows, kind, shape, tokens, config, fn, want, floor_bytes, bw, shipped_ms=None):
    """Time ``fn``, compare it with ``want`` (the shipped output), append and return the row."""
    row = {"kernel": kind, "shape": shape, "tokens": tokens, "config": config}
    try:
        got = fn()
        row["bit_identical"], row["max_abs_diff"] = (
            _same(got, want)
            if want is not None
            else (
                True,
                0.0,
            )
        )
        row["ms"], row["timing"] = time_ms(fn)
        row["floor_ms"] = floor_bytes / bw * 1e3
        row["of_floor"] = row["floor_ms"] / row["ms"]
        if shipped_ms:
            row["speedup"] = shipped_ms / row["ms"]
    except Exception as exc:  # noqa: BLE001 - a failing tile is a row, the sweep goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        traceback.print_exc(limit=2)
    rows.append(row)
    return row


def site_rows(cfg, sizes, bw, rows, deadline) -> None:
    """The decode site forms (see the module doc)."""
    from bench_dense_kernels import _ops

    from v41plan.model import quant as Q
    from v41plan.model.layers import HcParams
    from v41plan.runtime.kernels import dense_ref as ref
    from v41plan.runtime.kernels import triton_dense as td

    ops = _ops(cfg, ref, td, Q, HcParams)
    forms = [("products", 1, 128, 4, None)]
    forms += [
        ("split", 1, bd, w, lanes) for bd, w in ((64, 2), (128, 4)) for lanes in (64, 128, 256)
    ]
    forms = [f for f in forms if f[4] is None or f[4] >= f[2]]
    for name in ("site_fp8", "expand_site"):
        make, _eager, fused, nbytes = ops[name]
        for N in sizes:
            inputs = make(N)
            want = shipped_ms = None
            for mix, bn, bd, warps, lanes in forms:
                if time.monotonic() > deadline:
                    return
                saved, saved_lanes = list(td.SITE_CONFIGS), td.SPLIT_LANES
                td.SITE_CONFIGS[:] = [(1 << 62, (mix, bn, bd, warps))]
                td.SPLIT_LANES = lanes or saved_lanes
                try:
                    call = lambda inputs=inputs, fused=fused: fused(*inputs)
                    r = _row(
                        rows, name, f"D={cfg.hidden_size}", N, f"{mix},{bn},{bd},{warps},{lanes}",
                        call, want, nbytes(N), bw, shipped_ms,
                    )  # fmt: skip
                    if want is None and "error" not in r:
                        want, shipped_ms = fused(*inputs), r["ms"]
                finally:
                    td.SITE_CONFIGS[:] = saved
                    td.SPLIT_LANES = saved_lanes


def _w8a8_shapes(cfg) -> dict[str, tuple[int, int, bool]]:
    """name -> (out, in, activation quantized in the GEMM) of a medium layer's W8A8 linears."""
    D, q, hd = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim
    return {
        "wq_a": (q, D, True),
        "wq_b": (cfg.num_attention_heads * hd, q, True),
        "wkv": (hd, D, True),
        "wo_b": (D, cfg.o_groups * cfg.o_lora_rank, True),
        "idx_wq_b": (cfg.index_n_heads * cfg.index_head_dim, q, True),
        "shared_w1": (cfg.moe_intermediate_size, D, False),
        "shared_w2": (D, cfg.moe_intermediate_size, True),
    }


def _gemm_tiles(M: int, K: int) -> list:
    from v41plan.runtime.kernels.triton_gemm import GemmConfig

    tiles = []
    bms = (16,) if M <= 16 else (16, 64)
    for bm in bms:
        for bn in (16, 32, 64):
            for bk in (64, 128, 256):
                if bk > K:
                    continue
                for stages in (3, 4):
                    tiles.append(GemmConfig(bm, bn, bk, num_warps=4, num_stages=stages))
    tiles.append(GemmConfig(16, 16, 128, num_warps=2, num_stages=4))
    return tiles


def w8a8_rows(cfg, sizes, bw, rows, deadline) -> None:
    """Every W8A8 linear shape of a medium layer over the tiles of ``_gemm_tiles``."""
    from v41plan.runtime.kernels.triton_gemm import default_config, w8a8_linear
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    for name, (N, K, quant_in) in _w8a8_shapes(cfg).items():
        codes, scales = _fp8_weight(N, K)
        for M in sizes:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            if quant_in:
                args, kw = (x, codes, scales, torch.bfloat16), {}
            else:
                xq, xs = act_quant_fp8(x)
                args, kw = (xq, codes, scales, torch.bfloat16), {"x_scales": xs}
            shipped = default_config(M, N, K, "fp8")
            want = w8a8_linear(*args, **kw, config=shipped)
            nbytes = codes.nbytes + scales.nbytes + M * K * 2 + M * N * 2
            base = _row(
                rows, f"w8a8 {name}", f"{N}x{K}", M, f"shipped {shipped}",
                lambda a=args, kw=kw, c=shipped: w8a8_linear(*a, **kw, config=c), want, nbytes, bw,
            )  # fmt: skip
            for tile in _gemm_tiles(M, K):
                if time.monotonic() > deadline:
                    return
                r = _row(
                    rows, f"w8a8 {name}", f"{N}x{K}", M, str(tile),
                    lambda a=args, kw=kw, c=tile: w8a8_linear(*a, **kw, config=c), want, nbytes, bw,
                    base.get("ms"),
                )  # fmt: skip
                r["same_block_m"] = tile.block_m == shipped.block_m


def moe_rows(cfg, sizes, bw, rows, deadline) -> None:
    """The grouped W4A8 MoE layer over ``MoEConfig`` tiles."""
    from v41plan.runtime.kernels import triton_moe
    from v41plan.runtime.kernels.triton_moe import MoEConfig, default_moe_config
    from v41plan.runtime.resident import GroupedMoE

    res, _ = _moe_layer(cfg)
    moe = GroupedMoE(cfg, res, "layers.0", torch.bfloat16, dot="fp8")
    D, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    one_expert = res["layers.0.ffn.experts.w1"].nbytes // cfg.n_routed_experts * 3
    tiles = [
        MoEConfig(16, bn, bnd, bk, num_warps=w, num_stages=3)
        for bn in (32, 64)
        for bnd in (32, 64, 128)
        for bk in (32, 128, 256)
        for w in (4,)
    ]
    shipped_of = triton_moe.default_moe_config
    for N in sizes:
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        ids = moe.route(x)[0]
        nbytes = int(torch.unique(ids).numel()) * one_expert + 3 * I * D + N * D * 4
        shipped = default_moe_config(N * k, "fp8", D, I)
        want = moe(x)
        base = _row(rows, "moe", f"D={D} I={I}", N, f"shipped {shipped}", lambda x=x: moe(x), want,
                    nbytes, bw)  # fmt: skip
        for tile in tiles:
            if time.monotonic() > deadline:
                return
            triton_moe.default_moe_config = lambda *a, tile=tile, **k: tile
            try:
                _row(rows, "moe", f"D={D} I={I}", N, str(tile), lambda x=x: moe(x), want, nbytes,
                     bw, base.get("ms"))  # fmt: skip
            finally:
                triton_moe.default_moe_config = shipped_of


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64", help="decode batch widths")
    ap.add_argument("--kernels", default="site,w8a8,moe")
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock bound of the run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_decode_tiles.py needs a CUDA device", file=sys.stderr)
        return 2
    from medium_model import load_spec

    from v41plan.model.config import config_from_cache_spec
    from v41plan.validation.provenance import provenance

    t0 = time.monotonic()
    spec = load_spec()
    cfg = config_from_cache_spec(spec)
    bw = copy_bandwidth_bytes_per_s()
    sizes = [int(t) for t in args.tokens.split(",")]
    rows: list[dict] = []
    report = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name(),
        "spec": spec.name,
        "copy_bytes_per_s": bw,
        "rows": rows,
    }
    kinds = {"site": site_rows, "w8a8": w8a8_rows, "moe": moe_rows}
    names = [k for k in args.kernels.split(",") if k]
    for i, name in enumerate(names):  # each kind gets its share of what is left
        left = args.budget_s - (time.monotonic() - t0)
        kinds[name](cfg, sizes, bw, rows, time.monotonic() + left / (len(names) - i))
        write_report(report, args.out, "sweep_decode_tiles.json")
    site_kinds = ("site_fp8", "expand_site")  # other forms: the same bound, not the same bits
    best: dict[tuple, dict] = {}
    for r in rows:
        if "ms" in r and (
            r["kernel"] in site_kinds or r["bit_identical"] or not r.get("same_block_m", True)
        ):
            key = (r["kernel"], r["shape"], r["tokens"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    report["best"] = list(best.values())
    print(f"{'kernel':>18} {'shape':>12} {'tok':>4} {'ms':>8} {'speedup':>7} {'of_floor':>8}  best")
    for (kind, shape, tok), r in best.items():
        print(
            f"{kind:>18} {shape:>12} {tok:>4} {r['ms']:>8.4f} {r.get('speedup', 1.0):>7.2f} "
            f"{r['of_floor']:>8.4f}  {r['config']} same={r['bit_identical']} "
            f"diff={r['max_abs_diff']:.2g}"
        )
    bad = [
        r
        for r in rows
        if r["kernel"] not in site_kinds
        and "ms" in r
        and not r["bit_identical"]
        and r.get("same_block_m", True)
    ]
    for r in bad:
        print(f"NOT bit-identical: {r['kernel']} {r['shape']} {r['tokens']} {r['config']}")
    write_report(report, args.out, "sweep_decode_tiles.json")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
