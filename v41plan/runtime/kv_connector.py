"""KV transfer connectors: PAGE units and checkpoint images kept off the device.

A connector is a second tier under the device prefix cache. What it holds is keyed as the device
cache is: a PAGE unit by the chained hash of the block it holds (``block_manager.chain_hashes``)
and a checkpoint image by the hash of the block ending at its position. A unit's bytes are its
byte stream (``Pools.read_units``: the main PAGE, then every index plane, in ``StateCopies``
order), an image's bytes are its ``units_per_image`` unit streams end to end. Every entry carries
the pool's layout id and a checksum; a foreign layout, a bad checksum or a missing unit makes a
retrieve fail, and the scheduler then recomputes (never a wrong restore).

The scheduler calls ``lookup`` / ``has_image`` on admission and ``prefetch`` for what it wants
restored, then polls ``ready`` between steps (a slow tier never blocks a step: the request waits
and others run). The runner calls ``save_units`` / ``save_image`` with bytes it read from the
pools after the forward that wrote them, and writes what ``take`` returns into fresh pages
before the forward that reads them.

Two implementations: ``LocalConnector`` (host memory with an optional disk directory, for tests
and single-box use) here, and ``LMCacheConnector`` (``kv_lmcache``: a client of the LMCache
multiprocess server).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

KV_CONNECTORS = ("lmcache_mp", "local")
"""The connectors ``kv_transfer_config`` accepts."""


class ConnectorError(RuntimeError):
    """A connector that cannot start (the server down at start, a bad directory)."""


def checksum(data: np.ndarray) -> bytes:
    """16 bytes of sha256 over an entry's bytes."""
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).digest()[:16]


@dataclass
class Prefetch:
    """What the scheduler asked for one admission: units of blocks ``[first, first + count)``
    and, optionally, the image ending at block ``image_block``."""

    keys: tuple[bytes, ...]
    """Hash of each requested block, in order."""
    image_key: bytes | None
    done: bool = False
    units: np.ndarray | None = None
    """``[count, page_unit_bytes]`` once done (None: the retrieve failed)."""
    image: np.ndarray | None = None
    """``[units_per_image, page_unit_bytes]`` once done, when an image was asked."""
    failed: str | None = None
    """Why the retrieve failed (the scheduler then recomputes)."""
    extra: dict = field(default_factory=dict)
    """Implementation state (token ids, futures)."""


@dataclass
class ConnectorStats:
    """Counters the engine's metrics and the tests read."""

    lookups: int = 0
    hit_blocks: int = 0
    saved_units: int = 0
    saved_images: int = 0
    loaded_units: int = 0
    loaded_images: int = 0
    failed_retrieves: int = 0
    dropped_saves: int = 0
    evicted: int = 0


