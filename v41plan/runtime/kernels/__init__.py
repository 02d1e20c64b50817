"""Kernel backends: the interface (``backend``), its torch implementation (``torch_ref``) and
the Triton kernels (``triton_backend``)."""

from __future__ import annotations


def default_backend(device):
    """The backend for a model on ``device``: ``TritonBackend`` on CUDA when triton imports,
    else ``TorchBackend`` (the reference, and the CPU path)."""
    import torch

    from v41plan.runtime.kernels.torch_ref import TorchBackend

    if torch.device(device).type == "cuda":
        try:
            from v41plan.runtime.kernels.triton_backend import TritonBackend
        except ImportError:
            return TorchBackend()
        return TritonBackend()
    return TorchBackend()
