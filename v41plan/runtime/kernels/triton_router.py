"""The MoE router as one Triton kernel: gate GEMV, sqrtsoftplus, biased top-k, weights.

``moe_router`` computes ``layers.moe_route`` (without forced ids) for every row in one launch,
where the composition is a float32 GEMV (two cuBLAS kernels at one row), a sort and two
gathers (three more). One program per row keeps the ``E`` scores in registers:

- scores ``s = x @ gate_w^T`` in float32 (the gate is float32; ``x`` is read in its dtype and
  widened), accumulated over ``BLOCK_D`` lanes at a time: the products are exact, the sum's
  order is the kernel's own, so a score can differ from cuBLAS's in its last bits;
- ``sqrt(softplus(s))`` with softplus as torch evaluates it (``s`` above 20 passes through,
  else ``log1p(exp(s))``, ``log1p`` by the compensated form ``log(u) * x / (u - 1)``);
- selection of ``k`` ids by the biased scores, ties to the smaller expert id (``k`` passes of
  max then min-index: ``stable_topk_desc``), weights from the unbiased ones, normalised when
  ``norm`` (``norm_topk_prob`` with ``k > 1``) and scaled.

Larger gates (``E * D`` over ``SPLIT_GATE_ELEMS``) split the GEMV over expert blocks first (one
more launch, the scores through global memory) so no single program streams the whole gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import next_pow2

SPLIT_GATE_ELEMS = 1 << 20
"""Gate elements above which the GEMV runs as its own launch over expert blocks."""
ROUTER_TILE_ELEMS = 1 << 14
"""Gate elements one step of the one-kernel router loads."""


@triton.jit
def _log1p(x):
    u = 1.0 + x
    small = u == 1.0
    d = tl.where(small, 1.0, u - 1.0)
    return tl.where(small, x, tl.log(u) * (x / d))


@triton.jit
def _scores_row(
    x_ptr, w_ptr, row, offs_e, mask_e, D: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Float32 scores ``x[row] @ w[offs_e]^T`` of one row over the experts ``offs_e``."""
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xv = tl.load(x_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        wv = tl.load(
            w_ptr + offs_e[:, None] * D + offs_d[None, :],
            mask=mask_e[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc += wv * xv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _select(
    s, bias_ptr, ids_ptr, wts_ptr, row, offs_e, mask_e, scale,
    K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """sqrtsoftplus, the biased top-``K`` (ties: smaller id) and the weights of one row."""
    sp = tl.sqrt(tl.where(s > 20.0, s, _log1p(tl.exp(s))))
    bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
    v = tl.where(mask_e, sp + bias, float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    wts = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        m = tl.max(v, axis=0)
        pick = tl.min(tl.where(v == m, offs_e, 1 << 30), axis=0)
        hit = offs_e == pick
        w = tl.sum(tl.where(hit, sp, 0.0), axis=0)
        ids = tl.where(offs_k == j, pick.to(tl.int64), ids)
        wts = tl.where(offs_k == j, w, wts)
        v = tl.where(hit, float("-inf"), v)
    if NORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    mask_k = offs_k < K
    tl.store(ids_ptr + row * K + offs_k, ids, mask=mask_k)
    tl.store(wts_ptr + row * K + offs_k, wts * scale, mask=mask_k)


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, bias_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr, D: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    s = _scores_row(x_ptr, w_ptr, row, offs_e, mask_e, D, BLOCK_E, BLOCK_D)
    _select(s, bias_ptr, ids_ptr, wts_ptr, row, offs_e, mask_e, scale, K, K_PAD, NORM)


@triton.jit
def _gate_kernel(
    x_ptr, w_ptr, s_ptr, E: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    s = _scores_row(x_ptr, w_ptr, row, offs_e, mask_e, D, BLOCK_E, BLOCK_D)
    tl.store(s_ptr + row * E + offs_e, s, mask=mask_e)


@triton.jit
def _select_kernel(
    s_ptr, bias_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    s = tl.load(s_ptr + row * E + offs_e, mask=mask_e, other=0.0)
    _select(s, bias_ptr, ids_ptr, wts_ptr, row, offs_e, mask_e, scale, K, K_PAD, NORM)


def moe_router(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    gate_bias: torch.Tensor,
    k: int,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids ``[N, k]`` int64, weights ``[N, k]`` float32) of ``layers.moe_route`` for rows
    ``x [N, D]`` (any float dtype), ``gate_w [E, D]`` and ``gate_bias [E]`` float32; ``norm``
    is ``norm_topk_prob and k > 1``, ``scale`` the routed scaling factor."""
    n, d = x.shape
    e = gate_w.shape[0]
    if gate_w.dtype != torch.float32 or gate_bias.dtype != torch.float32:
        raise ValueError("moe_router takes a float32 gate and bias")
    if not 1 <= k <= e:
        raise ValueError(f"moe_router: k={k} outside [1, {e}] experts")
    x, gate_w, gate_bias = x.contiguous(), gate_w.contiguous(), gate_bias.contiguous()
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    wts = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n == 0:
        return ids, wts
    block_e = next_pow2(e)
    kp = next_pow2(k)
    if e * d <= SPLIT_GATE_ELEMS:
        # a 16K-element tile a step over eight warps: the loads of a step are in flight
        # together (a one-row GEMV is latency-bound, not bandwidth-bound, in one program)
        block_d = max(16, min(next_pow2(d), ROUTER_TILE_ELEMS // block_e))
        _router_kernel[(n,)](
            x, gate_w, gate_bias, ids, wts, float(scale), E=e, D=d,
            K=k, K_PAD=kp, NORM=bool(norm), BLOCK_E=block_e, BLOCK_D=block_d, num_warps=8,
        )  # fmt: skip
        return ids, wts
    scores = torch.empty(n, e, dtype=torch.float32, device=x.device)
    be = min(block_e, 32)
    _gate_kernel[(n, triton.cdiv(e, be))](x, gate_w, scores, E=e, D=d, BLOCK_E=be, BLOCK_D=128)
    _select_kernel[(n,)](
        scores, gate_bias, ids, wts, float(scale), E=e,
        K=k, K_PAD=kp, NORM=bool(norm), BLOCK_E=block_e,
    )  # fmt: skip
    return ids, wts
