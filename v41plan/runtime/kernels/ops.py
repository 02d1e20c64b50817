"""Custom ops (``torch.library``) for the Triton kernels that compiled regions call.

``torch.compile`` sees each as one opaque node with a fake (meta) implementation for its shapes,
so a region that calls it traces whole and stays capturable. Registered once, on first use.
"""

from __future__ import annotations

import torch

_REGISTERED = False


def register() -> None:
    """Register ``v41plan::w8a8_linear`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return

    @torch.library.custom_op("v41plan::w8a8_linear", mutates_args=())
    def w8a8_linear(
        x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        from v41plan.runtime.kernels.triton_gemm import w8a8_linear as kernel

        return kernel(x, w_codes, w_scales, out_dtype)

    @w8a8_linear.register_fake
    def _(x, w_codes, w_scales, out_dtype):
        return x.new_empty((x.shape[0], w_codes.shape[0]), dtype=out_dtype)

    _REGISTERED = True


def w8a8_linear(
    x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``triton_gemm.w8a8_linear`` through the custom op (what a compiled region calls)."""
    register()
    return torch.ops.v41plan.w8a8_linear(x, w_codes, w_scales, out_dtype)
