"""Programmatic dependent launch: when launches ask for it, and the gate every such kernel
passes first (``triton_common.pdl_enter``).

A kernel launched with ``launch_pdl`` may start while the kernel before it runs. Its programs
must wait (``gdc_wait``) before they touch anything another kernel writes or reads, and every
program must wait, or a later kernel's wait would not cover the grid before it. The first test
checks that shape on every kernel that takes ``PDL``; the GPU side (the same bits with PDL on
and off under CUDA graphs) is ``tests/gpu/test_pdl_gpu.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

from v41plan.runtime.kernels import triton_common

MODULES = tuple(
    importlib.import_module(f"v41plan.runtime.kernels.{name}")
    for name in (
        "triton_attention", "triton_dense", "triton_gemm", "triton_moe", "triton_quant",
        "triton_router", "triton_scorer",
    )
)  # fmt: skip
"""The kernel modules whose kernels may launch as dependent ones."""


def _pdl_kernels() -> dict:
    """Every kernel of ``MODULES`` that takes ``PDL`` (JIT or interpreted): its Python function."""
    return {
        f"{mod.__name__.rsplit('.', 1)[1]}.{name}": obj.fn
        for mod in MODULES
        for name, obj in vars(mod).items()
        if "PDL" in getattr(obj, "arg_names", ())
        and getattr(getattr(obj, "fn", None), "__module__", None) == mod.__name__
    }


def test_every_pdl_kernel_enters_the_gate_first():
    kernels = _pdl_kernels()
    # the decode step's Triton kernels, at least these
    for want in (
        "triton_gemm._w8a8_kernel",
        "triton_gemm._w8a8_swiglu_kernel",
        "triton_quant._act_quant_kernel",
        "triton_moe._gate_up_kernel",
        "triton_moe._down_kernel",
        "triton_dense._mhc_site_part_kernel",
        "triton_attention.sparse_attention_kernel",
        "triton_scorer.score_kernel",
        "triton_router._gate_part_kernel",
    ):
        assert want in kernels, f"{want} takes no PDL"
    for name, fn in kernels.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = body[0]
        ok = (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", None) == "pdl_enter"
            and [getattr(a, "id", None) for a in first.value.args] == ["PDL"]
        )
        assert ok, f"{name}: the first statement is not pdl_enter(PDL)"
        default = inspect.signature(fn).parameters["PDL"].default
        assert default is False, f"{name}: PDL defaults to {default!r}, not off"


class _Dev:
    type = "cuda"


def test_pdl_launch_rules(monkeypatch):
    monkeypatch.delenv("V41PLAN_PDL", raising=False)
    assert triton_common.pdl_mode(torch.device("cpu")) == "off"
    assert triton_common.pdl_launch(torch.device("cpu"), 1) == {}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    on = {"PDL": True, "launch_pdl": True}
    assert triton_common.pdl_launch(_Dev(), 1) == ({} if triton_common.PDL == "off" else on)
    monkeypatch.setattr(triton_common, "PDL", "on")
    assert triton_common.pdl_launch(_Dev(), 1) == on
    assert triton_common.pdl_launch(_Dev(), triton_common.PDL_MAX_ROWS) == on
    assert triton_common.pdl_launch(_Dev(), triton_common.PDL_MAX_ROWS + 1) == {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert triton_common.pdl_launch(_Dev(), 1) == {}  # no griddepcontrol before sm_90
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setenv("V41PLAN_PDL", "off")
    assert triton_common.pdl_launch(_Dev(), 1) == {}
    monkeypatch.setattr(triton_common, "PDL", "off")
    monkeypatch.setenv("V41PLAN_PDL", "on")
    assert triton_common.pdl_launch(_Dev(), 1) == on  # the environment wins over the default
    monkeypatch.setenv("V41PLAN_PDL", "yes")
    with pytest.raises(ValueError, match="V41PLAN_PDL"):
        triton_common.pdl_launch(_Dev(), 1)