class KVConnector:
    """The interface. ``layout_id`` and ``unit_bytes`` come from the pool geometry."""

    name = "base"

    def __init__(self, layout_id: str, unit_bytes: int, units_per_image: int) -> None:
        self.layout_id = layout_id
        self.unit_bytes = unit_bytes
        self.units_per_image = units_per_image
        self.stats = ConnectorStats()

    # scheduler side ------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], hashes: Sequence[bytes], first: int = 0) -> int:
        """How many consecutive blocks from block ``first`` are stored (``hashes``: the hashes
        of the full blocks of ``token_ids`` that may be reused)."""
        raise NotImplementedError

    def has_image(self, token_ids: Sequence[int], key: bytes) -> bool:
        """Whether the image ending at block ``key`` (after ``token_ids``) is stored."""
        raise NotImplementedError

    def prefetch(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[bytes],
        first: int,
        count: int,
        image_block: int | None,
    ) -> Prefetch:
        """Start retrieving blocks ``[first, first + count)`` and the image ending at block
        ``image_block`` (None: no image); poll ``ready``."""
        raise NotImplementedError

    def ready(self, handle: Prefetch) -> bool:
        """Whether ``handle``'s retrieve has finished (successfully or not)."""
        return handle.done

    def end_request(self, handle: Prefetch) -> None:
        """Release what the retrieve held (locks, sessions)."""

    # runner side ---------------------------------------------------------------------------
    def save_units(self, keys: Sequence[bytes], token_ids: Sequence[int], data: np.ndarray) -> None:
        """Store units ``data [len(keys), unit_bytes]`` of consecutive blocks (``keys`` their
        hashes), the last ending at the end of ``token_ids``."""
        raise NotImplementedError

    def save_image(self, key: bytes, token_ids: Sequence[int], data: np.ndarray) -> None:
        """Store the image ``data [units_per_image, unit_bytes]`` ending at block ``key``."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work and release resources."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name


class LocalConnector(KVConnector):
    """Host memory (LRU, bounded by ``bytes``), optionally spilled to ``path`` on disk.

    Entries are keyed by ``layout id + kind + block hash``, so one directory can serve several
    layouts without confusion. With ``path`` every entry is also written to
    ``path/<key hex>.npy`` (with its checksum) and found there after a restart or an eviction
    from memory.
    """

    name = "local"

    def __init__(
        self,
        layout_id: str,
        unit_bytes: int,
        units_per_image: int,
        *,
        bytes: int = 1 << 30,
        path: str | None = None,
    ) -> None:
        super().__init__(layout_id, unit_bytes, units_per_image)
        if bytes <= 0:
            raise ConnectorError(f"kv_transfer_config bytes={bytes}: must be positive")
        self.capacity_bytes = int(bytes)
        self.path = path
        if path is not None:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise ConnectorError(f"kv_transfer_config path={path!r}: {exc}") from None
        self._mem: OrderedDict[bytes, tuple[str, bytes, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _key(self, kind: str, h: bytes) -> bytes:
        return self.layout_id.encode() + b"/" + kind.encode() + b"/" + h

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, hashlib.sha256(key).hexdigest() + ".npz")

    def _put(self, key: bytes, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8).copy()
        entry = (self.layout_id, checksum(data), data)
        with self._lock:
            if key in self._mem:
                self._mem.move_to_end(key)
                return
            self._mem[key] = entry
            self._bytes += data.nbytes
            while self._bytes > self.capacity_bytes and len(self._mem) > 1:
                _k, (_l, _c, old) = self._mem.popitem(last=False)
                self._bytes -= old.nbytes
                self.stats.evicted += 1
        if self.path is not None:
            tmp = self._file(key) + ".tmp"
            with open(tmp, "wb") as f:
                np.savez(f, layout=np.frombuffer(self.layout_id.encode(), np.uint8),
                         sum=np.frombuffer(entry[1], np.uint8), data=data)  # fmt: skip
            os.replace(tmp, self._file(key))

    def _get(self, key: bytes) -> tuple[str, bytes, np.ndarray] | None:
        with self._lock:
            entry = self._mem.get(key)
            if entry is not None:
                self._mem.move_to_end(key)
                return entry
        if self.path is None or not os.path.exists(self._file(key)):
            return None
        try:
            with np.load(self._file(key)) as z:
                layout = z["layout"].tobytes().decode()
                return layout, z["sum"].tobytes(), z["data"]
        except (OSError, ValueError, KeyError):
            return None

    def _has(self, key: bytes) -> bool:
        with self._lock:
            if key in self._mem:
                return True
        return self.path is not None and os.path.exists(self._file(key))

    def _checked(self, key: bytes, rows: int) -> tuple[np.ndarray | None, str | None]:
        entry = self._get(key)
        if entry is None:
            return None, "missing"
        layout, digest, data = entry
        if layout != self.layout_id:
            return None, f"foreign layout {layout} (this pool: {self.layout_id})"
        if data.shape != (rows, self.unit_bytes) or checksum(data) != digest:
            return None, "checksum or size mismatch"
        return data, None

    def lookup(self, token_ids, hashes, first: int = 0) -> int:
        self.stats.lookups += 1
        n = 0
        for h in hashes[first:]:
            if not self._has(self._key("unit", h)):
                break
            n += 1
        self.stats.hit_blocks += n
        return n

    def has_image(self, token_ids, key) -> bool:
        return self._has(self._key("image", key))

    def prefetch(self, token_ids, hashes, first, count, image_block) -> Prefetch:
        keys = tuple(hashes[first : first + count])
        image_key = None if image_block is None else hashes[image_block]
        handle = Prefetch(keys, image_key)
        rows = []
        for h in keys:
            data, why = self._checked(self._key("unit", h), 1)
            if data is None:
                return self._fail(handle, why)
            rows.append(data)
        if image_key is not None:
            data, why = self._checked(self._key("image", image_key), self.units_per_image)
            if data is None:
                return self._fail(handle, why)
            handle.image = data
            self.stats.loaded_images += 1
        handle.units = (
            np.concatenate(rows) if rows else np.zeros((0, self.unit_bytes), dtype=np.uint8)
        )
        self.stats.loaded_units += len(rows)
        handle.done = True
        return handle

    def _fail(self, handle: Prefetch, why: str | None) -> Prefetch:
        handle.done, handle.failed = True, why or "failed"
        handle.units = handle.image = None
        self.stats.failed_retrieves += 1
        return handle

    def save_units(self, keys, token_ids, data) -> None:
        for h, row in zip(keys, data, strict=True):
            self._put(self._key("unit", h), row[None, :])
            self.stats.saved_units += 1

    def save_image(self, key, token_ids, data) -> None:
        self._put(self._key("image", key), data)
        self.stats.saved_images += 1

    def describe(self) -> str:
        where = f", spilled to {self.path}" if self.path else ""
        return f"local KV tier: {self.capacity_bytes} bytes of host memory{where}"
