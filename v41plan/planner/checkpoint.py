"""Checkpoint copy schedules for the copy transfer (``--no-encoder-swa-bounded-replay``).

A checkpoint image is a STATE entry's ``in_checkpoint`` fields (SWA rings and cursor, not the
FP32 tails), each with its padding, laid end to end: ``image_bytes`` bytes. It is stored into
``units_per_image`` PAGE units taken from the block pool; a unit's byte stream is unit-major:
its main PAGE bytes, then its slice of every index plane, in ``PoolGeometry.planes`` order. The
image is a byte-exact prefix of the concatenated unit streams; the last unit is partly used.

Everything here is span tables: ``(src region, src offset, dst region, dst offset, nbytes)``
rows the executor turns into tensor copies (or ``apply_spans`` runs on numpy buffers). Regions
are named by ``regions(geometry)``: ``state`` (STATE entries, ``slot * state_bytes``),
``snapshot`` (scratch for relocations, ``i * state_bytes``), ``page`` (main PAGEs,
``page * page_bytes``) and one per index plane (``page * bytes_per_page``).

Order within one batch (``StateCopies``): relocations (every source snapshotted before any
target is written, so swaps and chains are safe), then stores, then restores (a restore may
read an image stored in the same batch). ``lmcache_mp`` publishes PAGE planes in this order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np


class CopyError(ValueError):
    """A copy op that does not match the pool: layout id, byte total, units or slot."""


def regions(geometry) -> tuple[str, ...]:
    """Region names of a geometry; a span's region ids index this tuple."""
    return ("state", "snapshot", "page") + tuple(
        p.name for p in geometry.planes if p.kind != "main"
    )


@dataclass(frozen=True)
class ImageLayout:
    """Where each byte run of an image lives: in a STATE entry and in its PAGE units.

    One row per run that stays inside one STATE field and one unit segment (the main PAGE or
    one index plane slice); independent of slot and page ids.
    """

    layout_id: str
    """Geometry layout id (images are versioned by it)."""
    image_bytes: int
    """Bytes of one image."""
    units_per_image: int
    """PAGE units one image takes."""
    page_unit_bytes: int
    """Bytes of one PAGE unit stream."""
    state_offset: np.ndarray
    """int64 byte offset of the run inside a STATE entry."""
    unit: np.ndarray
    """int64 unit index (0 .. units_per_image - 1) the run lands in."""
    region: np.ndarray
    """int64 region id (into ``regions(geometry)``) of the unit segment."""
    segment_offset: np.ndarray
    """int64 byte offset of the run inside that segment of one page."""
    page_stride: np.ndarray
    """int64 bytes of that segment per page (the page id multiplies it)."""
    nbytes: np.ndarray
    """int64 bytes of the run."""


