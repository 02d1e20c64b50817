"""Dependent launches (``triton_common.PDL``) give the bits of ordinary launches under CUDA graphs.

A chain where every kernel reads what the one before wrote (the mHC site, its quantizer, three
W8A8 linears with split-K sums in one launch, the shared expert's gate/up, the expand) is
captured twice, PDL off and on. The input changes before every replay: a kernel that read its
input before the one writing it had ended would read the previous replay's values, so the
outputs would differ from the ordinary launches' for that input. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _chain(D: int, hc: int):
    from v41plan.model.layers import HcParams
    from v41plan.model.quant import quantize_fp8_weight
    from v41plan.runtime.kernels import triton_dense as td
    from v41plan.runtime.kernels.triton_gemm import w8a8_linear, w8a8_swiglu
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    mixes = (2 + hc) * hc

    def w(n, k):
        return quantize_fp8_weight(torch.randn(n, k, generator=g, device="cuda") * k**-0.5)

    p = HcParams(
        torch.randn(mixes, hc * D, generator=g, device="cuda") * 0.02,
        torch.randn(mixes, generator=g, device="cuda"),
        torch.rand(3, generator=g, device="cuda") + 0.5,
    )
    norm = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
    w_a, w_b, w_o = w(384, D), w(2048, 384), w(D, 2048)
    w1, w3, w2 = w(512, D), w(512, D), w(D, 512)

    def run(X, pre):
        pre_o, post, C, x = td.mhc_site(X, pre, p, norm, hc, 20, 1e-6, 1e-20)
        a = w8a8_linear(x, *w_a, torch.bfloat16)
        b = w8a8_linear(a, *w_b, torch.bfloat16)
        o = w8a8_linear(b, *w_o, torch.bfloat16)
        xq, xs = act_quant_fp8(o)
        h, hs = w8a8_swiglu(xq, xs, w1, w3, 10.0, torch.bfloat16)
        y = w8a8_linear(h, *w2, torch.bfloat16, x_scales=hs)
        return td.hc_expand(y, X, post, C), pre_o

    return run


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_dependent_launches_give_the_same_bits(rows, monkeypatch):
    from v41plan.runtime.kernels import triton_common as tc

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launches need sm_90")
    monkeypatch.delenv("V41PLAN_PDL", raising=False)
    D, hc = 1024, 4
    run = _chain(D, hc)
    X = torch.zeros(rows, hc, D, device="cuda", dtype=torch.bfloat16)
    pre = torch.zeros(rows, hc, device="cuda")
    inputs = []
    for i in range(4):
        gi = torch.Generator(device="cuda").manual_seed(100 + i)
        inputs.append(
            (
                torch.randn(rows, hc, D, generator=gi, device="cuda").to(torch.bfloat16),
                torch.rand(rows, hc, generator=gi, device="cuda") + 0.1,
            )
        )
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(tc, "PDL", mode)
        X.copy_(inputs[0][0])
        pre.copy_(inputs[0][1])
        run(X, pre)  # build the kernels of this mode before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(X, pre)
        got = []
        for _ in range(3):  # every input after every other one
            for Xi, pi in inputs:
                X.copy_(Xi)
                pre.copy_(pi)
                graph.replay()
                got.append(tuple(t.clone() for t in out))
        torch.cuda.synchronize()
        results[mode] = got
    for k, (a, b) in enumerate(zip(results["off"], results["on"], strict=True)):
        for ta, tb in zip(a, b, strict=True):
            assert torch.equal(ta, tb), f"replay {k}: PDL on differs from off"
