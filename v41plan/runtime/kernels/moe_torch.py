"""Grouped MoE over the selected experts only: the row permutation and a torch implementation.

Routing gives every token ``k`` (expert, weight) pairs: ``N * k`` rows. ``align_rows`` sorts
them by this rank's local expert on the device (a stable sort, then ``searchsorted`` for the
group bounds) and lays the groups out padded to ``block_m`` rows, so that a grouped GEMM tile
never straddles two experts. Every shape is fixed by ``(N, k, expert_count, block_m)`` alone
(worst case ``N*k + expert_count*(block_m - 1)`` rows): no host sync, no Python loop over
experts, capturable. Rows routed to another rank's experts (whole-expert EP) are left out and
contribute 0 here; under sliced-intermediate TP the expert weights are simply narrower.

``grouped_moe_torch`` runs the routed experts on that layout with torch ops: the bf16 CUDA path
is ``torch._grouped_mm`` (the peer and fallback of the Triton kernel); other dtypes (float64,
the CPU reference) multiply each row by its expert's gathered weights in fixed-size row chunks.
Its arithmetic is ``model.layers.MoE``'s, row by row: ``h = xq @ W^T`` rounded to the compute
dtype, clamped SwiGLU in ``acc`` times the routing weight, rounded, FP8 fake-quantized, ``W2``,
rounded, then summed over the token's rows in ``acc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v41plan.model.layers import acc_dtype
from v41plan.model.quant import fake_fp8

GATHER_CHUNK_BYTES = 64 << 20
"""Largest gathered weight block of the row-gather path (``_gathered_mm``)."""


@dataclass(frozen=True)
class MoERows:
    """The ``N * k`` routed rows permuted by local expert, padded per expert to ``block_m``."""

    row_ids: torch.Tensor
    """``[R]`` int64: the flat row ``token * k + slot`` at each padded position, -1 padding."""
    pos: torch.Tensor
    """``[N * k]`` int64: each flat row's padded position, -1 when routed to another rank."""
    group_ends: torch.Tensor
    """``[expert_count]`` int32: cumulative padded row ends per local expert (``offs=``)."""
    block_expert: torch.Tensor
    """``[R / block_m]`` int32: the local expert of each ``block_m`` block, -1 past the last."""
    block_m: int
    """Rows per block (1: unpadded)."""

    @property
    def rows(self) -> int:
        """``R``, the padded row count (fixed by the shapes)."""
        return self.row_ids.shape[0]

    def row_expert(self) -> torch.Tensor:
        """``[R]`` int64: each padded position's local expert, -1 past the last block."""
        return self.block_expert.to(torch.int64).repeat_interleave(self.block_m)


