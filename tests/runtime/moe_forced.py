"""A forced-decision check of the grouped W4A8 MoE (``triton_moe.grouped_moe_w4a8_stages``).

The kernel's arithmetic is exact up to its dot accumulation, but the intermediate's FP8
rounding (E4M3 lanes, one pow2 scale per 32) is a decision: a lane whose exact value sits within
the accumulation error of a rounding cut may land on either side, and each such flip moves that
lane by a whole E4M3 step (6-12%). Comparing outputs at a tight tolerance then fails for the
wrong reason, and a loose one hides real faults. So, in float64 from the same quantized
operands:

1. every intermediate scale and lane the kernel chose must be the reference rounding of *some*
   value within the stated accumulation bound of the exact one (rounding is monotone, so it
   must lie between the roundings of ``h - tol`` and ``h + tol``);
2. the kernel's own intermediate, taken as forced, must give its ``w2`` rows and the combined
   sum within the accumulation bound.

``acc_rel`` is the dot accumulation's error relative to ``sum |a_i b_i|``: ``K * 2**-24`` for
float32 accumulation, ``2**-11`` for the FP8 tensor cores (their in-block partial sums keep about
14 bits of the block's largest product; the W4A8 ``w2`` GEMM measured up to ``1.59 * 2**-13`` on
an H200, see ``tests/gpu/test_resident_gpu.py::U_MOE_FP8``).
"""

from __future__ import annotations

import torch

from v41plan.model.quant import (
    E4M3_MAX,
    FP8_AMAX_FLOOR,
    QuantWeight,
    dequant_fp8_blocks,
    e8m0_decode,
    pow2ceil,
    round_e4m3,
)

U32 = 2.0**-24
BLOCK = 32


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The reference FP8 block scale of a float64 block amax."""
    return pow2ceil(amax.clamp_min(FP8_AMAX_FLOOR).float() / E4M3_MAX).double()


def forced_decision_report(
    xq: torch.Tensor,
    xs: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: QuantWeight,
    w3: QuantWeight,
    w2: QuantWeight,
    limit: float,
    stages,
    out: torch.Tensor,
    acc_rel: float,
) -> dict:
    """Check ``stages`` (float32 compute dtype, ``expert_first`` 0) and the combined ``out``;
    returns the counts and worst error-to-bound ratios (each ratio must be <= 1)."""
    assert stages.y_rows.dtype == torch.float32, "the check models float32 compute"
    n, k = ids.shape
    xd = dequant_fp8_blocks(xq.cpu(), xs.cpu(), torch.float64)
    w1d, w3d, w2d = (w.dequantize(torch.float64).cpu() for w in (w1, w3, w2))
    pos = stages.rows.pos.cpu().long()
    assert bool((pos >= 0).all()), "every (token, slot) has a row on one rank"
    ex = ids.reshape(-1).cpu().long()
    tok = torch.arange(n * k) // k
    rw = weights.reshape(-1).cpu().double()
    I, D = w1d.shape[1], w2d.shape[1]
    g, u, pg, pu = (torch.zeros(n * k, I, dtype=torch.float64) for _ in range(4))
    for e in ex.unique().tolist():
        m = ex == e
        xr = xd[tok[m]]
        g[m], pg[m] = xr @ w1d[e].T, xr.abs() @ w1d[e].abs().T
        u[m], pu[m] = xr @ w3d[e].T, xr.abs() @ w3d[e].abs().T
    gate, up = g.clamp(max=limit), u.clamp(-limit, limit)
    sg = torch.sigmoid(gate)
    h = gate * sg * up * rw[:, None]
    dsilu = (sg * (1 + gate * (1 - sg))).abs() + 0.5 * acc_rel * pg  # silu'' <= 0.5
    tol = (dsilu * up.abs() * acc_rel * pg + (gate * sg).abs() * acc_rel * pu) * rw[:, None]
    tol = tol + 16 * U32 * h.abs()  # the kernel's float32 SwiGLU (sigmoid within a few ulp)

    # 1. the kernel's decisions: block scales, then lanes under the kernel's own scale
    codes = stages.act.cpu()[pos].view(torch.float8_e4m3fn).double()
    sk = e8m0_decode(stages.act_scales.cpu()[pos]).double()  # [nk, I/32]
    hb, tb = h.view(n * k, -1, BLOCK), tol.view(n * k, -1, BLOCK)
    amax, amax_tol = hb.abs().amax(-1), tb.amax(-1)
    s_lo, s_hi = _scale(amax - amax_tol), _scale(amax + amax_tol)
    bad_scale = (sk < s_lo) | (sk > s_hi)
    flipped_blocks = int((sk != _scale(amax)).sum())
    s = sk[..., None]
    a_k = (codes.view(n * k, -1, BLOCK) * s).view(n * k, I)
    lo = (round_e4m3((hb - tb) / s) * s).view(n * k, I)
    hi = (round_e4m3((hb + tb) / s) * s).view(n * k, I)
    bad_lane = (a_k < lo) | (a_k > hi)
    flipped_lanes = int((a_k != (round_e4m3(hb / s) * s).view(n * k, I)).sum())

    # 2. the kernel's intermediate, forced: its w2 rows and the combined sum
    y_k = stages.y_rows.cpu()[pos].double()
    y_f, py = torch.zeros(n * k, D, dtype=torch.float64), torch.zeros(n * k, D, dtype=torch.float64)
    for e in ex.unique().tolist():
        m = ex == e
        y_f[m], py[m] = a_k[m] @ w2d[e].T, a_k[m].abs() @ w2d[e].abs().T
    y_tol = acc_rel * py + U32 * y_f.abs() + 1e-300
    y_ratio = float(((y_k - y_f).abs() / y_tol).max())
    tot = y_f.view(n, k, D).sum(1)
    out_tol = y_tol.view(n, k, D).sum(1) + k * U32 * y_k.abs().view(n, k, D).sum(1) + 1e-300
    out_ratio = float(((out.cpu().double() - tot).abs() / out_tol).max())
    return {
        "lanes": n * k * I,
        "flipped_lanes": flipped_lanes,
        "flipped_blocks": flipped_blocks,
        "bad_lanes": int(bad_lane.sum()),
        "bad_scales": int(bad_scale.sum()),
        "y_rows error/bound": y_ratio,
        "combined error/bound": out_ratio,
    }


def assert_forced_decisions(report: dict) -> None:
    """Every decision within the bound, every forced output within the bound."""
    assert report["bad_scales"] == 0, report
    assert report["bad_lanes"] == 0, report
    assert report["y_rows error/bound"] <= 1.0, report
    assert report["combined error/bound"] <= 1.0, report
