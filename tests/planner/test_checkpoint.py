"""Checkpoint copy schedules on numpy byte arrays."""

from __future__ import annotations

import numpy as np
import pytest

from tests.planner.helpers import spec
from v41plan.planner.checkpoint import (
    CopyError,
    CopyPlanner,
    ImageOp,
    StateCopies,
    apply_spans,
    image_layout,
    regions,
    run_schedule,
)

PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]
NUM_PAGES, NUM_SLOTS = 12, 6


def pool(g, seed=0):
    """Random bytes in every region of a small pool."""
    rng = np.random.default_rng(seed)
    bufs = {
        "state": rng.integers(0, 256, NUM_SLOTS * g.state_bytes, dtype=np.uint8),
        "page": rng.integers(0, 256, NUM_PAGES * g.page_bytes, dtype=np.uint8),
    }
    for p in g.planes:
        if p.kind != "main":
            bufs[p.name] = rng.integers(0, 256, NUM_PAGES * p.bytes_per_page, dtype=np.uint8)
    return bufs


def entry(bufs, g, slot):
    return bufs["state"][slot * g.state_bytes : (slot + 1) * g.state_bytes].copy()


def image_of(entry_bytes, g):
    """The image by definition: checkpoint fields with padding, end to end."""
    return np.concatenate(
        [
            entry_bytes[f.offset : f.offset + f.field_bytes]
            for f in g.state_fields
            if f.in_checkpoint
        ]
    )


def unit_stream(bufs, g, units):
    """Unit-major stream: main PAGE, then each index plane slice in plane order."""
    parts = []
    for u in units:
        parts.append(bufs["page"][u * g.page_bytes : (u + 1) * g.page_bytes])
        for p in sorted((p for p in g.planes if p.kind != "main"), key=lambda p: p.offset):
            parts.append(bufs[p.name][u * p.bytes_per_page : (u + 1) * p.bytes_per_page])
    return np.concatenate(parts)


def op(g, slot, units, **kw):
    return ImageOp(
        slot, tuple(units), kw.get("layout_id", g.layout_id), kw.get("total", g.image_bytes)
    )


@pytest.mark.parametrize("name", ["tiny", "deepseek_v41_flash"])
@pytest.mark.parametrize("pair", PAIRS)
def test_layout_covers_image_and_units_exactly_once(name, pair):
    g = spec(name).geometry(*pair)
    lay = image_layout(g)
    assert lay.nbytes.sum() == g.image_bytes and lay.units_per_image == g.units_per_image
    covered = np.zeros(g.state_bytes, dtype=np.int32)
    for off, n in zip(lay.state_offset, lay.nbytes, strict=True):
        covered[off : off + n] += 1
    for f in g.state_fields:
        want = 1 if f.in_checkpoint else 0
        assert (covered[f.offset : f.offset + f.field_bytes] == want).all(), f.name
    assert not any(f.in_checkpoint for f in g.state_fields if f.name.startswith("tail"))


@pytest.mark.parametrize("pair", PAIRS)
def test_store_writes_the_image_as_a_prefix_of_the_unit_stream(pair):
    g = spec("tiny").geometry(*pair)
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    bufs = pool(g)
    before = {k: v.copy() for k, v in bufs.items()}
    units = [7, 2][: g.units_per_image] + list(range(8, 8 + g.units_per_image - 2))
    spans = cp.store(op(g, 3, units))
    assert spans.total_bytes == g.image_bytes
    apply_spans(bufs, regions(g), spans)
    stream = unit_stream(bufs, g, units)
    assert (stream[: g.image_bytes] == image_of(entry(before, g, 3), g)).all()
    # The rest of the last unit, other pages and every STATE entry are untouched.
    assert (stream[g.image_bytes :] == unit_stream(before, g, units)[g.image_bytes :]).all()
    other = [u for u in range(NUM_PAGES) if u not in units]
    assert (unit_stream(bufs, g, other) == unit_stream(before, g, other)).all()
    assert (bufs["state"] == before["state"]).all()


@pytest.mark.parametrize("pair", PAIRS)
def test_restore_into_a_fresh_slot_keeps_its_tails(pair):
    g = spec("tiny").geometry(*pair)
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    bufs = pool(g, seed=1)
    src = entry(bufs, g, 0)
    units = list(range(4, 4 + g.units_per_image))
    apply_spans(bufs, regions(g), cp.store(op(g, 0, units)))
    dst_before = entry(bufs, g, 5)
    apply_spans(bufs, regions(g), cp.restore(op(g, 5, units)))
    dst = entry(bufs, g, 5)
    for f in g.state_fields:
        seg = slice(f.offset, f.offset + f.field_bytes)
        want = src[seg] if f.in_checkpoint else dst_before[seg]
        assert (dst[seg] == want).all(), f.name


