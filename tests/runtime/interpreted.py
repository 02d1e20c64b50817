"""A module fixture for tests that run Triton kernels under the CPU interpreter
(``TRITON_INTERPRET=1``): the runtime's interpreter patches (``triton_common.patch_interpreter``:
loop bounds read on the device, and four of the interpreter's per-operation costs) while the
module's tests run. Without the interpreter (a CUDA machine) it does nothing."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="module")
def patched_interpreter():
    """``patch_interpreter`` for the module; its launch-scope patch put back after it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    from v41plan.runtime.kernels import triton_common

    real = triton_common.patch_interpreter()
    yield
    interpreter._patch_lang = real
