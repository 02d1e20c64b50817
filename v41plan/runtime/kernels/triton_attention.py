"""Triton sparse attention: each query row over its window and its selected compressed rows,
reading the ring and the main plane in place (MQA: one latent is key and value for every head).

Program ``(i, hb, s)`` runs query row ``i``, heads ``[hb * HB, (hb + 1) * HB)`` and split ``s`` of
its key blocks: ``ceil(W / BN)`` window blocks (ring rows below the row's ``ring_until``, this
forward's rows above it) then ``ceil(K / BN)`` selected blocks. Each key block is loaded once,
decoded to the dot's operand type in registers (bf16 ring or E4M3 + E8M0/32; bf16 main rows or
E2M1 + E4M3/16) and used for both products, for all the program's heads. A block with no valid
key is skipped. The online softmax starts from the per-head sink (it adds ``exp(sink)`` to the
denominator only) in the split that holds the first block; with several splits (few rows: the
flash-decoding split over keys) each split writes its unnormalised partial output and its
``(max, sum)``, and ``combine_kernel`` merges them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import (
    bf16_bits,
    div_rn,
    e2m1_value,
    e4m3_value,
    e8m0_value,
    pdl_enter,
)

LOG2E = 1.4426950408889634


@triton.jit
def _online(
    q, k, v, valid, m, l, acc, qk_scale, DOT_BF16: tl.constexpr, F32_DOT: tl.constexpr
):  # fmt: skip
    """One key block of the online softmax (base-2 logits ``q . k * scale * log2 e``); ``v``:
    the block's value columns this program accumulates (``k`` itself when it holds them all)."""
    if DOT_BF16:
        kd = k.to(tl.bfloat16)
        vd = v.to(tl.bfloat16)
        s = tl.dot(q, tl.trans(kd))
    else:
        kd = k
        vd = v.to(tl.float32)
        s = tl.dot(q, tl.trans(kd), input_precision=F32_DOT)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_BF16:
        pv = tl.dot(p.to(tl.bfloat16), vd)
    else:
        pv = tl.dot(p, vd, input_precision=F32_DOT)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


@triton.jit
def _sel_ids(id_row, s, n_s, BN: tl.constexpr, KSEL: tl.constexpr):
    """Ids of selected block ``s`` (-1 past the ids or past block ``n_s``)."""
    jj = s * BN + tl.arange(0, BN)
    return tl.load(id_row + jj, mask=(jj < KSEL) & (s < n_s), other=-1).to(tl.int32)


