"""Which allocations a process's first CUDA graph capture makes outside the graph pool.

    python3 scripts/gpu_capture_probe.py

Captures a small matmul three times into one private pool (the third after the first two graphs
are freed) with the allocator's history on, and prints every segment each capture created with
its pool id, size and the stack of the allocation that created it. ``CudaGraphs._prime``
exists because of what the first capture shows.

Seen on the H200 (torch 2.11, ``reports/gpu/archive/capture_probe.log``): the first capture
makes a 2 MiB default-pool segment in ``CUDAGeneratorState::register_graph`` (called by
``capture_begin``), and the cuBLAS workspace and the output go into the graph pool. The second
makes nothing. The third fails: torch's allocator asserts when a private pool is used again
after all its graphs were freed while the probe still held their outputs.
"""

from __future__ import annotations

import torch


def _internal(name: str) -> bool:
    """Allocator, dispatcher and unwinder frames (the same for every allocation)."""
    return any(
        k in name
        for k in (
            "unwind",
            "Traceback",
            "gather_with",
            "CachingAllocator",
            "empty_generic",
            "wrap_kernel_functor",
            "redispatch",
            "RegisterCUDA",
            "wrapper_CUDA",
            "empty_cuda",
            "empty_memory_format",
        )
    )


def capture_once(x: torch.Tensor, pool, keep: list) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        y = x @ x
    keep.append((g, y))
    snap = torch.cuda.memory._snapshot()
    new = [seg for seg in snap["segments"] if seg["address"] not in before]
    for seg in new:
        print(
            f"  segment pool={tuple(seg.get('segment_pool_id', ()))} bytes={seg['total_size']} "
            f"stream={seg['stream']}"
        )
        for tr in snap["device_traces"][0]:
            if tr["action"] == "segment_alloc" and tr["addr"] == seg["address"]:
                frames = [fr for fr in tr.get("frames", []) if not _internal(fr["name"])]
                for fr in frames[:12]:
                    print(f"    {fr['name'][:160]}  {fr['filename']}:{fr['line']}")
    if not new:
        print("  no new segment")


def main() -> None:
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
    x = torch.randn(64, 64, device="cuda")
    (x @ x).sum().item()  # warm-up on the default stream, as an eager warm-up does
    pool = torch.cuda.graph_pool_handle()
    keep: list = []
    print(f"torch {torch.__version__}; graph pool {pool}")
    print("first capture:")
    capture_once(x, pool, keep)
    print("second capture (first graph alive):")
    capture_once(x, pool, keep)
    keep.clear()
    print("third capture (earlier graphs freed):")
    try:
        capture_once(x, pool, keep)
    except RuntimeError as exc:
        print(f"  capture failed: {exc}")


if __name__ == "__main__":
    main()
