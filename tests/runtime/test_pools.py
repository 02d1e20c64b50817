"""Pools: sizes from the geometry only, disjoint typed views, addressing as pure functions."""

from __future__ import annotations

import pytest
import torch

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.runtime.pools import Pools, compressed_row_address, ring_row_address

PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]


@pytest.fixture(scope="module")
def tiny(specs_dir):
    return load_cache_spec_unchecked(str(specs_dir / "tiny.yaml"))


def _views(p: Pools):
    vs = [p.rings, p.tail_values, p.tail_scores, p.cursor]
    vs += list(p.main.values()) + list(p.index.values()) + list(p.index_scales.values())
    if not p.index:
        vs += list(p.index_values.values())
    return vs


@pytest.mark.parametrize("pair", PAIRS)
def test_views_are_disjoint_and_sized_by_geometry(tiny, pair):
    g = tiny.geometry(*pair)
    p = Pools(g, num_pages=5, num_slots=3)
    owner_bytes = {v.data_ptr() for v in _views(p)}
    assert len(owner_bytes) == len(_views(p))
    # every view's bytes, marked one by one, never overlap another's
    seen = torch.zeros_like(p.backing, dtype=torch.int32)
    for v in _views(p):
        p.backing.zero_()
        v.view(torch.uint8).fill_(1) if v.dtype != torch.uint8 else v.fill_(1)
        seen += p.backing.int()
    assert int(seen.max()) == 1
    # sizes come from the geometry: rows per page, row bytes, state fields
    for pl in g.planes:
        if pl.kind == "main":
            t = p.main[pl.owner]
            assert t.shape[:2] == (6, pl.rows_per_page)
            assert t.shape[2] * t.element_size() == pl.row_bytes
    assert p.rings.shape[1:] == tuple(g.state_field("swa_rings").shape)
    assert p.cursor.shape == (4, 1 + tiny.dims.engram_max_ngram_size - 1)


@pytest.mark.parametrize("pair", PAIRS)
def test_byte_addresses_follow_the_geometry(tiny, pair):
    g = tiny.geometry(*pair)
    p = Pools(g, num_pages=4, num_slots=2)
    for pl in g.planes:
        if pl.kind != "main":
            continue
        page, row = 3, pl.rows_per_page - 1
        p.backing.zero_()
        p.main[pl.owner][page, row].view(torch.uint8)[0] = 7
        addr = page * g.page_bytes + pl.region_offset + row * pl.row_bytes
        assert int(p.backing[addr]) == 7 and int(p.backing.sum()) == 7
    f = g.state_field("swa_rings")
    slot, layer, r = 1, 5, 3
    p.backing.zero_()
    p.rings[slot, layer, r].view(torch.uint8)[0] = 9
    addr = (
        p.state_region[0]
        + slot * g.state_bytes
        + f.offset
        + (layer * g.ring_rows + r) * g.ring_row_bytes
    )
    assert int(p.backing[addr]) == 9
    c = g.state_field("cursor")
    p.cursor[1, 2] = 258
    addr = p.state_region[0] + g.state_bytes + c.offset + 16
    assert p.backing[addr : addr + 8].view(torch.int64).item() == 258


def test_compressed_row_address_uses_the_block_table_and_sinks_sentinels():
    table = torch.tensor([[7, 3, 5, -1], [2, 0, -1, -1]])
    batch = torch.tensor([0, 0, 0, 1, -1, 0, 1])
    row = torch.tensor([0, 17, 40, 15, 3, -1, 40])
    a = compressed_row_address(table, batch, row, rows_per_page=16, sink_page=99)
    assert a.page.tolist() == [7, 3, 5, 2, 99, 99, 99]
    assert a.row.tolist() == [0, 1, 8, 15, 0, 0, 0]


def test_ring_address_is_position_mod_ring_rows():
    slot, r = ring_row_address(torch.tensor([2, 0, -1]), torch.tensor([13, 7, 5]), 8, sink_slot=4)
    assert slot.tolist() == [2, 0, 4] and r.tolist() == [5, 7, 0]


def test_reset_slot_marks_history_dead(tiny):
    p = Pools(tiny.geometry(), num_pages=2, num_slots=2)
    p.backing.fill_(3)
    p.reset_slot(1)
    assert p.cursor[1].tolist() == [0, -1, -1, -1]
    assert int(p.rings[1].float().abs().sum()) == 0 and int(p.state[0].min()) == 3


@pytest.mark.parametrize("pair", PAIRS)
def test_checkpoint_image_moves_rings_and_cursor_but_not_tails(tiny, pair):
    from v41plan.runtime.kernels.torch_ref import TorchBackend

    g = tiny.geometry(*pair)
    p = Pools(g, num_pages=6, num_slots=3)
    torch.manual_seed(0)
    p.backing.copy_(torch.randint(0, 256, p.backing.shape, dtype=torch.uint8))
    pages = torch.tensor([5, 2, 0][: g.units_per_image])
    src_state, units = p.image_addresses(1, pages)
    assert units.unique().numel() == units.numel() == g.image_bytes
    other = p.backing.clone()
    k = TorchBackend()
    k.copy_image(p.backing, src_state, units)  # store slot 1 into PAGE units
    rings, cursor = p.rings[1].clone(), p.cursor[1].clone()
    tails = p.tail_values[2].clone(), p.tail_scores[2].clone()
    dst_state, units2 = p.image_addresses(2, pages)
    k.copy_image(p.backing, units2, dst_state)  # restore into slot 2
    assert torch.equal(p.rings[2].view(torch.uint8), rings.view(torch.uint8))
    assert torch.equal(p.cursor[2], cursor)
    assert torch.equal(p.tail_values[2].view(torch.uint8), tails[0].view(torch.uint8))
    assert torch.equal(p.tail_scores[2].view(torch.uint8), tails[1].view(torch.uint8))
    # the store touched only the image's units, nothing of another page or slot
    touched = torch.zeros_like(p.backing, dtype=torch.bool)
    touched[units] = True
    touched[dst_state] = True
    assert torch.equal(p.backing[~touched], other[~touched])


@pytest.mark.parametrize("pair", PAIRS)
def test_planner_store_spans_address_the_image_bytes(tiny, pair):
    from v41plan.planner.checkpoint import CopyPlanner, ImageOp

    g = tiny.geometry(*pair)
    p = Pools(g, num_pages=6, num_slots=3)
    units = (5, 2)[: g.units_per_image]
    cp = CopyPlanner(g, 6, 3)
    src, dst = p.span_addresses(cp.regions, cp.store(ImageOp(2, units, g.layout_id, g.image_bytes)))
    state, unit = p.image_addresses(2, torch.tensor(units))
    assert torch.equal(src, state) and torch.equal(dst, unit)
