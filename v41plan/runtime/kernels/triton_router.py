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

Larger gates (``E * D`` over ``SPLIT_GATE_ELEMS``) split the GEMV over ``D`` first: ``S``
programs a row each stream a ``D / S`` slice of the gate (one ``ROUTER_TILE_ELEMS`` tile a step)
and store their partial scores; a second launch sums a row's ``S`` partials in split order and
selects. One program streaming a 640 KB gate (V4.1-Flash widths at 32 experts) is bound by one
SM's load latency, about 17 us a call. ``S`` depends on ``E`` and ``D`` only, so a row's scores
are the same at every batch size and chunking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import next_pow2, pdl_enter, pdl_launch

SPLIT_GATE_ELEMS = 1 << 16
"""Gate elements above which the GEMV runs as its own launch over ``D`` slices (medium's 48 x
1024 gate stays one kernel; V4.1-Flash's splits)."""
ROUTER_TILE_ELEMS = 1 << 14
"""Gate elements one step of a router program loads."""
MAX_GATE_SPLITS = 16
"""Most ``D`` slices of a row's split GEMV (bounds the partials: ``[N, S, E]`` float32)."""


def gate_splits(e: int, d: int) -> tuple[int, int, int]:
    """``(splits, lanes a split covers, lanes a step)`` of the split GEMV over ``e`` experts
    and ``d`` lanes: one ``ROUTER_TILE_ELEMS`` tile a step, a step or more a split."""
    block_d = max(16, min(next_pow2(d), ROUTER_TILE_ELEMS // next_pow2(e)))
    steps = triton.cdiv(d, block_d)
    per = triton.cdiv(steps, min(MAX_GATE_SPLITS, steps))
    return triton.cdiv(steps, per), per * block_d, block_d


@triton.jit
def _log1p(x):
    u = 1.0 + x
    small = u == 1.0
    d = tl.where(small, 1.0, u - 1.0)
    return tl.where(small, x, tl.log(u) * (x / d))


@triton.jit
def _scores_row(
    x_ptr, w_ptr, row, offs_e, mask_e, D: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr, LO=0, LANES: tl.constexpr = -1,
):  # fmt: skip
    """Float32 scores ``x[row] @ w[offs_e]^T`` of one row over the experts ``offs_e`` (lanes
    ``[LO, LO + LANES)`` when ``LANES`` is given, else all ``D``)."""
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    SPAN: tl.constexpr = D if LANES < 0 else LANES
    for d0 in range(0, SPAN, BLOCK_D):
        offs_d = LO + d0 + tl.arange(0, BLOCK_D)
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
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    s = _scores_row(x_ptr, w_ptr, row, offs_e, mask_e, D, BLOCK_E, BLOCK_D)
    _select(s, bias_ptr, ids_ptr, wts_ptr, row, offs_e, mask_e, scale, K, K_PAD, NORM)


@triton.jit
def _gate_part_kernel(
    x_ptr, w_ptr, part_ptr, E: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    LANES: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Partial scores of row ``program_id(0)`` over lanes ``[s * LANES, (s + 1) * LANES)``,
    ``s = program_id(1)``, into ``part [N, S, BLOCK_E]``."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    sp = tl.program_id(1)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    s = _scores_row(x_ptr, w_ptr, row, offs_e, mask_e, D, BLOCK_E, BLOCK_D, sp * LANES, LANES)
    tl.store(part_ptr + (row * S + sp) * BLOCK_E + offs_e, s)


@triton.jit
def _select_kernel(
    part_ptr, bias_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr, S: tl.constexpr,
    S_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """A row's ``S`` partial scores summed (one fixed tree), then ``_select``."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    sp = tl.arange(0, S_PAD)
    parts = tl.load(
        part_ptr + (row * S + sp[:, None]) * BLOCK_E + offs_e[None, :],
        mask=(sp < S)[:, None],
        other=0.0,
    )
    s = tl.sum(parts, axis=0)
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
            **pdl_launch(x.device, n),
        )  # fmt: skip
        return ids, wts
    splits, lanes, block_d = gate_splits(e, d)
    part = torch.empty(n, splits, block_e, dtype=torch.float32, device=x.device)
    _gate_part_kernel[(n, splits)](
        x, gate_w, part, E=e, D=d, S=splits, LANES=lanes, BLOCK_E=block_e, BLOCK_D=block_d,
        num_warps=8, **pdl_launch(x.device, n),
    )  # fmt: skip
    _select_kernel[(n,)](
        part, gate_bias, ids, wts, float(scale), E=e, S=splits, S_PAD=next_pow2(splits),
        K=k, K_PAD=kp, NORM=bool(norm), BLOCK_E=block_e, **pdl_launch(x.device, n),
    )  # fmt: skip
    return ids, wts
