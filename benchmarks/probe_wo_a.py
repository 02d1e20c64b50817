"""The output projection's grouped ``wo_a`` at flash_slice widths (8 groups of 1024 outputs over
4096 lanes): ``triton_gemm.w8a16_grouped`` on the FP8 weight as published against the bf16
``torch.bmm`` over its dequantized values (what the runtime ran before), decode and prefill rows,
a few tiles each, timed by CUDA-graph replay in the same process.

    python3 benchmarks/probe_wo_a.py [--rows 1,16,64,256,512,8192] [--out FILE]

Prints a table and writes JSON (``device``, ``torch``, ``triton``, ``commit``, ``spec``,
``ceilings``, rows with ``ms``, ``floor_ms``, ``of_floor`` (floor / measured), ``peer_ms`` (the
bmm) and ``rel_err`` against a float32 bmm of the same operands). Floors: the FP8 weight, its
scales and the bf16 rows at the copy bandwidth, or the FLOPs at the bf16 rate where larger."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_moe import _fp8_weight, time_ms
from ceilings import bf16_matmul_flop_per_s, copy_bandwidth_bytes_per_s
from report_io import write_report

G, R, KG = 8, 1024, 4096
DECODE_TILES = (
    (16, 32, 128, 4, 4, 8, 2),
    (16, 64, 128, 4, 4, 8, 2),
    (16, 64, 128, 4, 4, 8, 6),
    (32, 64, 128, 4, 4, 8, 3),
    (64, 64, 64, 4, 4, 8, 6),
    (64, 32, 64, 4, 4, 8, 3),
)
PREFILL_TILES = ((128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,512,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from v41plan.model.quant import dequant_fp8_weight
    from v41plan.runtime.kernels import triton_gemm as tg
    from v41plan.validation.provenance import provenance

    bw, rate = copy_bandwidth_bytes_per_s(), bf16_matmul_flop_per_s()
    wc, ws = _fp8_weight(G * R, KG)
    wd = dequant_fp8_weight(wc, ws, torch.bfloat16).view(G, R, KG)
    rows = []
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s")
    for M in (int(r) for r in args.rows.split(",")):
        x = torch.randn(G, M, KG, device="cuda", dtype=torch.bfloat16)
        ref = torch.bmm(x.float(), wd.float().transpose(1, 2)).transpose(0, 1).reshape(M, -1)
        flops = 2 * M * G * R * KG
        fp8_bytes = G * R * KG + (G * R // 32) * (KG // 32) + 2 * M * G * (R + KG)
        floor = max(fp8_bytes / bw, flops / rate) * 1e3
        peer = time_ms(lambda x=x: torch.bmm(x, wd.transpose(1, 2)).transpose(0, 1))[0]
        peer_floor = max((2 * G * R * KG + 2 * M * G * (R + KG)) / bw, flops / rate) * 1e3
        tiles = [None] + [tg.GemmConfig(*t) for t in (DECODE_TILES if M <= 64 else PREFILL_TILES)]
        for cfg in tiles:
            row = {"rows": M, "tile": "default" if cfg is None else list(cfg.__dict__.values())}
            try:
                y = tg.w8a16_grouped(x, wc, ws, config=cfg)
                row["ms"] = time_ms(lambda x=x, cfg=cfg: tg.w8a16_grouped(x, wc, ws, config=cfg))[0]
            except Exception as exc:  # noqa: BLE001 (a tile the device refuses: recorded)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                rows.append(row)
                print(f"M={M:5} {row['tile']}: {row['error']}")
                continue
            row["rel_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
            row.update(floor_ms=floor, of_floor=floor / row["ms"], peer_ms=peer)
            row.update(peer_floor_ms=peer_floor, peer_of_floor=peer_floor / peer)
            if cfg is None:
                row["path"] = "bmm on dequantized" if M >= tg.A16_BMM_ROWS else "w8a16 kernel"
            rows.append(row)
            print(
                f"M={M:5} {row['tile']!s:38} {row['ms'] * 1e3:8.1f} us  of_floor "
                f"{row['of_floor']:.3f}  bmm {peer * 1e3:8.1f} us ({row['peer_of_floor']:.3f})  "
                f"rel_err {row['rel_err']:.1e}"
            )
    report = {
        "device": torch.cuda.get_device_name(),
        "spec": "flash_slice widths (wo_a: 8 groups x 1024 over 4096 lanes)",
        "ceilings": {"copy_bytes_per_s": bw, "bf16_flop_per_s": rate},
        "provenance": provenance(),
        "rows": rows,
    }
    write_report(report, args.out, "probe_wo_a.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
