"""The step workspace: a step's inputs staged on the host and moved to the device in one copy.

``prepare()`` lays a step's inputs out as named regions (``Layout``), writes them into a pinned
host buffer through numpy views and moves the used bytes to a device buffer with one
non-blocking copy; ``run()`` reads device views of the same regions. A layout is a pure
function of the step's shapes, so every step of one CUDA-graph bucket sees its inputs at the
same device addresses, which is what a captured graph reads.

Two host buffers alternate on CUDA: the copy that read one may still be in flight while the
next step is written into the other (a step waits only for the copy two steps back). On the
CPU the host buffer is the device buffer and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ALIGN_BYTES = 64
"""Every region starts on a 64-byte boundary (any dtype view is aligned)."""

_NP = {
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.float32: np.float32,
}
_SIZE = {torch.int64: 8, torch.uint8: 1, torch.bool: 1, torch.float32: 4}


@dataclass(frozen=True)
class Layout:
    """Named regions of one step's workspace, in order."""

    key: tuple
    """The regions' names, dtypes and shapes: equal keys are equal layouts."""
    offsets: dict[str, int]
    """Byte offset of each region."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    nbytes: int
    """Bytes from the first region's start to the last region's end."""


def build_layout(items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
    """Lay ``(name, dtype, shape)`` regions out end to end, each 64-byte aligned."""
    offsets, shapes, dtypes = {}, {}, {}
    off = 0
    for name, dtype, shape in items:
        if name in offsets:
            raise ValueError(f"region {name!r} laid out twice")
        off = -(-off // ALIGN_BYTES) * ALIGN_BYTES
        offsets[name], shapes[name], dtypes[name] = off, tuple(shape), dtype
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        off += n * _SIZE[dtype]
    key = tuple((n, str(d), s) for (n, d, s) in items)
    return Layout(key, offsets, shapes, dtypes, off)


class Workspace:
    """Pinned host staging and its device twin for one family of step layouts.

    ``capacity_bytes`` sizes the buffers; ``growable`` lets a larger layout reallocate them
    (never for the decode family, whose device addresses captured graphs hold).
    """

    def __init__(self, device: torch.device, capacity_bytes: int, *, growable: bool) -> None:
        self.device = torch.device(device)
        self.growable = growable
        self.copies = 0
        """Host-to-device copies made (one per committed step on CUDA)."""
        self._allocate(max(capacity_bytes, ALIGN_BYTES))

    def _allocate(self, nbytes: int) -> None:
        cuda = self.device.type == "cuda"
        n_host = 2 if cuda else 1
        self._host = [
            torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(n_host)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if cuda else None
        self._events: list = [None] * n_host
        self._k = 0
        self._host_views: dict = {}
        self._dev_views: dict = {}
        self.capacity_bytes = nbytes

    def host_views(self, layout: Layout) -> dict[str, np.ndarray]:
        """Numpy views of the next host buffer, to fill before ``commit`` (zeroed: no stale
        bytes from an earlier step). Waits only for that buffer's previous copy."""
        if layout.nbytes > self.capacity_bytes:
            if not self.growable:
                raise ValueError(
                    f"step inputs need {layout.nbytes} bytes but the graph workspace holds "
                    f"{self.capacity_bytes} (a wider step than the model was built for)"
                )
            self._allocate(max(layout.nbytes, 2 * self.capacity_bytes))
        ev = self._events[self._k]
        if ev is not None and not ev.query():
            ev.synchronize()  # the copy two steps back is still reading this buffer
        key = (self._k, layout.key)
        views = self._host_views.get(key)
        if views is None:
            if len(self._host_views) > 512:
                self._host_views.clear()
            buf = self._host_np[self._k]
            views = {}
            for name, off in layout.offsets.items():
                dt, shape = layout.dtypes[name], layout.shapes[name]
                n = int(np.prod(shape, dtype=np.int64)) if shape else 1
                size = _SIZE[dt]
                views[name] = buf[off : off + n * size].view(_NP[dt]).reshape(shape)
            self._host_views[key] = views
        self._host_np[self._k][: layout.nbytes] = 0
        return views

    def commit(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Move the filled host buffer's ``layout.nbytes`` to the device in one non-blocking
        copy (none on the CPU) and return device views of the regions."""
        host = self._host[self._k]
        if self._dev is not None:
            self._dev[: layout.nbytes].copy_(host[: layout.nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._k] = ev
            self.copies += 1
            base, key = self._dev, (-1, layout.key)
        else:
            base, key = host, (self._k, layout.key)
        self._k = (self._k + 1) % len(self._host)
        views = self._dev_views.get(key)
        if views is None:
            if len(self._dev_views) > 512:
                self._dev_views.clear()
            views = {}
            for name, off in layout.offsets.items():
                dt, shape = layout.dtypes[name], layout.shapes[name]
                n = int(np.prod(shape, dtype=np.int64)) if shape else 1
                size = _SIZE[dt]
                raw = base[off : off + n * size]
                views[name] = (raw if dt == torch.uint8 else raw.view(dt)).view(shape)
            self._dev_views[key] = views
        return views
