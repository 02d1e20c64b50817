"""Triton scatters: ring write, main-plane store, index-key store, compressor tails, cursor.

One program per row. A row whose sentinel says it writes nothing (slot / page -1, ``keep``
false, a position below its write bound) returns before touching memory, and no kernel ever
writes the sink page or slot: the torch reference writes the sink's own bytes back there, so
both leave every byte as it was. Each kernel packs exactly as the codecs of ``torch_ref`` do
(see ``triton_common`` for why the rounding is done on bit patterns).
"""

from __future__ import annotations

import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import (
    bf16_bits,
    e2m1_code,
    e4m3_code,
    pow2,
    pow2ceil_exponent,
    round_e2m1,
    round_e4m3,
)


@triton.jit
def ring_write_kernel(
    ring_ptr,
    s_ring_slot,
    s_ring_row,
    kv_ptr,
    s_kv,
    slot_ptr,
    pos_ptr,
    write_from_ptr,
    sink_slot,
    ring_rows,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    """Row ``t`` of ``kv [T, D]`` into ``ring[slot, pos mod R]``: bf16 bits (``ring_ptr`` an
    int16 view) or E4M3 codes then E8M0 exponents per 32 lanes."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t)
    write_from = tl.load(write_from_ptr + t)
    keep = (slot >= 0) & (slot != sink_slot) & (pos >= 0) & (pos >= write_from)
    if keep:
        base = ring_ptr + slot * s_ring_slot + (pos % ring_rows) * s_ring_row
        if FP8:
            NB: tl.constexpr = BLOCK_D // 32
            blk = tl.arange(0, NB)
            lane = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
            x = tl.load(kv_ptr + t * s_kv + lane, mask=lane < D, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            e = pow2ceil_exponent(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
            codes = e4m3_code(round_e4m3(x * pow2(127 - e)[:, None]))
            tl.store(base + lane, codes.to(tl.uint8), mask=lane < D)
            tl.store(base + D + blk, e.to(tl.uint8), mask=blk < D // 32)
        else:
            d = tl.arange(0, BLOCK_D)
            x = tl.load(kv_ptr + t * s_kv + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(base + d, bf16_bits(x), mask=d < D)


@triton.jit
def main_scatter_kernel(
    plane_ptr,
    s_page,
    s_row,
    lat_ptr,
    s_lat,
    page_ptr,
    row_ptr,
    keep_ptr,
    sink_page,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP4: tl.constexpr,
):
    """Row ``t`` of ``latent [T, D]`` into ``plane[page, row]``: bf16 bits (``plane_ptr`` an int16
    view) or packed E2M1 (even lane in the low nibble) then E4M3 scales per 16 lanes."""
    t = tl.program_id(0)
    page = tl.load(page_ptr + t)
    row = tl.load(row_ptr + t)
    keep = tl.load(keep_ptr + t) != 0
    keep = keep & (page >= 0) & (page != sink_page) & (row >= 0)
    if keep:
        base = plane_ptr + page * s_page + row * s_row
        if FP4:
            NB: tl.constexpr = BLOCK_D // 16
            blk = tl.arange(0, NB)
            lane = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
            x = tl.load(lat_ptr + t * s_lat + lane, mask=lane < D, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            s = round_e4m3(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), 6.0))
            codes = e2m1_code(round_e2m1(tl.math.div_rn(x, s[:, None])))
            lo, hi = tl.split(tl.reshape(codes, (BLOCK_D // 2, 2)))
            j = tl.arange(0, BLOCK_D // 2)
            tl.store(base + j, (lo | (hi << 4)).to(tl.uint8), mask=j < D // 2)
            tl.store(base + D // 2 + blk, e4m3_code(s).to(tl.uint8), mask=blk < D // 16)
        else:
            d = tl.arange(0, BLOCK_D)
            x = tl.load(lat_ptr + t * s_lat + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(base + d, bf16_bits(x), mask=d < D)


@triton.jit
def index_key_store_kernel(
    plane_ptr,
    s_page,
    s_row,
    scale_plane_ptr,
    s_scale_page,
    s_scale_row,
    key_ptr,
    s_key,
    key_scale_ptr,
    s_key_scale,
    page_ptr,
    row_ptr,
    keep_ptr,
    sink_page,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP4: tl.constexpr,
):
    """Index key row ``t``: fp8, E4M3 codes then the fp32 row scale in one plane; fp4, packed
    E2M1 in the values plane and E8M0 exponents per 32 lanes in the scales plane."""
    t = tl.program_id(0)
    page = tl.load(page_ptr + t)
    row = tl.load(row_ptr + t)
    keep = tl.load(keep_ptr + t) != 0
    keep = keep & (page >= 0) & (page != sink_page) & (row >= 0)
    if keep:
        base = plane_ptr + page * s_page + row * s_row
        if FP4:
            NB: tl.constexpr = BLOCK_D // 32
            blk = tl.arange(0, NB)
            lane = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
            x = tl.load(key_ptr + t * s_key + lane, mask=lane < D, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            e = pow2ceil_exponent(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0))
            codes = e2m1_code(round_e2m1(x * pow2(127 - e)[:, None]))
            lo, hi = tl.split(tl.reshape(codes, (BLOCK_D // 2, 2)))
            j = tl.arange(0, BLOCK_D // 2)
            tl.store(base + j, (lo | (hi << 4)).to(tl.uint8), mask=j < D // 2)
            sbase = scale_plane_ptr + page * s_scale_page + row * s_scale_row
            tl.store(sbase + blk, e.to(tl.uint8), mask=blk < D // 32)
        else:
            d = tl.arange(0, BLOCK_D)
            x = tl.load(key_ptr + t * s_key + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(base + d, e4m3_code(round_e4m3(x)).to(tl.uint8), mask=d < D)
            sc = tl.load(key_scale_ptr + t * s_key_scale).to(tl.float32)
            tl.store((base + D).to(tl.pointer_type(tl.float32)), sc)


@triton.jit
def compress_pairs_kernel(
    values_ptr,
    scores_ptr,
    s_in,
    slot_ptr,
    first_ptr,
    tail_v_ptr,
    tail_s_ptr,
    s_tail,
    pair_v_ptr,
    pair_s_ptr,
    s_pair,
    sink_slot,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Pair row ``t`` with the group's first member: the slot's FP32 tail where ``first`` is set,
    else row ``t - 1`` of the forward (``pair [T, 2, D]``)."""
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    slot = tl.load(slot_ptr + t)
    slot = tl.where(slot >= 0, slot, sink_slot)
    first = tl.load(first_ptr + t) != 0
    prev = tl.maximum(t - 1, 0)
    v1 = tl.load(values_ptr + t * s_in + d, mask=m)
    s1 = tl.load(scores_ptr + t * s_in + d, mask=m)
    if first:
        v0 = tl.load(tail_v_ptr + slot * s_tail + d, mask=m)
        s0 = tl.load(tail_s_ptr + slot * s_tail + d, mask=m)
    else:
        v0 = tl.load(values_ptr + prev * s_in + d, mask=m)
        s0 = tl.load(scores_ptr + prev * s_in + d, mask=m)
    tl.store(pair_v_ptr + t * s_pair + d, v0, mask=m)
    tl.store(pair_v_ptr + t * s_pair + D + d, v1, mask=m)
    tl.store(pair_s_ptr + t * s_pair + d, s0, mask=m)
    tl.store(pair_s_ptr + t * s_pair + D + d, s1, mask=m)


@triton.jit
def tail_store_kernel(
    values_ptr,
    scores_ptr,
    s_in,
    slot_ptr,
    pos_ptr,
    last_ptr,
    tail_v_ptr,
    tail_s_ptr,
    s_tail,
    sink_slot,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Store row ``t`` (the first member of a group still open at the forward's end) into its
    slot's FP32 tail. Runs after ``compress_pairs_kernel``, which reads the old tails."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t)
    keep = (tl.load(last_ptr + t) != 0) & (pos % 2 == 0) & (slot >= 0) & (slot != sink_slot)
    if keep:
        d = tl.arange(0, BLOCK_D)
        m = d < D
        tl.store(tail_v_ptr + slot * s_tail + d, tl.load(values_ptr + t * s_in + d, mask=m), mask=m)
        tl.store(tail_s_ptr + slot * s_tail + d, tl.load(scores_ptr + t * s_in + d, mask=m), mask=m)


@triton.jit
def cursor_write_kernel(
    cursor_ptr,
    s_cursor,
    values_ptr,
    s_values,
    slot_ptr,
    sink_slot,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Request ``b``'s ``[position, history...]`` into its slot's cursor; slot -1 skipped."""
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b)
    if (slot >= 0) & (slot != sink_slot):
        j = tl.arange(0, BLOCK)
        v = tl.load(values_ptr + b * s_values + j, mask=j < WIDTH)
        tl.store(cursor_ptr + slot * s_cursor + j, v.to(tl.int64), mask=j < WIDTH)
