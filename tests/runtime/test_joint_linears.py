"""``wq_a`` and ``wkv`` as one product (``resident.linear_pair``): one quantizer and one W8A8
launch for two linears of the same input, over one copy of their bytes.

Checked on the CPU: the stacking of codes and scale blocks (``stack_fp8``), the joint product
under Triton's interpreter against the two linears alone (the same products; the sums split
over K by the joint weight's shape, so equal up to float32 summation order), and a paged
prefill and decode whose every layer takes the joint path (``compiled.attn_inputs``) against
the same model without it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest

from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.quant import QuantWeight, dequant_fp8_weight, fake_fp8, quantize_fp8_weight
from v41plan.runtime import resident
from v41plan.runtime.paged_model import RuntimeModel

from .interpreted import patched_interpreter  # noqa: F401 (an autouse fixture)
from .paged_helpers import model, step, token_ids

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _w(n: int, k: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize_fp8_weight(torch.randn(n, k, generator=g) * k**-0.5)
    return QuantWeight(codes, scales, "fp8")


def test_stack_fp8_keeps_every_block():
    a, b = _w(64, 96, 0), _w(40, 96, 1)
    both = resident.stack_fp8(a, b)
    ref = torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)])
    assert torch.equal(both.dequantize(torch.float32), ref)
    assert both.codes.dtype == a.codes.dtype and both.scales.dtype == a.scales.dtype
    # out1 not a whole number of 32-row scale blocks, other widths, other formats: no stack
    assert resident.stack_fp8(_w(40, 96, 0), a) is None
    assert resident.stack_fp8(a, _w(32, 64, 2)) is None
    assert resident.stack_fp8(a, ref) is None


def test_joint_product_of_the_w8a8_kernel():
    """The joint product's halves and the two linears over them (the W8A8 kernel: Triton's
    interpreter on the CPU) are each within the kernel's float32 bound of the dequantized
    product, and the halves' weights are views of the joint weight (no second copy)."""
    w1, w2 = (_w(n, 1024, s).to(DEV) for n, s in ((64, 3), (32, 4)))
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    lin1, lin2, joint = resident.linear_pair(impl="triton")(w1, w2, torch.float32)
    y = joint(x)
    assert y.shape == (3, 96)
    xq = fake_fp8(x.double().cpu(), 32)
    for half, w, got in ((lin1, w1, y[:, :64]), (lin2, w2, y[:, 64:])):
        wd = dequant_fp8_weight(w.codes.cpu(), w.scales.cpu(), torch.float64)
        ref = xq @ wd.T
        bound = 1024 * 2.0**-24 * (xq.abs() @ wd.abs().T) * 1.01
        assert ((got.double().cpu() - ref).abs() <= bound).all()
        assert ((half(x).double().cpu() - ref).abs() <= bound).all()
        store = joint.weight.codes.untyped_storage().data_ptr()
        assert half.weight.codes.untyped_storage().data_ptr() == store


def _run(monkeypatch, joined: bool, compile_backend: str | None = None):
    spec, cfg, _w64, eng = model("tiny")
    real = resident.linear_pair
    if joined:  # the joint product on the CPU's torch path (CUDA's is the Triton GEMM)
        monkeypatch.setattr(resident, "linear_pair", lambda q: real(q, impl="torch"))
    else:
        monkeypatch.setattr(resident, "linear_pair", lambda q: lambda *a: None)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    w = ckpt.process(torch.float64, resident=True)
    m = RuntimeModel(
        spec, w, eng, cfg=cfg, dtype=torch.float64, moe="grouped", num_pages=24,
        max_tokens=64, table_width=12, compile_backend=compile_backend,
    )  # fmt: skip
    assert all((a.wqkv_a is not None) == joined for a in m.attn)
    calls = []
    inner = m.pieces.attn_inputs
    m.pieces.attn_inputs = lambda *a: calls.append(1) or inner(*a)
    ids = token_ids(21, 5)
    n = len(ids) - 1
    m.reset_slot(0)
    a = m.forward(step(spec, [(0, range(8), n, 0, n, "prefill", True)]), ids[:n]).logits
    b = m.forward(step(spec, [(0, range(8), n, n, 1, "decode")]), ids[n : n + 1]).logits
    monkeypatch.setattr(resident, "linear_pair", real)
    return a, b, len(calls), len(m.attn)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_paged_steps_take_the_joint_product(monkeypatch, compile_backend):
    """float64: a prefill and a decode step with every layer's ``wq_a``/``wkv`` joined give
    the separate linears' logits (up to float64 summation order) and run ``attn_inputs`` on
    every layer of both steps, eager and as a compiled region."""
    a0, b0, calls0, _ = _run(monkeypatch, False)
    a1, b1, calls1, layers = _run(monkeypatch, True, compile_backend)
    assert calls0 == 0 and calls1 == 2 * layers
    for ref, got in ((a0, a1), (b0, b1)):
        assert np.isfinite(got.numpy()).all()
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)
