"""Kernel backends: the interface (``backend``) and its torch implementation (``torch_ref``)."""