@triton.jit
def _sel_pages(pg_row, c, RPP, P):
    """The page of each id (-1 for a -1 id)."""
    col = tl.minimum(tl.maximum(c, 0) // RPP, P - 1)
    return tl.load(pg_row + col, mask=c >= 0, other=-1)


@triton.jit
def _sel_fp4_raw(plane_ptr, s_plane_page, s_plane_row, c, page, RPP, D: tl.constexpr):
    """FP4 main rows as stored: each lane's byte (two lanes share one) and its E4M3 scale."""
    d = tl.arange(0, D)
    cc = tl.maximum(c, 0)
    vm = ((c >= 0) & (page >= 0))[:, None]
    pbase = plane_ptr + page * s_plane_page + (cc % RPP) * s_plane_row
    byte = tl.load(pbase[:, None] + d[None, :] // 2, mask=vm, other=0)
    sc = tl.load(pbase[:, None] + D // 2 + d[None, :] // 16, mask=vm, other=0)
    return byte, sc


@triton.jit
def _fp4_keys(byte, sc, D: tl.constexpr, DOT_BF16: tl.constexpr):
    """Decoded FP4 keys ``[BN, D]`` (each lane's nibble times its scale)."""
    d = tl.arange(0, D)
    nib = (byte.to(tl.int32) >> ((d[None, :] & 1) * 4)) & 15
    k = e2m1_value(nib) * e4m3_value(sc)
    if DOT_BF16:
        k = k.to(tl.bfloat16)
    return k


@triton.jit
def _sel_keys(
    plane_ptr,
    s_plane_page,
    s_plane_row,
    c,
    page,
    RPP,
    D: tl.constexpr,
    PLANE_FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """Keys ``[BN, D]`` of ids ``c`` on ``page`` in the dot's operand type (zeros where invalid)."""
    if PLANE_FP4:
        byte, sc = _sel_fp4_raw(plane_ptr, s_plane_page, s_plane_row, c, page, RPP, D)
        k = _fp4_keys(byte, sc, D, DOT_BF16)
    else:
        d = tl.arange(0, D)
        cc = tl.maximum(c, 0)
        vm = ((c >= 0) & (page >= 0))[:, None]
        pbase = plane_ptr + page * s_plane_page + (cc % RPP) * s_plane_row
        k = tl.load(pbase[:, None] + d[None, :], mask=vm, other=0.0)
        if not DOT_BF16:
            k = k.to(tl.float32)
    return k


@triton.jit
def sparse_attention_kernel(
    q_ptr,
    s_q_row,
    s_q_head,
    sink_ptr,
    out_ptr,
    s_out_row,
    s_out_head,
    ring_ptr,
    s_ring_slot,
    s_ring_row,
    kv_ptr,
    s_kv_row,
    rows_ptr,
    slot_ptr,
    pos_ptr,
    window_lo_ptr,
    ring_until_ptr,
    plane_ptr,
    s_plane_page,
    s_plane_row,
    ids_ptr,
    s_ids_row,
    pages_ptr,
    s_pages_row,
    part_o_ptr,
    part_ml_ptr,
    qk_scale,
    H,
    ring_rows,
    n_kv_rows,
    P,
    RPP,
    KSEL: tl.constexpr,
    KSEL_P2: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    BN: tl.constexpr,
    W: tl.constexpr,
    RING_FP8: tl.constexpr,
    PLANE_FP4: tl.constexpr,
    HAS_PLANE: tl.constexpr,
    SPLITS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    DOT_BF16: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
    DV: tl.constexpr,
    RESOLVE: tl.constexpr = False,
    BALANCE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Attention of query row ``i`` (see the module docstring). ``out [Tq, H, D]`` in the query's
    dtype (``out_ptr`` an int16 view for bf16); with ``SPLITS > 1`` the partials go to
    ``part_o [Tq, SPLITS, H, D]`` and ``part_ml [Tq, SPLITS, H, 2]`` instead. Each selected
    block's keys sit behind two dependent loads (its ids, their pages); ``PREFETCH`` 1 loads
    ids and pages blocks ahead, so a block waits on its keys alone, and 2 loads the keys a
    block ahead too (0: no pipeline). ``DV`` < ``D`` (PREFETCH 0): the program accumulates
    output columns ``[dv * DV, (dv + 1) * DV)`` only (axis 1 is ``hb * (D // DV) + dv``): every
    program computes the whole logits, and its accumulator is ``[HB, DV]`` (``DV = D``: all).
    ``RESOLVE`` (PREFETCH 0, DV = D): the program first turns every selected id of its row into
    the row's offset in the plane (its page through ``pages``; in 16-element units, both plane
    strides multiples of 16) and holds them in registers; a selected block's offsets are then a
    register gather, not two dependent loads, so the pipeliner can keep the next block's keys in
    flight (at three stages). The same blocks, keys and order as without it: the same bits.
    ``BALANCE`` (with ``SPLITS > 1``): split ``sp`` takes an equal share of the row's own key
    blocks (its visible window's, then its selected ids'), not a fixed share of every block the
    shapes allow, so a short context's few blocks spread over the splits (the same keys; the
    merge's float32 sums differ by rounding)."""
    pdl_enter(PDL)
    i = tl.program_id(0)
    NDV: tl.constexpr = D // DV
    VW: tl.constexpr = DV
    hb = tl.program_id(1) // NDV
    dvi = tl.program_id(1) % NDV
    sp = tl.program_id(2)
    h = hb * HB + tl.arange(0, HB)
    hm = h < H
    d = tl.arange(0, D)
    dv = dvi * VW + tl.arange(0, VW)
    q = tl.load(
        q_ptr + i * s_q_row + h[:, None] * s_q_head + d[None, :], mask=hm[:, None], other=0.0
    )
    if DOT_BF16:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float32)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slot_ptr + i)
    pos = tl.load(pos_ptr + i)
    lo = tl.maximum(tl.maximum(tl.load(window_lo_ptr + i), pos - (W - 1)), 0)
    ring_until = tl.load(ring_until_ptr + i)

    NWB: tl.constexpr = (W + BN - 1) // BN
    NSB: tl.constexpr = (KSEL + BN - 1) // BN
    # window blocks from the first holding a visible position (none without a slot)
    first = pos - (W - 1)
    w_from = tl.where(slot >= 0, tl.maximum(lo - first, 0) // BN, NWB)
    if HAS_PLANE and BALANCE:  # the ids before the window loop: their count sets the shares
        jall = tl.arange(0, KSEL_P2)
        call = tl.load(ids_ptr + i * s_ids_row + jall, mask=jall < KSEL, other=-1)
        n_sel = tl.max(tl.where(call >= 0, jall + 1, 0), axis=0)
    if BALANCE:
        # the row's own blocks (its visible window's, then its selected ids') in equal shares
        b_end = NWB
        if HAS_PLANE:
            b_end = NWB + (n_sel + BN - 1) // BN
        per = (b_end - w_from + SPLITS - 1) // SPLITS
        b_lo = w_from + sp * per
        b_hi = b_lo + per
    else:
        PER: tl.constexpr = (NWB + NSB + SPLITS - 1) // SPLITS
        b_lo = sp * PER
        b_hi = b_lo + PER

    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    if sp == 0:
        m = sink
        l = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m = tl.full((HB,), float("-inf"), tl.float32)
        l = tl.zeros((HB,), dtype=tl.float32)
    acc = tl.zeros((HB, VW), dtype=tl.float32)

    for b in range(tl.maximum(b_lo, w_from), tl.minimum(b_hi, NWB)):
        j = b * BN + tl.arange(0, BN)
        kp = first + j
        valid = (j < W) & (kp >= lo)
        from_ring = kp < ring_until
        # positions fit 32 bits: a 32-bit remainder (the 64-bit one is a called routine)
        rbase = ring_ptr + slot * s_ring_slot + (kp.to(tl.int32) % ring_rows) * s_ring_row
        frow = tl.minimum(tl.maximum(row - (pos - kp), 0), n_kv_rows - 1)
        fbase = kv_ptr + frow * s_kv_row
        if ring_ptr.dtype == kv_ptr.dtype and q_ptr.dtype.element_ty == tl.bfloat16:
            # one tile, each key's row from the ring or this forward's rows: two masked tiles
            # merged in registers left the wgmma accumulator short of registers (at 64 heads
            # ptxas serialized every wgmma of the kernel). Not for fp32 queries: with fp32
            # dots at tf32x3 ptxas then fell to 32 registers and twice the spills. (The
            # interpreter's fp32 dots run this path too: bf16 keys widen exactly.)
            kbase = tl.where(from_ring, rbase, fbase)
            k = tl.load(kbase[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if VW == D:
                v = k
            else:  # this program's columns again (from L1: the same rows)
                v = tl.load(kbase[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
            if not DOT_BF16:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
        else:
            rmask = (valid & from_ring)[:, None]
            if RING_FP8:
                codes = tl.load(rbase[:, None] + d[None, :], mask=rmask, other=0)
                sb = tl.load(rbase[:, None] + D + d[None, :] // 32, mask=rmask, other=127)
                kr = e4m3_value(codes) * e8m0_value(sb)
            else:
                kr = tl.load(rbase[:, None] + d[None, :], mask=rmask, other=0.0)
            fmask = (valid & ~from_ring)[:, None]
            kf = tl.load(fbase[:, None] + d[None, :], mask=fmask, other=0.0)
            # to the dot's type at once (exact: every key is on a grid bf16 holds), half the
            # registers of fp32 for bf16 dots
            if DOT_BF16:
                k = tl.where(from_ring[:, None], kr.to(tl.bfloat16), kf.to(tl.bfloat16))
            else:
                k = tl.where(from_ring[:, None], kr.to(tl.float32), kf.to(tl.float32))
            if VW == D:
                v = k
            else:
                if RING_FP8:
                    vcodes = tl.load(rbase[:, None] + dv[None, :], mask=rmask, other=0)
                    vsb = tl.load(rbase[:, None] + D + dv[None, :] // 32, mask=rmask, other=127)
                    vr = e4m3_value(vcodes) * e8m0_value(vsb)
                else:
                    vr = tl.load(rbase[:, None] + dv[None, :], mask=rmask, other=0.0)
                vf = tl.load(fbase[:, None] + dv[None, :], mask=fmask, other=0.0)
                if DOT_BF16:
                    v = tl.where(from_ring[:, None], vr.to(tl.bfloat16), vf.to(tl.bfloat16))
                else:
                    v = tl.where(from_ring[:, None], vr.to(tl.float32), vf.to(tl.float32))
        m, l, acc = _online(q, k, v, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)

    if HAS_PLANE:
        # selected blocks up to the one holding the last id (-1 padding costs nothing)
        if not BALANCE:
            jall = tl.arange(0, KSEL_P2)
            call = tl.load(ids_ptr + i * s_ids_row + jall, mask=jall < KSEL, other=-1)
            n_sel = tl.max(tl.where(call >= 0, jall + 1, 0), axis=0)
        s_hi = NWB + (n_sel + BN - 1) // BN
        sb0 = tl.maximum(b_lo, NWB)
        sb1 = tl.minimum(b_hi, s_hi)
        if RESOLVE:
            # every selected id's row offset in the plane, once, held in registers; a block's
            # offsets are a register gather, so its key copy's address waits on no load of the
            # loop (16-element units: the launcher checks both strides divide, so the row
            # starts are known 16-aligned and the key loads stay 16-byte asynchronous copies)
            cv = call.to(tl.int32)
            ca = tl.maximum(cv, 0)
            pg = tl.load(
                pages_ptr + i * s_pages_row + tl.minimum(ca // RPP, P - 1), mask=cv >= 0, other=-1
            ).to(tl.int32)
            off = pg.to(tl.int64) * (s_plane_page // 16) + (ca % RPP) * (s_plane_row // 16)
            off = tl.where((cv >= 0) & (pg >= 0), off, -1)
            for b in range(sb0, sb1):
                jj = (b - NWB) * BN + tl.arange(0, BN)
                o = tl.gather(off, tl.minimum(jj, KSEL_P2 - 1), 0)
                valid = (o >= 0) & (jj < KSEL_P2)
                kbase = plane_ptr + tl.maximum(o, 0) * 16
                vm = valid[:, None]
                if PLANE_FP4:
                    byte = tl.load(kbase[:, None] + d[None, :] // 2, mask=vm, other=0)
                    sc = tl.load(kbase[:, None] + D // 2 + d[None, :] // 16, mask=vm, other=0)
                    k = _fp4_keys(byte, sc, D, DOT_BF16)
                else:
                    k = tl.load(kbase[:, None] + d[None, :], mask=vm, other=0.0)
                    if not DOT_BF16:
                        k = k.to(tl.float32)
                m, l, acc = _online(q, k, k, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)
        elif PREFETCH == 0:
            for b in range(sb0, sb1):
                jj = (b - NWB) * BN + tl.arange(0, BN)
                # ids and pages fit 32 bits: 32-bit arithmetic (a 64-bit division is a called
                # routine, and the 64-bit values spilled), the page's offset in 64
                c = tl.load(ids_ptr + i * s_ids_row + jj, mask=jj < KSEL, other=-1).to(tl.int32)
                valid = c >= 0
                cc = tl.maximum(c, 0)
                col = tl.minimum(cc // RPP, P - 1)
                page = tl.load(pages_ptr + i * s_pages_row + col, mask=valid, other=-1)
                page = page.to(tl.int32)
                valid = valid & (page >= 0)
                pbase = plane_ptr + page.to(tl.int64) * s_plane_page + (cc % RPP) * s_plane_row
                vm = valid[:, None]
                if PLANE_FP4:
                    # each lane reads its own byte (two lanes share one: a broadcast) and picks
                    # its nibble, so the keys keep the plain [BN, D] layout: an interleave of
                    # the two nibble halves fed to bf16 dots gave wrong sums on the H200 (sm_90)
                    byte = tl.load(pbase[:, None] + d[None, :] // 2, mask=vm, other=0).to(tl.int32)
                    nib = (byte >> ((d[None, :] & 1) * 4)) & 15
                    sb = tl.load(pbase[:, None] + D // 2 + d[None, :] // 16, mask=vm, other=0)
                    k = e2m1_value(nib) * e4m3_value(sb)
                    if DOT_BF16:
                        k = k.to(tl.bfloat16)
                    if VW == D:
                        v = k
                    else:
                        vb = tl.load(pbase[:, None] + dv[None, :] // 2, mask=vm, other=0)
                        vn = (vb.to(tl.int32) >> ((dv[None, :] & 1) * 4)) & 15
                        vs = tl.load(pbase[:, None] + D // 2 + dv[None, :] // 16, mask=vm, other=0)
                        v = e2m1_value(vn) * e4m3_value(vs)
                else:
                    k = tl.load(pbase[:, None] + d[None, :], mask=vm, other=0.0)
                    if not DOT_BF16:
                        k = k.to(tl.float32)
                    if VW == D:
                        v = k
                    else:
                        v = tl.load(pbase[:, None] + dv[None, :], mask=vm, other=0.0)
                m, l, acc = _online(q, k, v, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)
        else:
            # software pipeline over the selected blocks: every load takes addresses loaded
            # in an earlier iteration, so a block waits on its keys alone (PREFETCH 1: ids two
            # blocks ahead, pages one) or on none (PREFETCH 2: ids three ahead, pages two,
            # keys one)
            id_row = ids_ptr + i * s_ids_row
            pg_row = pages_ptr + i * s_pages_row
            n_s = sb1 - NWB
            s0 = sb0 - NWB
            c0 = _sel_ids(id_row, s0, n_s, BN, KSEL)
            p0 = _sel_pages(pg_row, c0, RPP, P)
            c1 = _sel_ids(id_row, s0 + 1, n_s, BN, KSEL)
            if PREFETCH == 1:
                for b in range(sb0, sb1):
                    c = c0
                    page = p0
                    p0 = _sel_pages(pg_row, c1, RPP, P)
                    c0 = c1
                    c1 = _sel_ids(id_row, b - NWB + 2, n_s, BN, KSEL)
                    valid = (c >= 0) & (page >= 0)
                    k = _sel_keys(
                        plane_ptr, s_plane_page, s_plane_row, c, page, RPP, D, PLANE_FP4, DOT_BF16
                    )
                    m, l, acc = _online(q, k, k, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)
            else:
                p1 = _sel_pages(pg_row, c1, RPP, P)
                c2 = _sel_ids(id_row, s0 + 2, n_s, BN, KSEL)
                if PLANE_FP4:
                    byte0, sc0 = _sel_fp4_raw(plane_ptr, s_plane_page, s_plane_row, c0, p0, RPP, D)
                    for b in range(sb0, sb1):
                        valid = (c0 >= 0) & (p0 >= 0)
                        byte = byte0
                        sc = sc0
                        byte0, sc0 = _sel_fp4_raw(
                            plane_ptr, s_plane_page, s_plane_row, c1, p1, RPP, D
                        )
                        c0 = c1
                        p0 = p1
                        p1 = _sel_pages(pg_row, c2, RPP, P)
                        c1 = c2
                        c2 = _sel_ids(id_row, b - NWB + 3, n_s, BN, KSEL)
                        k = _fp4_keys(byte, sc, D, DOT_BF16)
                        m, l, acc = _online(q, k, k, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)
                else:
                    k0 = _sel_keys(
                        plane_ptr, s_plane_page, s_plane_row, c0, p0, RPP, D, False, DOT_BF16
                    )
                    for b in range(sb0, sb1):
                        valid = (c0 >= 0) & (p0 >= 0)
                        k = k0
                        k0 = _sel_keys(
                            plane_ptr, s_plane_page, s_plane_row, c1, p1, RPP, D, False, DOT_BF16
                        )
                        c0 = c1
                        p0 = p1
                        p1 = _sel_pages(pg_row, c2, RPP, P)
                        c1 = c2
                        c2 = _sel_ids(id_row, b - NWB + 3, n_s, BN, KSEL)
                        m, l, acc = _online(q, k, k, valid, m, l, acc, qk_scale, DOT_BF16, F32_DOT)

    if SPLITS == 1:
        o = tl.where(l[:, None] > 0, div_rn(acc, tl.where(l > 0, l, 1.0)[:, None]), 0.0)
        optr = out_ptr + i * s_out_row + h[:, None] * s_out_head + dv[None, :]
        if OUT_BF16:
            tl.store(optr, bf16_bits(o), mask=hm[:, None])
        else:
            tl.store(optr, o, mask=hm[:, None])
    else:
        base = (i * SPLITS + sp) * H + h
        tl.store(part_o_ptr + base[:, None] * D + dv[None, :], acc, mask=hm[:, None])
        first = hm & (dvi == 0)  # every column program has the same (max, sum)
        tl.store(part_ml_ptr + base * 2, m, mask=first)
        tl.store(part_ml_ptr + base * 2 + 1, l, mask=first)


@triton.jit
def combine_kernel(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    s_out_row,
    s_out_head,
    H,
    D: tl.constexpr,
    DC: tl.constexpr,
    HB: tl.constexpr,
    SPLITS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge the splits of query row ``i``, heads block ``program_id(1)``, latent columns
    ``[program_id(2) * DC, + DC)``: ``sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``. A
    program per column chunk: at one query row the merge is otherwise a couple of programs
    reading every split's partial alone."""
    pdl_enter(PDL)
    i = tl.program_id(0)
    hb = tl.program_id(1)
    c0 = tl.program_id(2) * DC
    h = hb * HB + tl.arange(0, HB)
    hm = h < H
    mx = tl.full((HB,), float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        base = (i * SPLITS + s) * H + h
        mx = tl.maximum(mx, tl.load(part_ml_ptr + base * 2, mask=hm, other=float("-inf")))
    mu = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros((HB,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        base = (i * SPLITS + s) * H + h
        wgt = tl.exp2(tl.load(part_ml_ptr + base * 2, mask=hm, other=float("-inf")) - mu)
        den += tl.load(part_ml_ptr + base * 2 + 1, mask=hm, other=0.0) * wgt
    inv_ok = den > 0
    den = tl.where(inv_ok, den, 1.0)
    dc = tl.arange(0, DC)
    acc = tl.zeros((HB, DC), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        base = (i * SPLITS + s) * H + h
        wgt = tl.exp2(tl.load(part_ml_ptr + base * 2, mask=hm, other=float("-inf")) - mu)
        pptr = part_o_ptr + base[:, None] * D + c0 + dc[None, :]
        acc += tl.load(pptr, mask=hm[:, None], other=0.0) * wgt[:, None]
    o = tl.where(inv_ok[:, None], div_rn(acc, den[:, None]), 0.0)
    optr = out_ptr + i * s_out_row + h[:, None] * s_out_head + c0 + dc[None, :]
    if OUT_BF16:
        tl.store(optr, bf16_bits(o), mask=hm[:, None])
    else:
        tl.store(optr, o, mask=hm[:, None])
