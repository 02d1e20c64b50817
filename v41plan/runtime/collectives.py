"""Tensor-parallel collectives of the paged runtime: the rank's group and the reduced scorer.

``TPGroup.all_reduce`` is the one collective the model uses (after ``wo_b``, after the MoE, and
on the partial index scores before any top-k); ``tp_score_topk`` / ``tp_score_candidates_topk``
split the backend's scorer into partial scores, all-reduce, then select, so every rank selects
the same rows. Weight slicing and the refusals live in ``v41plan.model.sharding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from v41plan.model.sharding import TPConfigError


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group, and the one collective the model uses."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The ``torch.distributed`` process group (None: the default group, or no group at size 1)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group and return the sum (in place for a contiguous ``x``); at size 1
        it returns ``x`` itself.

        A plain ``all_reduce`` on a tensor: no host sync and no data-dependent shape, so it
        can be captured. Every rank receives the identical reduced tensor.
        """
        if self.size == 1:
            return x
        import torch.distributed as dist

        if not x.is_contiguous():
            x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[size, *x.shape]`` of every rank's ``x`` (tests and checks; ``x`` itself at size 1)."""
        if self.size == 1:
            return x[None]
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)


SINGLE = TPGroup()
"""The world-size-1 group (every collective a no-op)."""


def tp_group(size: int, device: str | None = None) -> TPGroup:
    """The group for ``tensor_parallel_size = size``: joins the launched process group (gloo on
    CPU, NCCL on GPU) and checks the world size; size 1 needs no launcher."""
    if size == 1:
        return SINGLE
    from v41plan.runtime.dist import init_distributed

    info = init_distributed(device)
    if info.world_size != size:
        raise TPConfigError(
            f"tensor_parallel_size={size} must equal the launched world size ({info.world_size}); "
            f"launch with torchrun --nproc_per_node={size}"
        )
    return TPGroup(info.rank, size, None)


def tp_score_topk(
    kb: Any,
    tp: TPGroup,
    planes: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    weights: torch.Tensor,
    bound: torch.Tensor,
    pages: torch.Tensor,
    topk: int,
    candidates: torch.Tensor | None,
) -> torch.Tensor:
    """``kb.score_topk`` over this rank's index heads: at size > 1 the backend's partial scores
    (``kb.scores``, masked alike on every rank) are all-reduced before the mask and the top-k,
    so every rank selects the same rows."""
    if tp.size == 1:
        return kb.score_topk(planes, q, weights, bound, pages, topk, candidates)
    score = tp.all_reduce(kb.scores(planes, q, weights, bound, pages))
    if candidates is not None:
        score = score.masked_fill(~candidates, float("-inf"))
    return kb.topk_ids(score, topk)


def tp_score_candidates_topk(
    kb: Any,
    tp: TPGroup,
    planes: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    weights: torch.Tensor,
    bound: torch.Tensor,
    pages: torch.Tensor,
    topk: int,
    block_rows: int,
    topk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kb.score_candidates_topk`` over this rank's index heads (reduced scores, as
    ``tp_score_topk``)."""
    if tp.size == 1:
        return kb.score_candidates_topk(
            planes, q, weights, bound, pages, topk, block_rows, topk_blocks
        )
    score = tp.all_reduce(kb.scores(planes, q, weights, bound, pages))
    return kb.topk_ids(score, topk), kb.candidate_blocks(score, bound, block_rows, topk_blocks)
