"""Torch compositions of the dense per-layer pieces the fused kernels replace.

The runtime computes, at each mHC site (attention or FFN) of a layer, the site's mix prediction
from the streams entering it and the sublayer input collapsed with the *previous* site's
pre-mix (``paged_model._layer``: the attention site collapses with the carried ``pre``, the FFN
site with the attention site's ``pre``), then expands the sublayer output back into the
streams. ``v41plan.runtime.kernels.triton_dense`` has the same functions, with the same call
shapes, as one kernel each; these are the reference (and the CPU implementation) they are
tested against.
"""

from __future__ import annotations

import torch

from v41plan.model import quant as Q
from v41plan.model.layers import (
    HcParams,
    apply_rope,
    hc_collapse,
    hc_expand,
    hc_predict,
    rms_norm,
)

__all__ = [
    "TorchDense",
    "codes_in_parallel",
    "fake_fp8",
    "fp8_act_quant",
    "hc_expand",
    "inverse_rope_groups",
    "mhc_expand_site",
    "mhc_expand_site_fp8",
    "mhc_site",
    "mhc_site_fp8",
    "norm_rope_fp8",
    "rope_wo_a",
]

fake_fp8 = Q.fake_fp8


def norm_rope_fp8(
    y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The window-KV epilogue of rows ``y [N, D]`` (``Attention.window_kv`` after ``wkv``):
    RMSNorm, RoPE on the last ``2 * cos.shape[-1]`` lanes, FP8 E4M3 per 32 lanes."""
    return Q.fake_fp8(apply_rope(rms_norm(y, weight, eps), cos, sin), 32)


def inverse_rope_groups(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int
) -> torch.Tensor:
    """The output projection's inverse RoPE of ``o [N, H, D]`` at the query positions, laid out
    as ``[groups, N, H * D / groups]`` for the grouped ``wo_a`` product (``torch.bmm``)."""
    o = apply_rope(o, cos, sin, inverse=True)
    return o.reshape(o.shape[0], groups, -1).transpose(0, 1).contiguous()


def rope_wo_a(
    o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int
) -> torch.Tensor:
    """The output projection before ``wo_b`` (``Attention.output_local``): the inverse RoPE of
    ``o [N, H, D]`` at the query positions, then the grouped ``wo_a [groups * r, H*D/groups]``
    product ``[N, groups * r]``."""
    o = apply_rope(o, cos, sin, inverse=True)
    n = o.shape[0]
    z = torch.einsum(
        "ngk,grk->ngr",
        o.reshape(n, groups, -1),
        wo_a.reshape(groups, -1, o.shape[1] * o.shape[2] // groups),
    )
    return z.reshape(n, -1)


def fp8_act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 activation format of ``x [..., K]``: E4M3 codes (``float8_e4m3fn [..., K]``)
    and pow2 float32 scales ``[..., K/block]``, so that ``codes * scales == fake_fp8(x)``.

    A storage format, not a fake quantizer: it quantizes whatever ``set_fake_quant`` says.
    """
    codes, scales = Q.quantize_fp8_blocks(x, block)
    return codes, Q.e8m0_decode(scales)


def mhc_site(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site over streams ``X [N, hc, D]``: ``(pre, post, C)`` of ``hc_predict`` and the
    sublayer input ``x = rms_norm(hc_collapse(X, pre_in), norm_weight, norm_eps)`` ``[N, D]``
    (``pre_in [N, hc]``: the pre-mix the previous site predicted)."""
    pre, post, C = hc_predict(X, p, hc, iters, hc_eps, norm_eps)
    x = rms_norm(hc_collapse(X, pre_in), norm_weight, norm_eps)
    return pre, post, C, x


def mhc_site_fp8(
    X: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    block: int = 32,
    e8m0: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``mhc_site`` plus ``fp8_act_quant(x)``: ``(pre, post, C, x, codes, scales)``
    (``e8m0``: the scales as E8M0 bytes, the W8A8 GEMM's input format)."""
    pre, post, C, x = mhc_site(X, pre_in, p, norm_weight, hc, iters, hc_eps, norm_eps)
    return (pre, post, C, x, *_codes(x, block, e8m0))


def _codes(x: torch.Tensor, block: int, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_act_quant(x, block)``, its scales as E8M0 bytes where ``e8m0``."""
    codes, scales = fp8_act_quant(x, block)
    return codes, Q.e8m0_encode(scales) if e8m0 else scales


def mhc_expand_site(
    y: torch.Tensor,
    X: torch.Tensor,
    post_prev: torch.Tensor,
    C_prev: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, ...]:
    """The previous sublayer's expand followed by the next site, on the same rows:
    ``X2 = hc_expand(y, X, post_prev, C_prev)``, then ``(X2, *mhc_site(X2, ...))``."""
    X2 = hc_expand(y, X, post_prev, C_prev)
    return (X2, *mhc_site(X2, pre_in, p, norm_weight, hc, iters, hc_eps, norm_eps))


def mhc_expand_site_fp8(
    y: torch.Tensor,
    X: torch.Tensor,
    post_prev: torch.Tensor,
    C_prev: torch.Tensor,
    pre_in: torch.Tensor,
    p: HcParams,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    block: int = 32,
    e8m0: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``mhc_expand_site`` plus ``fp8_act_quant(x)``: ``(X2, pre, post, C, x, codes, scales)``
    (the FFN site: its ``x`` feeds the W8A8 experts; ``e8m0`` as in ``mhc_site_fp8``)."""
    out = mhc_expand_site(
        y, X, post_prev, C_prev, pre_in, p, norm_weight, hc, iters, hc_eps, norm_eps
    )
    return (*out, *_codes(out[4], block, e8m0))


def codes_in_parallel(N: int, D: int) -> bool:
    """``triton_dense.codes_in_parallel``'s question for the torch compositions: never (their
    quantizer runs as launches of its own, so a site's codes save none)."""
    return False


class TorchDense:
    """The dense pieces as one object (``triton_dense.TritonDense`` has the same functions)."""

    name = "torch"
    fp8_act_quant = staticmethod(fp8_act_quant)
    fake_fp8 = staticmethod(fake_fp8)
    norm_rope_fp8 = staticmethod(norm_rope_fp8)
    inverse_rope_groups = staticmethod(inverse_rope_groups)
    rope_wo_a = staticmethod(rope_wo_a)
    hc_expand = staticmethod(hc_expand)
    mhc_site = staticmethod(mhc_site)
    mhc_site_fp8 = staticmethod(mhc_site_fp8)
    mhc_expand_site = staticmethod(mhc_expand_site)
    mhc_expand_site_fp8 = staticmethod(mhc_expand_site_fp8)
    codes_in_parallel = staticmethod(codes_in_parallel)
