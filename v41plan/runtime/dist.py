"""torchrun plumbing: rank/world from the environment, gloo on CPU, NCCL on GPU.

Every rank builds the same engine and drives an identical deterministic schedule; only rank 0
prints and writes (``is_main``). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the launch."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that prints and writes."""
        return self.rank == 0


def world_info() -> WorldInfo:
    """Read ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (a plain launch is rank 0 of 1)."""
    return WorldInfo(
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_distributed(device: str | None = None) -> WorldInfo:
    """Join the process group when launched with more than one rank; returns this rank's info.

    gloo on CPU, NCCL on GPU (each rank on ``cuda:LOCAL_RANK``).
    """
    import torch
    import torch.distributed as dist

    info = world_info()
    if info.world_size > 1 and not dist.is_initialized():
        use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        if use_cuda:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return info


def all_equal(obj) -> bool:
    """True when every rank holds an equal picklable ``obj`` (always True on one rank)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return all(g == gathered[0] for g in gathered)


def barrier() -> None:
    """A barrier when a process group exists."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
