"""The grouped MoE layer on CUDA against the dense references of tests/runtime/test_grouped_moe.py
(a diagnostic): each case three times (determinism), with the W8A8 decode tiles as shipped
and with 64-row tiles for the narrow weights at 17-64 rows (the form taken at 8cbe5c8 and
reverted at eded2c3: its FP8 instruction keeps fewer bits of a block's sum).

    python3 scripts/diag_moe_gpu.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.layers import MoE
from v41plan.runtime.kernels import triton_gemm as tg
from v41plan.runtime.resident import GroupedMoE

LAYER = "layers.3"
SHIPPED = tg.default_config


def narrow_64_rows(M, N, K, dot):
    """The reverted rule: 64-row tiles for narrow weights at 17-64 rows."""
    if 16 < M <= 64 and N <= 2048 and dot == "fp8":
        c = tg.GemmConfig(64, 32, 128, num_warps=4, num_stages=3)
        return dataclasses.replace(c, split_k=tg.split_k_for(N, K, c))
    return SHIPPED(M, N, K, dot)


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def main() -> None:
    cfg = config_from_cache_spec(load_cache_spec("tiny"))
    state = random_state(cfg, 0)
    w64 = LoadedCheckpoint.from_state(cfg, state).process(torch.float64)
    res = LoadedCheckpoint.from_state(cfg, state).process(resident=True)
    dev_res = {k: v.to("cuda") for k, v in res.items() if k.startswith(LAYER + ".ffn.")}
    print("hidden", cfg.hidden_size, "moe inter", cfg.moe_intermediate_size)
    for rule_name, rule in (("shipped", SHIPPED), ("narrow64", narrow_64_rows)):
        tg.default_config = rule
        for n, dtype in ((21, torch.float32), (64, torch.bfloat16), (8, torch.bfloat16)):
            x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
            if dtype == torch.float32:
                w32 = {k: v.float() for k, v in w64.items() if k.startswith(LAYER + ".ffn.")}
                ref, ids = GroupedMoE(cfg, w32, LAYER, torch.float32, impl="torch")(x.float())
            else:
                wbf = {
                    k: v.to(torch.bfloat16) for k, v in w64.items() if k.startswith(LAYER + ".ffn.")
                }
                wbf[LAYER + ".ffn.gate.bias"] = w64[LAYER + ".ffn.gate.bias"]
                ref, ids = MoE(cfg, wbf, LAYER, torch.bfloat16)(x.to(dtype))
            for dot in ("fp32", "bf16"):
                rels = []
                for _ in range(3):
                    m = GroupedMoE(cfg, dev_res, LAYER, dtype, impl="triton", dot=dot)
                    got, gids = m(x.to(dtype).cuda())
                    rels.append(
                        f"{rel(got.cpu(), ref):.2e}{'' if torch.equal(gids.cpu(), ids) else '!ids'}"
                    )
                print(f"{rule_name:8s} n={n:3d} {dtype!s:15s} dot {dot}: {' '.join(rels)}")
    tg.default_config = SHIPPED


if __name__ == "__main__":
    main()
