"""Every module global a Triton kernel reads is a ``tl.constexpr``, a kernel or a module.

The interpreter (``TRITON_INTERPRET=1``) reads plain Python globals happily; the compiler refuses
them (``NameError: Cannot access global variable ...``), so only the GPU would catch one."""

from __future__ import annotations

import importlib
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.jit import KernelInterface

MODULES = (
    "triton_attention",
    "triton_common",
    "triton_dense",
    "triton_gemm",
    "triton_moe",
    "triton_quant",
    "triton_scatter",
    "triton_scorer",
)


def _is_kernel(obj: object) -> bool:
    # under the interpreter ``triton.jit`` gives an InterpretedFunction, which is no JITFunction
    return isinstance(obj, KernelInterface) and hasattr(obj, "fn")


def _plain_globals(kernel: KernelInterface) -> list[str]:
    fn = kernel.fn
    bad = []
    for name in fn.__code__.co_names:
        if name not in fn.__globals__:
            continue  # an attribute name or a builtin
        value = fn.__globals__[name]
        if (
            isinstance(value, (types.ModuleType, tl.constexpr))
            or _is_kernel(value)
            or callable(value)
        ):
            continue
        bad.append(f"{name} ({type(value).__name__})")
    return bad


@pytest.mark.parametrize("module", MODULES)
def test_kernels_read_only_constexpr_globals(module):
    mod = importlib.import_module(f"v41plan.runtime.kernels.{module}")
    kernels = {n: k for n, k in vars(mod).items() if _is_kernel(k)}
    assert kernels, f"{module} defines no kernels"
    bad = {n: b for n, k in kernels.items() if (b := _plain_globals(k))}
    assert not bad, f"{module}: kernels read non-constexpr globals {bad}"
