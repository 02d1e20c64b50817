"""The W8A8 linear and the FP8 activation quantizer in Triton, against the torch reference.

Without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here
before the kernel modules are imported) with float32 dot operands; with CUDA the same tests
run compiled on the device in every dot mode.

The bound under test (``triton_gemm``'s docstring): every product of the dequantized operands
is exact in float32, so ``|y - y*| <= K * 2**-24 * P + u_out * |y*|`` with ``y*`` the exact
(float64) product of ``fake_fp8(x, 32)`` and the dequantized weight, ``P = |x̂| @ |ŵ|^T``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from v41plan.model.quant import (
    dequant_fp8_weight,
    e8m0_decode,
    fake_fp8,
    quantize_fp8_blocks,
    quantize_fp8_weight,
)
from v41plan.runtime.kernels.triton_gemm import GemmConfig, w8a8_linear
from v41plan.runtime.kernels.triton_quant import act_quant_fp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DOTS = ("fp32", "bf16", "fp8") if DEV == "cuda" else ("fp32",)
U_ACC = {"fp32": 2.0**-24, "bf16": 2.0**-24, "fp8": 2.0**-13}
"""Unit roundoff of the accumulation by dot mode (FP8 tensor cores keep fewer bits)."""


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows spanning many binades, with the quantizer's edge cases planted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-5, 3, k)[torch.randperm(k, generator=g)]
    x[0, :32] = 0.0  # an all-zero block: the 1e-4 amax floor
    x[1, :32] = 448.0  # amax exactly 448: scale 1
    x[2, :4] = torch.tensor([-1e-8, -0.0, 3.5e-5, -1e4])  # negatives rounding to -0, a saturator
    return x


def _bound_check(y: torch.Tensor, x: torch.Tensor, wc, ws, dot: str, u_out: float) -> float:
    """Largest ``|y - y*|`` over its bound (must be <= 1)."""
    xd = fake_fp8(x.double(), 32)
    wd = dequant_fp8_weight(wc.cpu(), ws.cpu(), torch.float64)
    exact = xd @ wd.T
    P = xd.abs() @ wd.abs().T
    K = x.shape[1]
    bound = K * U_ACC[dot] * P + u_out * exact.abs() + 1e-300
    return float(((y.double().cpu() - exact).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_is_fake_fp8_bit_for_bit(dtype):
    x = _activations(37, 96, 0).to(dtype)
    q, s = act_quant_fp8(x.to(DEV))
    codes, scales = quantize_fp8_blocks(x)
    assert torch.equal(q.cpu().view(torch.uint8), codes.view(torch.uint8))  # -0 codes too
    assert torch.equal(s.cpu().view(torch.uint8), scales.view(torch.uint8))
    v = q.cpu().float().view(37, 3, 32) * e8m0_decode(s.cpu())[:, :, None]
    assert torch.equal(v.view(37, 96).to(dtype), fake_fp8(x, 32))


@pytest.mark.parametrize("dot", DOTS)
def test_w8a8_equals_the_dequantized_product_within_the_bound(dot):
    # N = 80 leaves a partial 32-row scale block; K = 160 a partial K tile at block_k 128
    M, N, K = 19, 80, 160
    x = _activations(M, K, 1)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:, 64:96] *= 300.0  # one K block with a much larger weight scale
    wc, ws = quantize_fp8_weight(w)
    dev_w = (wc.to(DEV), ws.to(DEV))
    y32 = w8a8_linear(x.to(DEV), *dev_w, torch.float32, dot=dot)
    assert _bound_check(y32, x, wc, ws, dot, 0.0) <= 1.0
    ybf = w8a8_linear(x.to(DEV), *dev_w, torch.bfloat16, dot=dot)
    assert ybf.dtype == torch.bfloat16
    assert _bound_check(ybf, x, wc, ws, dot, 2.0**-8) <= 1.0
    # a different tiling changes only the float32 summation order
    if DEV == "cpu":
        other = GemmConfig(16, 32, 32, num_warps=1, num_stages=1)
        y_tiled = w8a8_linear(x, wc, ws, torch.float32, dot=dot, config=other)
        assert _bound_check(y_tiled, x, wc, ws, dot, 0.0) <= 1.0


def test_prequantized_input_gives_the_fused_result():
    M, N, K = 9, 64, 96
    x = _activations(M, K, 3).to(DEV)
    wc, ws = quantize_fp8_weight(torch.randn(N, K) * 0.1)
    wc, ws = wc.to(DEV), ws.to(DEV)
    xq, xs = act_quant_fp8(x)
    fused = w8a8_linear(x, wc, ws, torch.float32)
    pre = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs)
    assert torch.equal(fused, pre)
    assert w8a8_linear(x[:0], wc, ws, torch.float32).shape == (0, N)


def test_shapes_are_checked():
    wc, ws = quantize_fp8_weight(torch.randn(32, 48))
    with pytest.raises(ValueError, match="w8a8_linear"):
        w8a8_linear(torch.randn(4, 48), wc, ws)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        act_quant_fp8(torch.randn(4, 48))