def image_layout(geometry) -> ImageLayout:
    """Intersect the image stream (checkpoint fields) with the unit stream (segments) once."""
    g = geometry
    names = regions(g)
    fields = [(f.offset, f.field_bytes) for f in g.state_fields if f.in_checkpoint]
    image_bytes = sum(n for _, n in fields)
    if image_bytes != g.image_bytes:
        raise CopyError(
            f"{g.layout_id}: checkpoint fields hold {image_bytes} B, geometry says {g.image_bytes}"
        )
    # Segments of one unit stream: (start in unit, length, region id, stride).
    segments = [(0, g.page_bytes, names.index("page"), g.page_bytes)]
    for p in sorted((p for p in g.planes if p.kind != "main"), key=lambda p: p.offset):
        segments.append((p.offset, p.bytes_per_page, names.index(p.name), p.bytes_per_page))
    if sum(s[1] for s in segments) != g.page_unit_bytes:
        raise CopyError(f"{g.layout_id}: unit segments do not tile page_unit_bytes")
    rows = []
    pos = 0  # position in the image stream
    for f_off, f_len in fields:
        done = 0
        while done < f_len:
            unit, within = divmod(pos, g.page_unit_bytes)
            start, length, region, stride = next(
                s for s in segments if s[0] <= within < s[0] + s[1]
            )
            n = min(f_len - done, start + length - within)
            rows.append((f_off + done, unit, region, within - start, stride, n))
            done += n
            pos += n
    units = -(-image_bytes // g.page_unit_bytes)
    if units != g.units_per_image:
        raise CopyError(
            f"{g.layout_id}: image needs {units} units, geometry says {g.units_per_image}"
        )
    cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    return ImageLayout(g.layout_id, image_bytes, units, g.page_unit_bytes, *cols)


def layout_rows(layout: ImageLayout) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """The layout as plain rows ``(state_offset, unit, region, segment_offset, page_stride,
    nbytes)`` (what ``generated/<spec>/checkpoint.py`` stores)."""
    cols = (layout.state_offset, layout.unit, layout.region, layout.segment_offset,
            layout.page_stride, layout.nbytes)  # fmt: skip
    return tuple(tuple(int(x) for x in row) for row in zip(*cols, strict=True))


def load_image_layout(geometry, spec_name: str | None = None) -> ImageLayout:
    """The image layout of ``geometry``: from ``generated/<spec_name>/checkpoint.py`` when it
    holds this layout id (checked against the geometry's sizes), else computed."""
    if spec_name is not None:
        try:
            mod = importlib.import_module(f"v41plan.generated.{spec_name}.checkpoint")
        except ModuleNotFoundError:
            mod = None
        rows = getattr(mod, "IMAGE_SPANS", {}).get(geometry.layout_id) if mod else None
        if rows is not None:
            if mod.REGIONS[geometry.layout_id] != regions(geometry):
                raise CopyError(
                    f"{geometry.layout_id}: generated regions differ from the geometry's"
                )
            cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
            lay = ImageLayout(
                geometry.layout_id,
                int(cols[5].sum()),
                mod.UNITS_PER_IMAGE[geometry.layout_id],
                geometry.page_unit_bytes,
                *cols,
            )
            if (
                lay.image_bytes != geometry.image_bytes
                or lay.units_per_image != geometry.units_per_image
            ):
                raise CopyError(
                    f"{geometry.layout_id}: generated span table does not match the geometry"
                )
            return lay
    return image_layout(geometry)


@dataclass(frozen=True)
class CopySpans:
    """A table of byte copies; every row moves ``nbytes`` from src to dst."""

    src_region: np.ndarray
    """int64 region id of the source."""
    src_offset: np.ndarray
    """int64 byte offset in the source region."""
    dst_region: np.ndarray
    """int64 region id of the destination."""
    dst_offset: np.ndarray
    """int64 byte offset in the destination region."""
    nbytes: np.ndarray
    """int64 bytes of each copy."""

    @property
    def total_bytes(self) -> int:
        """Bytes moved by the whole table."""
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.nbytes)

    @staticmethod
    def concat(tables: list[CopySpans]) -> CopySpans:
        """One table running ``tables`` in order."""
        if not tables:
            z = np.zeros(0, dtype=np.int64)
            return CopySpans(z, z, z, z, z)
        return CopySpans(*(np.concatenate([getattr(t, k) for t in tables]) for k in _COLS))


_COLS = ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes")


@dataclass(frozen=True)
class ImageOp:
    """Store a slot into an image's PAGE units, or restore an image into a slot."""

    slot: int
    """STATE slot read (store) or written (restore)."""
    units: tuple[int, ...]
    """PAGE ids holding the image, in unit order."""
    layout_id: str
    """Layout id the image was made under; must equal the pool's."""
    total_bytes: int
    """Image bytes; must equal the pool's ``image_bytes``."""


@dataclass(frozen=True)
class StateCopies:
    """One batch of STATE maintenance, drained before the batch's forward."""

    relocations: tuple[tuple[int, int], ...] = ()
    """``(src_slot, dst_slot)`` whole-entry moves (tails included: the request goes on)."""
    stores: tuple[ImageOp, ...] = ()
    """Slots copied into images."""
    restores: tuple[ImageOp, ...] = ()
    """Images copied into fresh slots (two restores of one image fork it)."""


@dataclass(frozen=True)
class CopySchedule:
    """The ordered phases of a ``StateCopies`` batch; run phase by phase, spans in any order
    within a phase."""

    regions: tuple[str, ...]
    """Region names the span region ids index."""
    phases: tuple[tuple[str, CopySpans], ...] = field(default=())
    """``(name, spans)``: ``relocate_snapshot``, ``relocate_copy``, ``store``, ``restore``."""
    snapshot_bytes: int = 0
    """Scratch bytes the ``snapshot`` region needs."""


