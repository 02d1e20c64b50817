"""Custom ops (``torch.library``) for the Triton kernels that compiled regions call.

``torch.compile`` sees each as one opaque node with a fake (meta) implementation for its shapes,
so a region that calls it traces whole and stays capturable. Registered once, on first use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_REGISTERED = False
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
"""Whether this torch has ``mm(..., out_dtype=)`` (bf16 operands, fp32 result, on CUDA)."""


def register() -> None:
    """Register ``v41plan::w8a8_linear``, ``v41plan::w8a16_grouped``, ``v41plan::moe_router``
    and ``v41plan::head_logits`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return

    @torch.library.custom_op("v41plan::w8a8_linear", mutates_args=())
    def w8a8_linear(
        x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype,
        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, head_dim: int = 0,
        x_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        from v41plan.runtime.kernels.triton_gemm import w8a8_linear as kernel

        rope = None if cos is None or sin is None else (cos, sin, head_dim)
        return kernel(x, w_codes, w_scales, out_dtype, x_scales, rope=rope)

    @w8a8_linear.register_fake
    def _(x, w_codes, w_scales, out_dtype, cos=None, sin=None, head_dim=0, x_scales=None):
        return x.new_empty((x.shape[0], w_codes.shape[0]), dtype=out_dtype)

    @torch.library.custom_op("v41plan::w8a16_grouped", mutates_args=())
    def w8a16_grouped(
        x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        from v41plan.runtime.kernels.triton_gemm import w8a16_grouped as kernel

        return kernel(x, w_codes, w_scales, out_dtype)

    @w8a16_grouped.register_fake
    def _(x, w_codes, w_scales, out_dtype):
        return x.new_empty((x.shape[1], w_codes.shape[0]), dtype=out_dtype)

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

    @torch.library.custom_op("v41plan::head_logits", mutates_args=())
    def head_logits_op(x: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        global _MM_OUT_DTYPE
        if x.is_cuda and _MM_OUT_DTYPE:
            try:
                return torch.mm(x, head_w.t(), out_dtype=torch.float32)
            except (RuntimeError, NotImplementedError):  # a build without it: once, eagerly
                _MM_OUT_DTYPE = False
        return F.linear(x.float(), head_w.float())

    @head_logits_op.register_fake
    def _(x, head_w):
        return x.new_empty((x.shape[0], head_w.shape[0]), dtype=torch.float32)

    _REGISTERED = True


def w8a8_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    head_dim: int = 0,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``triton_gemm.w8a8_linear`` through the custom op (what a compiled region calls); ``x``
    ``[M, K]`` or ``[M, G, K/G]``, with the RoPE epilogue when ``cos``/``sin`` are given; with
    ``x_scales`` (E8M0 ``[M, K/32]``), ``x`` holds E4M3 codes already quantized."""
    register()
    return torch.ops.v41plan.w8a8_linear(
        x, w_codes, w_scales, out_dtype, cos, sin, head_dim, x_scales
    )


def w8a16_grouped(
    x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``triton_gemm.w8a16_grouped`` through the custom op (what a compiled region calls)."""
    register()
    return torch.ops.v41plan.w8a16_grouped(x, w_codes, w_scales, out_dtype)


def moe_router(
    x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, k: int, norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``triton_router.moe_router`` through the custom op (what a compiled region calls)."""
    register()
    return torch.ops.v41plan.moe_router(x, gate_w, gate_bias, k, norm, scale)


def head_logits(x: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
    """Logits ``x @ head_w^T`` over the last dim of ``x`` (float32 from a bf16 head).

    The published head runs in float32; with bf16 rows and the head's published bf16 weight
    every product is exact in float32, so one bf16 GEMM accumulating in float32 (``mm`` with
    ``out_dtype``, through a custom op) is that head up to summation order, reading half the
    bytes. A head held in the accumulation dtype (the reference; float64 in the parity tests)
    is ``F.linear`` in it."""
    if head_w.dtype != torch.bfloat16:
        return F.linear(x.to(head_w.dtype), head_w)
    if x.dtype != torch.bfloat16:
        return F.linear(x, head_w.to(x.dtype))
    register()
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.v41plan.head_logits(rows, head_w).reshape(*x.shape[:-1], head_w.shape[0])
