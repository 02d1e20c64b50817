"""PAGE pool, STATE slots, the prefix cache and checkpoint images.

A PAGE is also the prefix cache's hash block: ``page_tokens`` tokens. Block hashes are
sha256-chained over token ids and published only after the forward that wrote the block has
run (``publish``). The last hash block of a prompt is never reused, so every admission forwards
at least one row and gets logits.

Two state transfers (the specification's ``StateTransfer``):

- ``replay`` (encoder SWA bounded replay, the default): no checkpoint image is ever kept; a hit
  is accepted at any hash-block boundary and its forward starts one hash block lower
  (``replay_start``) in a fresh slot.
- ``copy``: checkpoint images of a STATE entry (SWA rings and cursor) are kept in PAGE units,
  keyed by the hash of the block ending at the image's position. An image is COPYING from the
  moment its store is queued until the batch that carried the store completes, then READY.
  A restore pins its image until its batch completes; LRU eviction takes READY unpinned images.

Pure host bookkeeping: no torch. The executor performs the copies a batch names.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

COPYING = "copying"
READY = "ready"


def block_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """sha256 of one hash block's token ids chained to its parent block's hash."""
    h = hashlib.sha256(parent)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    return h.digest()


ROOT_HASH = b"v41plan-prefix-root"


def chain_hashes(token_ids: list[int], page_tokens: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
    out: list[bytes] = []
    parent = ROOT_HASH
    for b in range(num_blocks):
        parent = block_hash(parent, token_ids[b * page_tokens : (b + 1) * page_tokens])
        out.append(parent)
    return out


@dataclass
class Image:
    """One checkpoint image: a STATE entry's rings and cursor copied into PAGE units."""

    key: bytes
    """Hash of the block ending at the image's position."""
    position: int
    """Token position the image resumes at (a multiple of ``page_tokens``)."""
    units: list[int]
    """PAGE ids holding the image, in unit order."""
    state: str = COPYING
    pins: int = 0


@dataclass(frozen=True)
class StoreOp:
    """Copy a STATE slot into an image's PAGE units (runs before the batch that carries it)."""

    slot: int
    units: tuple[int, ...]
    position: int


@dataclass(frozen=True)
class RestoreOp:
    """Copy an image's PAGE units into a STATE slot (runs after the stores, before the forward)."""

    units: tuple[int, ...]
    slot: int
    position: int


@dataclass
class BlockManagerStats:
    """Counters the validator and tests read."""

    hits_tokens: int = 0
    stores: int = 0
    restores: int = 0
    images_evicted: int = 0
    stores_skipped_no_room: int = 0
    hits_gated: int = 0