def padded_rows(tokens: int, k: int, expert_count: int, block_m: int) -> int:
    """``R``: the worst-case padded row count of ``align_rows``, a multiple of ``block_m``."""
    r = tokens * k + expert_count * (block_m - 1)
    return -(-r // block_m) * block_m


def align_rows(
    ids: torch.Tensor, expert_first: int, expert_count: int, block_m: int = 1
) -> MoERows:
    """Sort the routed rows ``ids [N, k]`` (global expert ids) by local expert
    ``ids - expert_first`` in ``[0, expert_count)``; ties keep (token, slot) order."""
    n, k = ids.shape
    nk = n * k
    dev = ids.device
    e = ids.reshape(nk).to(torch.int64) - expert_first
    local = (e >= 0) & (e < expert_count)
    key = torch.where(local, e, torch.full_like(e, expert_count))  # others: one group past all
    skey, order = torch.sort(key, stable=True)
    starts = torch.searchsorted(skey, torch.arange(expert_count + 1, device=dev))
    counts = starts[1:] - starts[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    g = skey.clamp(max=expert_count - 1)
    ppos = (ends - padded)[g] + torch.arange(nk, device=dev) - starts[g]
    ppos = torch.where(skey < expert_count, ppos, torch.full_like(ppos, -1))
    R = padded_rows(n, k, expert_count, block_m)
    row_ids = torch.full((R + 1,), -1, dtype=torch.int64, device=dev)
    row_ids.scatter_(0, torch.where(ppos >= 0, ppos, torch.full_like(ppos, R)), order)
    pos = torch.empty(nk, dtype=torch.int64, device=dev).scatter_(0, order, ppos)
    starts_b = torch.arange(R // block_m, device=dev) * block_m
    be = torch.searchsorted(ends, starts_b, right=True)
    be = torch.where(be < expert_count, be, torch.full_like(be, -1)).to(torch.int32)
    return MoERows(row_ids[:R].contiguous(), pos, ends.to(torch.int32), be, block_m)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """True where ``torch._grouped_mm`` serves the row groups: bf16 on CUDA."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _gathered_mm(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """``y[r] = x[r] @ w[expert[r]]^T`` in fixed row chunks (the chunk count depends on the
    shapes alone): any dtype, one bmm per chunk."""
    R = x.shape[0]
    out = torch.empty((R, w.shape[1]), dtype=x.dtype, device=x.device)
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, w[0].numel() * w.element_size()))
    for r in range(0, R, chunk):
        we = w[expert[r : r + chunk].clamp(min=0)]  # [c, out, in]
        out[r : r + chunk] = torch.bmm(we, x[r : r + chunk, :, None])[..., 0]
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, rows: MoERows, impl: str = "auto") -> torch.Tensor:
    """``[R, out]``: each padded row of ``x [R, in]`` times its expert's ``w [E, out, in]``^T
    (rows past the last group undefined). ``impl``: ``"grouped_mm"`` (``torch._grouped_mm``),
    ``"gather"`` or ``"auto"`` (the first where supported)."""
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_supported(x) else "gather"
    if impl == "grouped_mm":
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=rows.group_ends)
    return _gathered_mm(x, w, rows.row_expert())


def swiglu(h1: torch.Tensor, h3: torch.Tensor, limit: float, acc: torch.dtype) -> torch.Tensor:
    """The clamped SwiGLU in ``acc``: gate clamped from above, up clamped on both sides."""
    return F.silu(h1.to(acc).clamp(max=limit)) * h3.to(acc).clamp(-limit, limit)


def combine_rows(y_rows: torch.Tensor, rows: MoERows, k: int, acc: torch.dtype) -> torch.Tensor:
    """``[N, D]`` in ``acc``: each token's sum of its rows' outputs (0 for rows routed to another
    rank), in slot order."""
    nk = rows.pos.shape[0]
    y = y_rows[rows.pos.clamp(min=0)].to(acc)
    y = torch.where((rows.pos >= 0)[:, None], y, torch.zeros_like(y))
    return y.reshape(nk // k, k, -1).sum(1)


def grouped_moe_torch(
    xq: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    expert_first: int,
    limit: float,
    impl: str = "auto",
    block_m: int = 1,
    quantizer=fake_fp8,
) -> torch.Tensor:
    """The routed experts' sum ``[N, D]`` in ``acc`` over the selected experts only.

    ``xq [N, D]`` the FP8-quantized input in the compute dtype, ``ids``/``weights [N, k]`` the
    routing (global expert ids, final weights), ``w1``/``w3 [El, I, D]`` and ``w2 [El, D, I]``
    this rank's experts ``[expert_first, expert_first + El)`` (``I`` its intermediate slice).
    ``quantizer``: the intermediate's FP8 fake-quantizer (bit-exact with ``quant.fake_fp8``).
    """
    dtype, acc = xq.dtype, acc_dtype(xq.dtype)
    _n, k = ids.shape
    rows = align_rows(ids, expert_first, w1.shape[0], block_m)
    valid = rows.row_ids >= 0
    flat = rows.row_ids.clamp(min=0)
    xs = xq[flat // k]
    h1 = grouped_mm(xs, w1, rows, impl)
    h3 = grouped_mm(xs, w3, rows, impl)
    rw = weights.reshape(-1)[flat].to(acc)
    act = (swiglu(h1, h3, limit, acc) * rw[:, None]).to(dtype)
    act = torch.where(valid[:, None], act, torch.zeros_like(act))  # padding rows: undefined
    y_rows = grouped_mm(quantizer(act, 32), w2, rows, impl)
    return combine_rows(y_rows, rows, k, acc)