class CopyPlanner:
    """Builds checked span tables for one pool (geometry, page and slot counts)."""

    def __init__(self, geometry, num_pages: int, num_slots: int, layout: ImageLayout | None = None):
        self.geometry = geometry
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.layout = layout or image_layout(geometry)
        if self.layout.layout_id != geometry.layout_id:
            raise CopyError(
                f"span table is for layout {self.layout.layout_id!r}, pool is "
                f"{geometry.layout_id!r}"
            )
        self.regions = regions(geometry)

    def _check_slot(self, slot: int, what: str) -> None:
        if not 0 <= slot < self.num_slots:
            raise CopyError(f"{what}: slot {slot} outside [0, {self.num_slots})")

    def check(self, op: ImageOp, what: str) -> np.ndarray:
        """Validate an image op against the pool; returns its units as an array."""
        g, lay = self.geometry, self.layout
        if op.layout_id != g.layout_id:
            raise CopyError(f"{what}: image layout {op.layout_id!r} != pool layout {g.layout_id!r}")
        if op.total_bytes != lay.image_bytes:
            raise CopyError(f"{what}: image of {op.total_bytes} B != {lay.image_bytes} B")
        units = np.asarray(op.units, dtype=np.int64)
        if len(units) != lay.units_per_image:
            raise CopyError(
                f"{what}: {len(units)} units given, an image takes {lay.units_per_image}"
            )
        if len(np.unique(units)) != len(units):
            raise CopyError(f"{what}: units {list(op.units)} are not distinct")
        if len(units) and (units.min() < 0 or units.max() >= self.num_pages):
            raise CopyError(f"{what}: a unit is outside [0, {self.num_pages})")
        self._check_slot(op.slot, what)
        return units

    def _image_spans(self, op: ImageOp, store: bool, what: str) -> CopySpans:
        lay = self.layout
        units = self.check(op, what)
        state = np.full(len(lay.nbytes), self.regions.index("state"), dtype=np.int64)
        state_off = op.slot * self.geometry.state_bytes + lay.state_offset
        unit_off = units[lay.unit] * lay.page_stride + lay.segment_offset
        if store:
            spans = CopySpans(state, state_off, lay.region, unit_off, lay.nbytes)
        else:
            spans = CopySpans(lay.region, unit_off, state, state_off, lay.nbytes)
        if spans.total_bytes != op.total_bytes:
            raise CopyError(f"{what}: spans move {spans.total_bytes} B, expected {op.total_bytes}")
        return spans

    def store(self, op: ImageOp) -> CopySpans:
        """Spans copying slot ``op.slot``'s image fields into ``op.units``."""
        return self._image_spans(op, True, f"store slot {op.slot}")

    def restore(self, op: ImageOp) -> CopySpans:
        """Spans copying the image in ``op.units`` into slot ``op.slot`` (tails left alone)."""
        return self._image_spans(op, False, f"restore slot {op.slot}")

    def fork(self, units: tuple[int, ...], slots: tuple[int, ...]) -> CopySpans:
        """Spans restoring one image into several slots."""
        if len(set(slots)) != len(slots):
            raise CopyError(f"fork: slots {list(slots)} are not distinct")
        g = self.geometry
        return CopySpans.concat(
            [self.restore(ImageOp(s, units, g.layout_id, g.image_bytes)) for s in slots]
        )

    def relocate(self, pairs: tuple[tuple[int, int], ...]) -> tuple[CopySpans, CopySpans]:
        """``(snapshot, copy)`` spans moving whole STATE entries ``src -> dst``.

        Every source is snapshotted before any destination is written, so swaps and chains
        read the pre-batch bytes.
        """
        sb = self.geometry.state_bytes
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise CopyError(f"relocate: destinations {dsts} are not distinct")
        for s, d in pairs:
            self._check_slot(s, "relocate source")
            self._check_slot(d, "relocate destination")
        n = len(pairs)
        i = np.arange(n, dtype=np.int64)
        src = np.array([s for s, _ in pairs], dtype=np.int64).reshape(n)
        dst = np.array(dsts, dtype=np.int64).reshape(n)
        state = np.full(n, self.regions.index("state"), dtype=np.int64)
        snap = np.full(n, self.regions.index("snapshot"), dtype=np.int64)
        size = np.full(n, sb, dtype=np.int64)
        return (
            CopySpans(state, src * sb, snap, i * sb, size),
            CopySpans(snap, i * sb, state, dst * sb, size.copy()),
        )

    def schedule(self, copies: StateCopies) -> CopySchedule:
        """The batch's ordered phases: relocations, then stores, then restores."""
        phases = []
        if copies.relocations:
            snap, move = self.relocate(copies.relocations)
            phases += [("relocate_snapshot", snap), ("relocate_copy", move)]
        if copies.stores:
            phases.append(("store", CopySpans.concat([self.store(op) for op in copies.stores])))
        if copies.restores:
            slots = [op.slot for op in copies.restores]
            if len(set(slots)) != len(slots):
                raise CopyError(f"restore: slots {slots} restored twice in one batch")
            phases.append(
                ("restore", CopySpans.concat([self.restore(op) for op in copies.restores]))
            )
        return CopySchedule(
            self.regions,
            tuple(phases),
            len(copies.relocations) * self.geometry.state_bytes,
        )


def apply_spans(
    buffers: dict[str, np.ndarray], region_names: tuple[str, ...], spans: CopySpans
) -> None:
    """Run a span table on flat uint8 numpy buffers keyed by region name (the CPU reference)."""
    for sr, so, dr, do, n in zip(*(getattr(spans, k).tolist() for k in _COLS), strict=True):
        buffers[region_names[dr]][do : do + n] = buffers[region_names[sr]][so : so + n]


def run_schedule(buffers: dict[str, np.ndarray], schedule: CopySchedule) -> None:
    """Run every phase of ``schedule`` in order on numpy buffers (allocating the snapshot)."""
    if schedule.snapshot_bytes:
        buffers.setdefault("snapshot", np.zeros(schedule.snapshot_bytes, dtype=np.uint8))
    for _, spans in schedule.phases:
        apply_spans(buffers, schedule.regions, spans)