def test_fork_restores_one_image_into_two_slots():
    g = spec("tiny").geometry()
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    bufs = pool(g, seed=2)
    units = (1, 9)
    apply_spans(bufs, regions(g), cp.store(op(g, 2, units)))
    img = image_of(entry(bufs, g, 2), g)
    spans = cp.fork(units, (3, 4))
    assert spans.total_bytes == 2 * g.image_bytes
    apply_spans(bufs, regions(g), spans)
    assert (image_of(entry(bufs, g, 3), g) == img).all() and (
        image_of(entry(bufs, g, 4), g) == img
    ).all()
    with pytest.raises(CopyError, match="not distinct"):
        cp.fork(units, (3, 3))


@pytest.mark.parametrize(
    "pairs",
    [((0, 1), (1, 0)), ((0, 1), (1, 2), (2, 3)), ((3, 0), (0, 3), (1, 5)), ((4, 4),)],
    ids=["swap", "chain", "swap+move", "self"],
)
def test_relocation_snapshots_before_copying(pairs):
    g = spec("tiny").geometry()
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    bufs = pool(g, seed=3)
    before = [entry(bufs, g, s) for s in range(NUM_SLOTS)]
    sched = cp.schedule(StateCopies(relocations=pairs))
    assert [name for name, _ in sched.phases] == ["relocate_snapshot", "relocate_copy"]
    run_schedule(bufs, sched)
    moved = {d for _, d in pairs}
    for s, d in pairs:
        assert (entry(bufs, g, d) == before[s]).all()  # whole entry, tails included
    for s in range(NUM_SLOTS):
        if s not in moved:
            assert (entry(bufs, g, s) == before[s]).all()


def test_batch_order_relocations_then_stores_then_restores():
    g = spec("tiny").geometry()
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    bufs = pool(g, seed=4)
    before = [entry(bufs, g, s) for s in range(NUM_SLOTS)]
    units = (10, 11)
    # Relocate 0 -> 1, store slot 1 (now slot 0's bytes), restore that image into slot 2: all
    # in one batch. Listed out of order on purpose: the schedule orders them.
    copies = StateCopies(
        restores=(op(g, 2, units),),
        stores=(op(g, 1, units),),
        relocations=((0, 1),),
    )
    sched = cp.schedule(copies)
    assert [n for n, _ in sched.phases] == [
        "relocate_snapshot",
        "relocate_copy",
        "store",
        "restore",
    ]
    run_schedule(bufs, sched)
    assert (image_of(entry(bufs, g, 2), g) == image_of(before[0], g)).all()
    assert (unit_stream(bufs, g, units)[: g.image_bytes] == image_of(before[0], g)).all()


@pytest.mark.parametrize(
    ("kw", "units", "slot", "match"),
    [
        ({"layout_id": "v41plan-other"}, (1, 2), 0, "layout"),
        ({"total": 123}, (1, 2), 0, "image of 123 B"),
        ({}, (1,), 0, "1 units given"),
        ({}, (1, 1), 0, "not distinct"),
        ({}, (1, NUM_PAGES), 0, "outside"),
        ({}, (1, 2), NUM_SLOTS, "slot"),
    ],
)
def test_mismatched_ops_are_refused(kw, units, slot, match):
    g = spec("tiny").geometry()
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    with pytest.raises(CopyError, match=match):
        cp.store(op(g, slot, units, **kw))
    with pytest.raises(CopyError, match=match):
        cp.schedule(StateCopies(restores=(op(g, slot, units, **kw),)))


def test_relocation_and_layout_checks():
    g = spec("tiny").geometry()
    cp = CopyPlanner(g, NUM_PAGES, NUM_SLOTS)
    with pytest.raises(CopyError, match="destinations"):
        cp.relocate(((0, 2), (1, 2)))
    with pytest.raises(CopyError, match="slot 9"):
        cp.relocate(((9, 2),))
    with pytest.raises(CopyError, match="restored twice"):
        cp.schedule(StateCopies(restores=(op(g, 1, (1, 2)), op(g, 1, (3, 4)))))
    other = spec("tiny").geometry("fp4", "fp4")
    with pytest.raises(CopyError, match="span table is for layout"):
        CopyPlanner(g, NUM_PAGES, NUM_SLOTS, layout=image_layout(other))
