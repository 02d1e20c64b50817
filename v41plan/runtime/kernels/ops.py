"""Custom ops (``torch.library``) for the Triton kernels that compiled regions call.

``torch.compile`` sees each as one opaque node with a fake (meta) implementation for its shapes,
so a region that calls it traces whole and stays capturable. Registered once, on first use.
"""

from __future__ import annotations

import torch

_REGISTERED = False


def register() -> None:
    """Register ``v41plan::w8a8_linear`` and ``v41plan::moe_router`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return

    @torch.library.custom_op("v41plan::w8a8_linear", mutates_args=())
    def w8a8_linear(
        x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype,
        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, head_dim: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        from v41plan.runtime.kernels.triton_gemm import w8a8_linear as kernel

        rope = None if cos is None or sin is None else (cos, sin, head_dim)
        return kernel(x, w_codes, w_scales, out_dtype, rope=rope)

    @w8a8_linear.register_fake
    def _(x, w_codes, w_scales, out_dtype, cos=None, sin=None, head_dim=0):
        return x.new_empty((x.shape[0], w_codes.shape[0]), dtype=out_dtype)

    @torch.library.custom_op("v41plan::moe_router", mutates_args=())
    def moe_router(
        x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, k: int, norm: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        from v41plan.runtime.kernels.triton_router import moe_router as kernel

        return kernel(x, gate_w, gate_bias, k, norm, scale)

    @moe_router.register_fake
    def _(x, gate_w, gate_bias, k, norm, scale):
        n = x.shape[0]
        return x.new_empty((n, k), dtype=torch.int64), x.new_empty((n, k), dtype=torch.float32)

    _REGISTERED = True


def w8a8_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    head_dim: int = 0,
) -> torch.Tensor:
    """``triton_gemm.w8a8_linear`` through the custom op (what a compiled region calls); ``x``
    ``[M, K]`` or ``[M, G, K/G]``, with the RoPE epilogue when ``cos``/``sin`` are given."""
    register()
    return torch.ops.v41plan.w8a8_linear(x, w_codes, w_scales, out_dtype, cos, sin, head_dim)


def moe_router(
    x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, k: int, norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``triton_router.moe_router`` through the custom op (what a compiled region calls)."""
    register()
    return torch.ops.v41plan.moe_router(x, gate_w, gate_bias, k, norm, scale)
