"""PAGE and STATE pools carved from one backing allocation, sized by a ``PoolGeometry`` only.

Layout (region-major, every region start aligned to ``max(256, alignment_bytes)``)::

    [ PAGE region: (num_pages + 1) x page_bytes            ]  main rows of every Full owner
    [ index plane region per plane: (num_pages + 1) x bytes_per_page ]
    [ STATE region: (num_slots + 1) x state_bytes          ]  rings, tails, cursor

Nothing here derives a size: every byte count comes from the geometry. The one extra page and
the one extra slot are sinks: a scatter redirects a sentinel row there and writes back the bytes
the sink already holds, so a padded row changes no byte anywhere (not even in the sink). The
scheduler never hands them out. Every tensor-parallel rank holds an identical copy (nothing is
sharded: the model has one KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from v41plan.geometry.runtime import PoolGeometry

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "float32": torch.float32,
    "int64": torch.int64,
}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _typed(
    flat: torch.Tensor,
    offset: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    outer: int,
    outer_stride_bytes: int,
) -> torch.Tensor:
    """A typed strided view ``[outer, *shape]`` of ``flat`` (uint8) starting at byte ``offset``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert offset % itemsize == 0 and outer_stride_bytes % itemsize == 0
    base = flat.view(dtype)
    inner = []
    s = 1
    for d in reversed(shape):
        inner.append(s)
        s *= d
    strides = (outer_stride_bytes // itemsize, *reversed(inner))
    return base.as_strided((outer, *shape), strides, offset // itemsize)


@dataclass(frozen=True)
class PageAddress:
    """Where compressed row ``c`` of a request lives: ``(page, row_in_page)``."""

    page: torch.Tensor
    row: torch.Tensor


def compressed_row_address(
    block_table: torch.Tensor,
    batch_id: torch.Tensor,
    row: torch.Tensor,
    rows_per_page: int,
    sink_page: int,
) -> PageAddress:
    """Address of compressed row ``row`` of request ``batch_id`` through its block table.

    Pure function of (block table, compressed row). A negative batch id, a negative row or a
    negative block-table entry lands on ``sink_page`` (row 0) instead of wrapping around.
    """
    b = batch_id.clamp(min=0)
    c = row.clamp(min=0)
    col = (c // rows_per_page).clamp(max=block_table.shape[1] - 1)
    page = block_table[b, col]
    ok = (batch_id >= 0) & (row >= 0) & (page >= 0) & (row // rows_per_page < block_table.shape[1])
    return PageAddress(torch.where(ok, page, sink_page), torch.where(ok, c % rows_per_page, 0))


def ring_row_address(
    slot: torch.Tensor, position: torch.Tensor, ring_rows: int, sink_slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot, ring row)`` of position ``position``: ``position mod ring_rows``; a negative slot
    or position goes to the sink slot."""
    ok = (slot >= 0) & (position >= 0)
    return torch.where(ok, slot, sink_slot), torch.where(ok, position.clamp(min=0) % ring_rows, 0)


class Pools:
    """The PAGE region, the index planes and the STATE entries of one format pair.

    Typed views (all aliases of ``backing``):

    - ``page`` ``[pages+1, page_bytes]`` uint8; ``main[owner]`` ``[pages+1, rows, head_dim]`` bf16
      or ``[pages+1, rows, main_row_bytes]`` uint8 (fp4: E2M1 values then E4M3 group-16 scales).
    - ``index[owner]`` (fp8) ``[pages+1, rows, index_row_bytes]`` uint8 with ``index_values``
      (E4M3 bytes) and ``index_scale`` (fp32) sub-views; fp4: ``index_values[owner]``
      ``[pages+1, rows, index_head_dim//2]`` and ``index_scales[owner]`` ``[pages+1, rows,
      index_head_dim//32]`` E8M0 bytes, each also viewable in page-8 row groups via
      ``row_groups``.
    - ``state`` ``[slots+1, state_bytes]``; ``rings`` ``[slots+1, layers, ring_rows, width]``,
      ``tail_values``/``tail_scores`` ``[slots+1, tail_owners, head_dim]`` fp32, ``cursor``
      ``[slots+1, 1 + history]`` int64.
    """

    def __init__(
        self,
        geometry: PoolGeometry,
        num_pages: int,
        num_slots: int,
        device: str | torch.device = "cpu",
    ):
        g = geometry
        self.geometry = g
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.sink_page = num_pages
        self.sink_slot = num_slots
        pages = num_pages + 1
        slots = num_slots + 1
        align = max(256, g.alignment_bytes)
        off = 0
        self.page_region = (off, pages * g.page_bytes)
        off = _align(off + pages * g.page_bytes, align)
        plane_regions = {}
        for p in g.planes:
            if p.kind == "main":
                continue
            plane_regions[p.name] = off
            off = _align(off + pages * p.bytes_per_page, align)
        self._plane_regions = plane_regions
        self.state_region = (off, slots * g.state_bytes)
        total = _align(off + slots * g.state_bytes, align)
        self.backing = torch.zeros(total, dtype=torch.uint8, device=device)
        flat = self.backing

        self.page = _typed(flat, 0, (g.page_bytes,), torch.uint8, pages, g.page_bytes)
        self.main: dict[int, torch.Tensor] = {}
        self.index: dict[int, torch.Tensor] = {}
        self.index_values: dict[int, torch.Tensor] = {}
        self.index_scale: dict[int, torch.Tensor] = {}
        self.index_scales: dict[int, torch.Tensor] = {}
        self.rows_per_page: dict[int, int] = {}
        self.ratio: dict[int, int] = {}
        for p in g.planes:
            if p.kind == "main":
                self.rows_per_page[p.owner] = p.rows_per_page
                self.ratio[p.owner] = p.ratio
                if g.kv_cache_dtype == "bf16":
                    self.main[p.owner] = _typed(
                        flat,
                        p.region_offset,
                        (p.rows_per_page, p.row_bytes // 2),
                        torch.bfloat16,
                        pages,
                        g.page_bytes,
                    )
                else:
                    self.main[p.owner] = _typed(
                        flat,
                        p.region_offset,
                        (p.rows_per_page, p.row_bytes),
                        torch.uint8,
                        pages,
                        g.page_bytes,
                    )
                continue
            base = plane_regions[p.name]
            if p.kind == "index":
                rb = p.row_bytes
                self.index[p.owner] = _typed(
                    flat, base, (p.rows_per_page, rb), torch.uint8, pages, p.bytes_per_page
                )
                self.index_values[p.owner] = self.index[p.owner][..., : rb - 4]
                # one fp32 scale per row, in the row's last 4 bytes
                self.index_scale[p.owner] = flat.view(torch.float32).as_strided(
                    (pages, p.rows_per_page), (p.bytes_per_page // 4, rb // 4), (base + rb - 4) // 4
                )
            elif p.kind == "index_values":
                self.index_values[p.owner] = _typed(
                    flat, base, (p.rows_per_page, p.row_bytes), torch.uint8, pages, p.bytes_per_page
                )
            else:
                self.index_scales[p.owner] = _typed(
                    flat, base, (p.rows_per_page, p.row_bytes), torch.uint8, pages, p.bytes_per_page
                )

        s0 = self.state_region[0]
        self.state = _typed(flat, s0, (g.state_bytes,), torch.uint8, slots, g.state_bytes)
        views = {}
        for f in g.state_fields:
            views[f.name] = _typed(
                flat, s0 + f.offset, tuple(f.shape), _DTYPES[f.dtype], slots, g.state_bytes
            )
        self.rings = views["swa_rings"]
        self.tail_values = views["tail_values"]
        self.tail_scores = views["tail_scores"]
        self.cursor = views["cursor"]
        cursor_field = next(f for f in g.state_fields if f.name == "cursor")
        self._cursor_offset = cursor_field.offset
        self._cursor_bytes = int(np.prod(cursor_field.shape)) * 8
        self.cursor_host = np.zeros((slots, *cursor_field.shape), dtype=np.int64)
        """Host mirror of every slot's cursor ``[position, Engram history...]``: what the last
        prepared step commits, what a reset or an image restore puts there (``prepare`` reads
        it instead of the device)."""
        self._image_bytes: dict[int, int] = {}
        """Cursor bytes copied out of a slot, by backing address (the image's cursor)."""
        # ratio-2 owners in layer order own tail rows 0, 1, 2
        self.tail_index = {
            o: i for i, o in enumerate(sorted(o for o, r in self.ratio.items() if r == 2))
        }

    # -- addressing -------------------------------------------------------------------------
    def ring(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rings across slots: ``[slots+1, ring_rows, width]``."""
        return self.rings[:, layer]

    def ring_address(
        self, slot: torch.Tensor, position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, ring row)`` of a position (sentinels go to the sink slot)."""
        return ring_row_address(slot, position, self.geometry.ring_rows, self.sink_slot)

    def row_address(
        self, owner: int, block_table: torch.Tensor, batch_id: torch.Tensor, row: torch.Tensor
    ) -> PageAddress:
        """Address of compressed row ``row`` of ``owner`` for request ``batch_id``."""
        return compressed_row_address(
            block_table, batch_id, row, self.rows_per_page[owner], self.sink_page
        )

    @staticmethod
    def row_groups(plane: torch.Tensor, group_rows: int = 8) -> torch.Tensor:
        """View an fp4 index plane ``[pages, rows, bytes]`` as page-8 row groups
        ``[pages, rows // 8, 8, bytes]`` (the row-group scorer's unit)."""
        p, r, b = plane.shape
        return (
            plane.view(p, r // group_rows, group_rows, b)
            if plane.is_contiguous()
            else plane.unflatten(1, (r // group_rows, group_rows))
        )

    # -- checkpoint images ---------------------------------------------------------------
    def image_addresses(self, slot: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte addresses of a checkpoint image: ``(state_bytes_of_slot, unit_bytes)``.

        The image is the STATE fields marked ``in_checkpoint`` (each with its padding), laid
        end to end over ``units_per_image`` PAGE units ``pages``; a unit's bytes are its main
        PAGE followed by its slice of every index plane (``PlaneInfo.offset`` order). The tails
        are not in the image, so a restore leaves the destination slot's own tails.
        """
        g = self.geometry
        dev = self.backing.device
        state_off = torch.cat(
            [
                torch.arange(f.offset, f.offset + f.field_bytes, device=dev)
                for f in g.state_fields
                if f.in_checkpoint
            ]
        )
        # the image is a prefix of its units' byte streams end to end
        unit_addr = self.unit_addresses(pages.tolist()).reshape(-1)[: state_off.numel()]
        state_addr = self.state_region[0] + slot * g.state_bytes + state_off
        return state_addr, unit_addr

    def unit_addresses(self, pages) -> torch.Tensor:
        """Byte addresses ``[len(pages), page_unit_bytes]`` of PAGE units ``pages``: each unit's
        main PAGE bytes, then its slice of every index plane (``PlaneInfo.offset`` order), the
        byte stream a checkpoint image and an offloaded unit share."""
        g = self.geometry
        dev = self.backing.device
        base = torch.zeros(g.page_unit_bytes, dtype=torch.long, device=dev)
        stride = torch.full((g.page_unit_bytes,), g.page_bytes, dtype=torch.long, device=dev)
        base[: g.page_bytes] = torch.arange(g.page_bytes, device=dev) + self.page_region[0]
        for pl in g.planes:
            if pl.kind == "main":
                continue
            seg = slice(pl.offset, pl.offset + pl.bytes_per_page)
            base[seg] = self._plane_regions[pl.name] + torch.arange(pl.bytes_per_page, device=dev)
            stride[seg] = pl.bytes_per_page
        pages = torch.as_tensor(list(pages), dtype=torch.long, device=dev)
        return base[None, :] + stride[None, :] * pages[:, None]

    def kv_transfer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Each plane of a PAGE unit as a ``[pages, bytes]`` uint8 view of the pool (the sink
        page excluded), in unit-stream (``StateCopies``) order: ``page`` (main rows), then every
        index plane by name. Row ``p`` of each, concatenated, is unit ``p``'s byte stream."""
        n = self.num_pages
        out = [("page", self.page[:n])]
        for pl in sorted(
            (p for p in self.geometry.planes if p.kind != "main"), key=lambda p: p.offset
        ):
            base = self._plane_regions[pl.name]
            view = _typed(
                self.backing, base, (pl.bytes_per_page,), torch.uint8, n, pl.bytes_per_page
            )
            out.append((pl.name, view))
        return out

    def read_units(self, pages) -> np.ndarray:
        """``[len(pages), page_unit_bytes]`` uint8 on the host: the units' byte streams."""
        if not len(pages):
            return np.zeros((0, self.geometry.page_unit_bytes), dtype=np.uint8)
        return self.backing[self.unit_addresses(pages)].cpu().numpy()

    def write_units(self, pages, data: np.ndarray, *, image: bool = False) -> None:
        """Write unit byte streams ``data [len(pages), page_unit_bytes]`` into PAGE units
        ``pages``. ``image``: the units hold one checkpoint image (in unit order), whose cursor
        bytes the host mirror learns here, as if a store had put them there."""
        if not len(pages):
            return
        addr = self.unit_addresses(pages)
        src = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
        self.backing[addr.reshape(-1)] = src.reshape(-1).to(self.backing.device)
        if not image:
            return
        g = self.geometry
        lo = 0
        for f in g.state_fields:  # the image is the in-checkpoint fields end to end
            if not f.in_checkpoint:
                continue
            if f.name == "cursor":
                stream = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
                flat = addr.reshape(-1).cpu().numpy()
                for i in range(lo, lo + self._cursor_bytes):
                    self._image_bytes[int(flat[i])] = int(stream[i])
            lo += f.field_bytes

    def region_bases(self) -> dict[str, int]:
        """Byte offset in ``backing`` of every region a copy schedule names (``page``, ``state``
        and each index plane by its ``PlaneInfo.name``)."""
        return {"page": self.page_region[0], "state": self.state_region[0], **self._plane_regions}

    def span_addresses(
        self, region_names: tuple[str, ...], spans
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte addresses ``(src, dst)`` of a planner span table (``planner.checkpoint.CopySpans``),
        for ``KernelBackend.copy_image``."""
        bases = self.region_bases()
        missing = sorted(
            {region_names[int(r)] for r in (*spans.src_region, *spans.dst_region)} - set(bases)
        )
        if missing:
            raise ValueError(
                f"span table names regions this pool does not have: {', '.join(missing)}"
            )
        n = torch.as_tensor(spans.nbytes, dtype=torch.long)
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)

        def side(regions, offsets) -> torch.Tensor:
            start = torch.tensor(
                [bases[region_names[int(r)]] + int(o) for r, o in zip(regions, offsets)],
                dtype=torch.long,
            )
            return (torch.repeat_interleave(start, n) + within).to(self.backing.device)

        return side(spans.src_region, spans.src_offset), side(spans.dst_region, spans.dst_offset)

    def copy_spans(self, region_names: tuple[str, ...], spans, backend) -> None:
        """Run a planner span table (``planner.checkpoint.CopySpans``) on the pools through the
        backend's ``copy_spans``, keeping the host cursor mirror in step: cursor bytes a span
        carries out of a STATE slot are remembered by destination address, and a span landing
        on a slot's cursor takes its bytes from the slot or from that record."""
        bases = self.region_bases()
        missing = sorted(
            {region_names[int(r)] for r in (*spans.src_region, *spans.dst_region)} - set(bases)
        )
        if missing:
            raise ValueError(
                f"span table names regions this pool does not have: {', '.join(missing)}"
            )
        src = [
            bases[region_names[int(r)]] + int(o) for r, o in zip(spans.src_region, spans.src_offset)
        ]
        dst = [
            bases[region_names[int(r)]] + int(o) for r, o in zip(spans.dst_region, spans.dst_offset)
        ]
        n = [int(x) for x in spans.nbytes]
        for s, d, k in zip(src, dst, n, strict=True):
            self._mirror_span(s, d, k)
        backend.copy_spans(self.backing, src, dst, n)

    def _cursor_slot(self, addr: int) -> tuple[int, int] | None:
        """``(slot, byte within its cursor)`` of a backing address, or None."""
        s0 = self.state_region[0] + self._cursor_offset
        if addr < s0:
            return None
        slot, within = divmod(addr - s0, self.geometry.state_bytes)
        if slot > self.num_slots or within >= self._cursor_bytes:
            return None
        return slot, within

    def _mirror_span(self, src: int, dst: int, nbytes: int) -> None:
        """Host bookkeeping of one byte copy for the cursor mirror (at most a cursor's bytes per
        slot a span touches are looked at)."""
        sb, cb = self.geometry.state_bytes, self._cursor_bytes
        s0 = self.state_region[0] + self._cursor_offset
        mirror = self.cursor_host.view(np.uint8).reshape(self.num_slots + 1, cb)

        def cursor_bytes(lo: int, hi: int):
            # every (address, slot, byte) of the cursors inside [lo, hi)
            if hi <= s0:
                return
            first = max(0, (lo - s0) // sb)
            last = min(self.num_slots, (hi - 1 - s0) // sb)
            for slot in range(first, last + 1):
                a, b = max(lo, s0 + slot * sb), min(hi, s0 + slot * sb + cb)
                for addr in range(a, b):
                    yield addr, slot, addr - (s0 + slot * sb)

        out = list(cursor_bytes(src, src + nbytes))  # cursor bytes leaving a slot
        for addr, slot, i in out:
            self._image_bytes[dst + (addr - src)] = int(mirror[slot, i])
        for addr, slot, i in cursor_bytes(dst, dst + nbytes):  # cursor bytes landing in a slot
            from_addr = src + (addr - dst)
            got = self._cursor_slot(from_addr)
            if got is not None:
                value = int(mirror[got[0], got[1]])
            elif from_addr in self._image_bytes:
                value = self._image_bytes[from_addr]
            else:
                raise ValueError(
                    f"a copy into slot {slot}'s cursor reads bytes the host mirror does not know "
                    f"(address {from_addr}): copy images only through copy_spans"
                )
            mirror[slot, i] = value

    # -- slot lifetime ----------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """Zero a fresh request's STATE entry and mark its Engram history DEAD (-1), on the device
        and in the host mirror."""
        self.state[slot].zero_()
        self.cursor[slot, 1:] = -1
        self.cursor_host[slot] = 0
        self.cursor_host[slot, 1:] = -1

    def nbytes(self) -> int:
        """Bytes of the backing allocation."""
        return self.backing.numel()