class BlockManager:
    """PAGE pool with ref counts, STATE slots, the prefix-cache index and checkpoint images."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_tokens: int,
        num_slots: int,
        transfer: str = "replay",
        units_per_image: int = 1,
    ) -> None:
        if transfer not in ("replay", "copy"):
            raise ValueError(f"transfer={transfer!r}; accepted: replay, copy")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.num_slots = num_slots
        self.transfer = transfer
        self.units_per_image = units_per_image
        self.ref = [0] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        # Free pages that still hold a published block, oldest first (evicted last-resort).
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.hash_to_page: dict[bytes, int] = {}
        self.page_to_hash: dict[int, bytes] = {}
        self.free_slots: deque[int] = deque(range(num_slots))
        self.images: OrderedDict[bytes, Image] = OrderedDict()
        self.pending_stores: list[tuple[StoreOp, bytes]] = []
        self.inflight: list[bytes] = []  # stores carried by the batch being executed
        self.pinned: list[bytes] = []  # restores carried by the batch being executed
        self.stats = BlockManagerStats()

    # ---- pages ---------------------------------------------------------------------------
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free plus cached-but-unreferenced)."""
        return len(self.free_pages) + len(self.cached_free)

    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        elif self.cached_free:
            page, _ = self.cached_free.popitem(last=False)
            key = self.page_to_hash.pop(page)
            del self.hash_to_page[key]
        elif self._evict_image():
            return self._take_page()
        else:
            raise RuntimeError("PAGE pool exhausted")
        self.ref[page] = 1
        return page

    def _acquire(self, page: int) -> None:
        if self.ref[page] == 0:
            self.cached_free.pop(page, None)
        self.ref[page] += 1

    def _release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if page in self.page_to_hash:
                self.cached_free[page] = None
            else:
                self.free_pages.append(page)

    def allocatable_pages(self) -> int:
        """Pages obtainable now, counting those READY unpinned images would give back."""
        evictable = sum(
            len(im.units) for im in self.images.values() if im.state == READY and im.pins == 0
        )
        return self.num_free_pages() + evictable

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages of the contiguous leading run of ``hashes`` present in the cache."""
        pages = []
        for h in hashes:
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(self, hit_pages: list[int], num_new: int) -> list[int]:
        """Share ``hit_pages`` and take ``num_new`` fresh pages; returns the block table."""
        for p in hit_pages:
            self._acquire(p)
        return list(hit_pages) + [self._take_page() for _ in range(num_new)]

    def append_page(self, table: list[int]) -> None:
        """Extend a block table by one fresh page."""
        table.append(self._take_page())

    def free(self, table: list[int]) -> None:
        """Drop a block table's references (published pages stay cached)."""
        for p in reversed(table):
            self._release(p)
        table.clear()

    def publish(self, key: bytes, page: int) -> None:
        """Index a written block. A block already cached under another page keeps that page."""
        if key in self.hash_to_page or page in self.page_to_hash:
            return
        self.hash_to_page[key] = page
        self.page_to_hash[page] = key

    # ---- slots ---------------------------------------------------------------------------
    def take_slot(self) -> int:
        """A free STATE slot (the forward resets it where its request starts)."""
        if not self.free_slots:
            raise RuntimeError("no free STATE slot")
        return self.free_slots.popleft()

    def free_slot(self, slot: int) -> None:
        """Return a STATE slot; the next admission takes it first, and its first forward resets
        it."""
        self.free_slots.appendleft(slot)

    # ---- images (copy transfer) ----------------------------------------------------------
    def resumable(self, hashes: list[bytes], hit_blocks: int) -> int:
        """Largest ``L <= hit_blocks`` with a READY image for block ``L - 1`` (else 0)."""
        if self.transfer != "copy":
            return hit_blocks
        for n in range(hit_blocks, 0, -1):
            im = self.images.get(hashes[n - 1])
            if im is not None and im.state == READY:
                return n
        return 0

    def begin_restore(self, key: bytes, slot: int) -> RestoreOp:
        """Pin a READY image for a restore into ``slot`` carried by the next batch."""
        im = self.images[key]
        if im.state != READY:
            raise RuntimeError("gated checkpoint image is not READY")
        im.pins += 1
        self.images.move_to_end(key)
        self.pinned.append(key)
        self.stats.restores += 1
        return RestoreOp(tuple(im.units), slot, im.position)

    def begin_store(self, key: bytes, slot: int, position: int) -> bool:
        """Queue a store of ``slot`` as the image of ``key``; refuses rather than evict
        partially."""
        if self.transfer != "copy" or key in self.images:
            return False
        need = self.units_per_image
        if self.allocatable_pages() < need:
            self.stats.stores_skipped_no_room += 1
            return False
        units = [self._take_page() for _ in range(need)]
        im = Image(key, position, units)
        self.images[key] = im
        self.pending_stores.append((StoreOp(slot, tuple(units), position), key))
        return True

    def take_stores(self) -> list[StoreOp]:
        """Stores for the next batch; they become READY when that batch completes."""
        ops = [op for op, _ in self.pending_stores]
        self.inflight.extend(key for _, key in self.pending_stores)
        self.pending_stores.clear()
        self.stats.stores += len(ops)
        return ops

    def complete_batch(self) -> list[Image]:
        """After a batch ran: its stores are READY (returned) and its restores unpinned."""
        ready = []
        for key in self.inflight:
            im = self.images.get(key)
            if im is not None:
                im.state = READY
                ready.append(im)
        self.inflight.clear()
        for key in self.pinned:
            im = self.images.get(key)
            if im is not None:
                im.pins -= 1
        self.pinned.clear()
        return ready

    def add_loaded_image(self, key: bytes, position: int) -> Image:
        """A READY image in fresh units whose bytes a connector load of the next batch writes
        (before that batch's restores); the caller pins it with ``begin_restore``."""
        units = [self._take_page() for _ in range(self.units_per_image)]
        im = Image(key, position, units, READY)
        self.images[key] = im
        return im

    def _evict_image(self) -> bool:
        for key, im in self.images.items():
            if im.state == READY and im.pins == 0:
                del self.images[key]
                for u in im.units:
                    self.ref[u] = 0
                    self.free_pages.append(u)
                self.stats.images_evicted += 1
                return True
        return False

    def drop_images(self) -> int:
        """Forget every READY unpinned image (the validator's missing-image case); returns the
        count."""
        n = 0
        while self._evict_image():
            n += 1
        return n

    def pages_in_use(self) -> int:
        """Pages referenced by block tables or images (0 when idle without images)."""
        return sum(1 for r in self.ref if r > 0)
