"""Triton index scorer (one kernel per plane format) and the top-k / candidate-block select.

``score_kernel``: program ``(t, c)`` scores keys ``[c * CHUNK, (c + 1) * CHUNK)`` of query row
``t`` and returns at once when that range starts past the row's bound, so the work follows each
row's own context, never the block-table width. It rounds the query itself (E4M3 per (row, head)
with an fp32 scale for the fp8 plane, E2M1 with E8M0 per 32 lanes for the fp4 plane) and reads
the key rows in place through the row's page list. Every operand of the dot lies on a grid its
type holds exactly (fp16 on the fp8 plane, bf16 on the fp4 plane), so the products are exact and
the sums fp32.

``select_resident_kernel`` (rows up to ``select_resident_max``) and the long-row select
(``select_bound_kernel`` then ``select_final_kernel``): the default top-k, the row held in
registers, the k-th key's threshold found by counts over the held keys (``_kth_key``: two
thresholds a step, stopping once exactly k keys lie at or above one).

``select_kernel`` (block mode, and every row with ``select_resident_max`` 0): per row, a most-
significant-digit radix select (up to four 8-bit passes of histograms over order-preserving uint32
keys) finds the k-th largest score; a last pass in position order takes everything above it and the
ties at it from the smallest position up, so the output comes out ascending without a sort. Invalid
entries (``-inf``) never count. In block mode an element is the max of ``G`` consecutive scores (the
candidate source's blocks, the block of the newest visible row forced to ``+inf``) and the output is
the row mask of the chosen blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from v41plan.runtime.kernels.triton_common import (
    NEG_INF_KEY,
    bf16_round,
    div_rn,
    e2m1_value,
    e8m0_value,
    pdl_enter,
    pow2,
    pow2ceil_exponent,
    round_e2m1,
    round_e4m3,
)


@triton.jit
def _round_query(q, w, M: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, QUANT: tl.constexpr):
    """Query rows ``q [M, D]`` (one per (row, head)) on the plane's grid, and the per-head factor
    of the score."""
    if FP4:
        if QUANT:
            qb = tl.reshape(q, (M, D // 32, 32))
            amax = tl.max(tl.abs(qb), axis=2)
            e = pow2ceil_exponent(div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0))
            qb = round_e2m1(qb * pow2(127 - e)[:, :, None]) * pow2(e - 127)[:, :, None]
            q = tl.reshape(qb, (M, D))
        qw = w
    else:
        if QUANT:
            amax = tl.max(tl.abs(q), axis=1)
            sc = div_rn(tl.maximum(amax, 1e-4), 448.0)
            q = round_e4m3(div_rn(q, sc[:, None]))
            qw = w * sc
        else:
            qw = w
    return q, qw


@triton.jit
def _tile_pages(pg_row, j, end, RPP: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr):
    """Pages of keys ``[j, j + BN)`` (-1 past ``end``): one scalar where every tile lies in one
    page (``BN`` divides the page's rows and the chunk), so a key's address is the tile's base
    and a loop-invariant offset; else one a key."""
    if RPP % BN == 0 and CHUNK % BN == 0:
        return tl.load(pg_row + j // RPP, mask=j < end, other=-1)
    else:
        n = j + tl.arange(0, BN)
        return tl.load(pg_row + n // RPP, mask=n < end, other=-1)


@triton.jit
def _key_raw(
    key_ptr,
    s_key_page,
    s_key_row,
    ksc_ptr,
    s_ksc_page,
    s_ksc_row,
    page,
    n,
    end,
    RPP: tl.constexpr,
    D: tl.constexpr,
    FP4: tl.constexpr,
):
    """Index keys ``n`` (on ``page``, zeros where missing) as stored. fp8: the E4M3 codes
    ``[BN, D]`` and the fp32 row scales ``[BN]``; fp4: the packed E2M1 pairs ``[BN, D / 2]``
    (int32) and each lane's E8M0 scale ``[BN, D]``."""
    kvalid = (n < end) & (page >= 0)
    row = n % RPP
    kbase = key_ptr + page * s_key_page + row * s_key_row
    if FP4:
        half = tl.arange(0, D // 2)
        d = tl.arange(0, D)
        packed = tl.load(kbase[:, None] + half[None, :], mask=kvalid[:, None], other=0)
        sbase = ksc_ptr + page * s_ksc_page + row * s_ksc_row
        a = packed.to(tl.int32)
        b = tl.load(sbase[:, None] + d[None, :] // 32, mask=kvalid[:, None], other=127)
    else:
        # four codes a copy: a row's stride (D + 4 bytes) is no multiple of 16, but of 4 (the
        # launcher checks), and without the hint each byte is a load of its own
        d = tl.arange(0, D)
        koff = tl.multiple_of(page * s_key_page + row * s_key_row, 4)
        a = tl.load(key_ptr + koff[:, None] + d[None, :], mask=kvalid[:, None], other=0)
        kptr = (kbase + D).to(tl.pointer_type(tl.float32))
        b = tl.load(kptr, mask=kvalid, other=0.0)
    return a, b


@triton.jit
def _score_tile(
    t0,
    c,
    T,
    q_ptr,
    s_q_row,
    s_q_head,
    w_ptr,
    s_w_row,
    bound_ptr,
    pages_ptr,
    s_pages_row,
    cand_ptr,
    s_cand_row,
    key_ptr,
    s_key_page,
    s_key_row,
    ksc_ptr,
    s_ksc_page,
    s_ksc_row,
    out_ptr,
    s_out_row,
    H,
    P,
    RPP: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
    FP4: tl.constexpr,
    HAS_CAND: tl.constexpr,
    FILL: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    CHUNK_PAGES: tl.constexpr,
):
    """Scores of rows ``[t0, t0 + ROWS)`` over keys ``[c * CHUNK, (c + 1) * CHUNK)``, every
    row reading row ``t0``'s pages (the caller checked they are the same): one dot of
    ``ROWS * HP`` query rows per key tile."""
    M: tl.constexpr = ROWS * HP
    r = tl.arange(0, ROWS)
    trow = t0 + r
    rm = trow < T
    n_cols = P * RPP
    bound = tl.minimum(tl.load(bound_ptr + trow, mask=rm, other=0), n_cols)
    start = c * CHUNK
    if FILL:
        limit = n_cols
    else:
        limit = tl.max(bound, axis=0)
    if start < limit:
        h = tl.arange(0, HP)
        d = tl.arange(0, D)
        qm = rm[:, None, None] & (h < H)[None, :, None]
        qptr = q_ptr + trow[:, None, None] * s_q_row + h[None, :, None] * s_q_head
        q = tl.load(qptr + d[None, None, :], mask=qm, other=0.0).to(tl.float32)
        wm = rm[:, None] & (h < H)[None, :]
        w = tl.load(w_ptr + trow[:, None] * s_w_row + h[None, :], mask=wm, other=0.0)
        q, qw = _round_query(
            tl.reshape(q, (M, D)), tl.reshape(w.to(tl.float32), (M,)), M, D, FP4, QUANT
        )
        if DOT_BF16 and QUANT and not FP4:
            qd = q.to(tl.float16)
        elif DOT_BF16:
            qd = q.to(tl.bfloat16)
        else:
            qd = q
        # masks end at the chunk or the table as with FILL; without it the loop stops after the
        # tile holding the rows' last bound (the scores past it are masked to -inf): a mask
        # ending at the bound itself took a third more instructions a tile (sm_90 build)
        end = tl.minimum(start + CHUNK, n_cols)
        stop = end
        if not FILL:
            stop = tl.minimum(end, (limit + BN - 1) // BN * BN)
        pg_row = pages_ptr + t0 * s_pages_row
        if PREFETCH:
            # pages two tiles ahead, keys one: every load takes addresses loaded in an earlier
            # iteration, so a tile's keys arrive while the tile before it multiplies
            n_a = start + tl.arange(0, BN)
            pg_a = _tile_pages(pg_row, start, end, RPP, BN, CHUNK)
            ra_a, rb_a = _key_raw(
                key_ptr, s_key_page, s_key_row, ksc_ptr, s_ksc_page, s_ksc_row,
                pg_a, n_a, end, RPP, D, FP4,
            )  # fmt: skip
            n_b = n_a + BN
            pg_b = _tile_pages(pg_row, start + BN, end, RPP, BN, CHUNK)
        if CHUNK_PAGES:
            p0 = start // RPP
            pidx = tl.arange(0, CHUNK_PAGES)
            cpages = tl.load(pg_row + p0 + pidx, mask=(p0 + pidx) * RPP < end, other=-1)
        for j0 in range(start, stop, BN):
            if PREFETCH:
                n = n_a
                page = pg_a
                ra = ra_a
                rb = rb_a
                n_a = n_b
                pg_a = pg_b
                ra_a, rb_a = _key_raw(
                    key_ptr, s_key_page, s_key_row, ksc_ptr, s_ksc_page, s_ksc_row,
                    pg_a, n_a, end, RPP, D, FP4,
                )  # fmt: skip
                n_b = n_b + BN
                pg_b = _tile_pages(pg_row, j0 + 2 * BN, end, RPP, BN, CHUNK)
            elif CHUNK_PAGES:
                # the tile's page from the chunk's, loaded before the loop: its keys' copy
                # waits on no load of the loop, so the pipeline keeps the next tiles in flight
                n = j0 + tl.arange(0, BN)
                page = tl.sum(tl.where(pidx == j0 // RPP - p0, cpages, 0), axis=0)
                ra, rb = _key_raw(
                    key_ptr, s_key_page, s_key_row, ksc_ptr, s_ksc_page, s_ksc_row,
                    page, n, end, RPP, D, FP4,
                )  # fmt: skip
            else:
                n = j0 + tl.arange(0, BN)
                page = _tile_pages(pg_row, j0, end, RPP, BN, CHUNK)
                ra, rb = _key_raw(
                    key_ptr, s_key_page, s_key_row, ksc_ptr, s_ksc_page, s_ksc_row,
                    page, n, end, RPP, D, FP4,
                )  # fmt: skip
            inb = n < end
            kvalid = inb & (page >= 0)
            if FP4:
                k = tl.interleave(e2m1_value(ra & 15), e2m1_value(ra >> 4)) * e8m0_value(rb)
            else:
                # fp16 holds every E4M3 value, and fp8 -> fp16 is one hardware instruction a
                # pair (the fp8 -> bf16 cast disagreed with an exact decode on the H200)
                k = ra.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                ks = rb
            if DOT_BF16 and QUANT and not FP4:
                logits = tl.dot(qd, tl.trans(k))
            elif DOT_BF16:
                logits = tl.dot(qd, tl.trans(k.to(tl.float32).to(tl.bfloat16)))
            elif not FP4:
                logits = tl.dot(qd, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(qd, tl.trans(k), input_precision="ieee")
            if FP4:
                if ROUND_BF16:
                    logits = bf16_round(logits)
                    part = bf16_round(tl.maximum(logits, 0.0) * qw[:, None])
                else:
                    part = tl.maximum(logits, 0.0) * qw[:, None]
            else:
                part = tl.maximum(logits * ks[None, :], 0.0) * qw[:, None]
            sc = tl.sum(tl.reshape(part, (ROWS, HP, BN)), axis=1)
            if ROUND_BF16:
                sc = bf16_round(sc)
            valid = kvalid[None, :] & (n[None, :] < bound[:, None]) & rm[:, None]
            if HAS_CAND:
                cptr = cand_ptr + trow[:, None] * s_cand_row + n[None, :]
                valid = valid & (tl.load(cptr, mask=valid, other=0) != 0)
            sc = tl.where(valid, sc, float("-inf"))
            optr = out_ptr + trow[:, None] * s_out_row + n[None, :]
            tl.store(optr, sc, mask=rm[:, None] & inb[None, :])


@triton.jit
def score_kernel(
    q_ptr,
    s_q_row,
    s_q_head,
    w_ptr,
    s_w_row,
    bound_ptr,
    pages_ptr,
    s_pages_row,
    cand_ptr,
    s_cand_row,
    key_ptr,
    s_key_page,
    s_key_row,
    ksc_ptr,
    s_ksc_page,
    s_ksc_row,
    out_ptr,
    s_out_row,
    T,
    H,
    P,
    RPP: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
    FP4: tl.constexpr,
    HAS_CAND: tl.constexpr,
    FILL: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    CHUNK_PAGES: tl.constexpr = 0,
):
    """Scores ``out[t, n] = sum_h relu(q_h . k_n) * w_h`` of query rows ``[ROWS * pid0, ...)``
    for ``n`` in this program's range (``-inf`` past the row's bound, on a missing page or outside
    the candidates). ``FILL`` writes every column up to ``P * RPP`` (the materialized score
    matrix), else only up to the bound. fp8 plane: ``key_ptr`` the E4M3 codes, the fp32 row
    scale at byte ``D`` of the row; fp4: ``key_ptr`` the packed E2M1 values, ``ksc_ptr`` the E8M0
    scales plane. With ``ROWS > 1`` rows that read the same pages in this range (a prefill
    chunk's rows) share each key tile; rows of different requests are scored one by one.
    ``CHUNK_PAGES`` (where every tile lies in one page, ``PREFETCH`` 0): the chunk's page ids
    are loaded before the tile loop, so no key copy waits on a load of the loop."""
    pdl_enter(PDL)
    t0 = tl.program_id(0) * ROWS
    c = tl.program_id(1)
    args = (q_ptr, s_q_row, s_q_head, w_ptr, s_w_row, bound_ptr, pages_ptr, s_pages_row)
    args2 = (cand_ptr, s_cand_row, key_ptr, s_key_page, s_key_row, ksc_ptr, s_ksc_page, s_ksc_row)
    if ROWS == 1:
        _score_tile(
            t0, c, T, *args, *args2, out_ptr, s_out_row, H, P,
            RPP, 1, D, HP, BN, CHUNK, FP4, HAS_CAND, FILL, QUANT, ROUND_BF16, DOT_BF16, PREFETCH,
            CHUNK_PAGES,
        )  # fmt: skip
    else:
        NCOL: tl.constexpr = (CHUNK + RPP - 1) // RPP
        r = tl.arange(0, ROWS)
        cols = (c * CHUNK) // RPP + tl.arange(0, NCOL)
        m = ((t0 + r) < T)[:, None] & (cols < P)[None, :]
        p0 = tl.load(pages_ptr + t0 * s_pages_row + cols, mask=cols < P, other=-1)
        pr = tl.load(pages_ptr + (t0 + r)[:, None] * s_pages_row + cols[None, :], mask=m, other=-1)
        differ = tl.sum(tl.sum((m & (pr != p0[None, :])).to(tl.int32), axis=1), axis=0)
        if differ == 0:
            _score_tile(
                t0, c, T, *args, *args2, out_ptr, s_out_row, H, P,
                RPP, ROWS, D, HP, BN, CHUNK, FP4, HAS_CAND, FILL, QUANT, ROUND_BF16, DOT_BF16,
                PREFETCH, CHUNK_PAGES,
            )  # fmt: skip
        else:
            for i in tl.static_range(ROWS):
                _score_tile(
                    t0 + i, c, T, *args, *args2, out_ptr, s_out_row, H, P,
                    RPP, 1, D, HP, BN, CHUNK, FP4, HAS_CAND, FILL, QUANT, ROUND_BF16, DOT_BF16,
                    PREFETCH, CHUNK_PAGES,
                )  # fmt: skip


@triton.jit
def select_kernel(
    score_ptr,
    s_score_row,
    bound_ptr,
    out_ptr,
    s_out_row,
    K,
    N,
    HAS_BOUND: tl.constexpr,
    G: tl.constexpr,
    BLOCK_MODE: tl.constexpr,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Top-``K`` of row ``t``'s elements, ties to the smaller element. Ids mode: element ids
    ascending into ``out [T, K]`` (int64), -1 padded. Block mode (``G`` scores an element): the
    bool row mask ``out [T, N]`` of the chosen blocks' rows below the bound.

    Passes 0..3 pick the k-th largest key a digit at a time; pass 4 writes the selection. A
    digit pass whose chosen bin holds exactly the elements still wanted ends the search: every
    key at or above that prefix is selected (no tie to break), and the digit passes left skip
    their reads of the row (distinct scores: usually the fourth)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    _digit_select(
        t, score_ptr, s_score_row, bound_ptr, out_ptr, s_out_row, K, N,
        HAS_BOUND, G, BLOCK_MODE, CHUNK, KP,
    )  # fmt: skip


@triton.jit
def _digit_select(
    t,
    score_ptr,
    s_score_row,
    bound_ptr,
    out_ptr,
    s_out_row,
    K,
    N,
    HAS_BOUND: tl.constexpr,
    G: tl.constexpr,
    BLOCK_MODE: tl.constexpr,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
):
    """``select_kernel``'s work for row ``t`` (also the long-row select's way out where a row's
    candidates overflow their list)."""
    row_ptr = score_ptr + t * s_score_row
    if HAS_BOUND:
        bound = tl.load(bound_ptr + t)
    else:
        bound = N + tl.zeros((), dtype=tl.int64)
    if BLOCK_MODE:
        # the bound as given: one past the table forces no block (as the reference)
        n_elem = N // G
        newest = tl.where(bound > 0, (bound - 1) // G, -1)
    else:
        n_elem = tl.minimum(bound, N)
        newest = -1
    bins = tl.arange(0, 256)
    # the selected key's bits so far, in the key's own (signed) layout
    prefix = tl.zeros((), dtype=tl.int32)
    rem = tl.zeros((), dtype=tl.int32)
    taken = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    # the search's end: a chosen bin holds exactly the elements still wanted, so the write
    # pass's test against the prefix so far (low digits 0) takes the whole bin and nothing below
    done = tl.zeros((), dtype=tl.int1)
    for p in tl.static_range(5):
        shift = 24 - 8 * p
        hist = tl.zeros((256,), dtype=tl.int32)
        # a digit pass after the end reads nothing; the write pass reads the row
        n_pass = n_elem if p == 4 else tl.where(done, 0, n_elem)
        for e0 in range(0, n_pass, CHUNK):
            e = e0 + tl.arange(0, CHUNK)
            inb = e < n_elem
            if BLOCK_MODE:
                g = tl.arange(0, G)
                rows = e[:, None] * G + g[None, :]
                v = tl.load(row_ptr + rows, mask=inb[:, None], other=float("-inf"))
                v = tl.max(v.to(tl.float32), axis=1)
                v = tl.where(e == newest, float("inf"), v)
            else:
                v = tl.load(row_ptr + e, mask=inb, other=float("-inf")).to(tl.float32)
            # ordered_key, inline (a helper call per step is slow under the interpreter)
            b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
            key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
            valid = inb & (key > NEG_INF_KEY)
            if p < 4:
                if p > 0:
                    valid = valid & ((key & -(1 << (shift + 8))) == prefix)
                digit = (key >> shift) & 255
                if p == 0:  # unsigned digit order: the sign bit flipped
                    digit = digit ^ 128
                hist += tl.histogram(digit, 256, mask=valid)
            else:
                eq = (valid & (key == prefix)).to(tl.int32)
                tie_rank = ties + tl.cumsum(eq, axis=0) - eq
                sel = valid & ((key > prefix) | ((eq != 0) & (tie_rank < rem)))
                si = sel.to(tl.int32)
                if BLOCK_MODE:
                    keep = sel[:, None] & (rows < bound)
                    tl.store(out_ptr + t * s_out_row + rows, keep, mask=inb[:, None])
                else:
                    idx = taken + tl.cumsum(si, axis=0) - si
                    tl.store(out_ptr + t * s_out_row + idx, e.to(tl.int64), mask=sel)
                taken += tl.sum(si, axis=0)
                ties += tl.sum(eq, axis=0)
        if p < 4:
            total = tl.sum(hist, axis=0)
            if p == 0:
                rem = tl.minimum(total, K)
            at_least = total - tl.cumsum(hist, axis=0) + hist
            dstar = tl.max(tl.where(at_least >= rem, bins, 0), axis=0)
            # a pass after the end changes nothing: its histogram is empty, so its digit is 0
            rem -= tl.sum(tl.where(bins > dstar, hist, 0), axis=0)
            in_bin = tl.sum(tl.where(bins == dstar, hist, 0), axis=0)
            # (nothing wanted, k = 0 or no valid element, is no end: that bin is empty)
            done = done | ((in_bin == rem) & (rem > 0))
            if p == 0:
                dstar = dstar ^ 128
            prefix = prefix | (dstar << shift)
    if not BLOCK_MODE:
        j = tl.arange(0, KP)
        fill = tl.full((KP,), -1, tl.int64)
        tl.store(out_ptr + t * s_out_row + j, fill, mask=(j >= taken) & (j < K))


@triton.jit
def _row_keys(row_ptr, e, n_elem):
    """Order-preserving int32 keys of scores ``e`` of a row (``-0.0`` as ``+0.0``) and which are
    valid (below ``n_elem``, above ``-inf``); invalid keys set to ``NEG_INF_KEY``."""
    key, valid = _seg_keys(row_ptr, e, n_elem)
    return tl.where(valid, key, NEG_INF_KEY), valid


@triton.jit
def _counts_of(key, valid):
    """How many of ``key`` are valid and how many lie at or above 0 (every such key is valid:
    invalid ones hold ``NEG_INF_KEY``), by one sum of both packed into an int32 where a row
    holds at most 16,384 keys."""
    if key.shape[0] <= 16384:
        both = tl.sum(valid.to(tl.int32) + (key >= 0).to(tl.int32) * 65536, axis=0)
        return both & 65535, both >> 16
    else:
        return tl.sum(valid.to(tl.int32), axis=0), tl.sum((key >= 0).to(tl.int32), axis=0)


@triton.jit
def _kth_key(key, rem, n_pos, EARLY: tl.constexpr = False, cap=0, TERNARY: tl.constexpr = False):
    """A threshold ``T`` with at least ``rem`` of ``key`` at or above it (``rem`` >= 1) and none
    of them below the rem-th largest: the rem-th largest itself, or (``EARLY``) below it with
    no key between. A bit at a time: the sign first (``n_pos`` keys at or above 0: enough?),
    then bits 30..0 set while enough keys lie at or above (OR-ing a bit into a negative
    threshold raises it as into a positive one). ``NEG_INF_KEY`` entries never count: every
    threshold past the first lies above them. ``EARLY``: stop at the first threshold with at
    most ``max(rem, cap)`` keys at or above it: with ``cap`` <= ``rem`` exactly the rem largest
    (distinct scores: after about 20 of the 32 bits); with a larger ``cap`` between ``rem``
    and ``cap`` keys (unless ties hold more), a bound the long-row select's segments need no
    closer (about 10 bits). ``TERNARY`` (with ``EARLY``, rows of up to 16,384 keys): two
    thresholds a step, a third of the range apart, counted by one sum of both counts packed
    into an int32 (16 bits each), so a step cuts the range to a third: about 20 steps for the
    31 bits below the sign."""
    n_all = key.shape[0]  # every key lies at or above the lowest threshold
    if EARLY and TERNARY:
        tl.static_assert(key.shape[0] <= 16384)  # two counts in one int32
        cap = tl.maximum(cap, rem)
        lo = tl.where(n_pos >= rem, 0, -2147483648)
        n_lo = tl.where(n_pos >= rem, n_pos, n_all)
        hi = tl.where(n_pos >= rem, 2147483647, -1)  # inclusive: the answer lies in [lo, hi]
        while (lo < hi) & (n_lo > cap):
            d = hi - lo  # below 2**31: [lo, hi] lies within one sign
            third = d // 3 + 1
            c1 = lo + tl.minimum(third, d)
            c2 = lo + tl.minimum(2 * third, d)
            both = (key >= c1).to(tl.int32) + (key >= c2).to(tl.int32) * 65536
            packed = tl.sum(both, axis=0)
            n1 = packed & 65535
            n2 = packed >> 16
            lo_next = tl.where(n2 >= rem, c2, tl.where(n1 >= rem, c1, lo))
            n_lo = tl.where(n2 >= rem, n2, tl.where(n1 >= rem, n1, n_lo))
            hi = tl.where(n2 >= rem, hi, tl.where(n1 >= rem, c2 - 1, c1 - 1))
            lo = lo_next
        return lo
    elif EARLY:
        cap = tl.maximum(cap, rem)
        lo = tl.where(n_pos >= rem, 0, -2147483648)
        n_lo = tl.where(n_pos >= rem, n_pos, n_all)
        i = 0
        while (i < 31) & (n_lo > cap):
            cand = lo | (1 << (30 - i))
            n_cand = tl.sum((key >= cand).to(tl.int32), axis=0)
            lo = tl.where(n_cand >= rem, cand, lo)
            n_lo = tl.where(n_cand >= rem, n_cand, n_lo)
            i += 1
        return lo
    else:
        lo = tl.where(n_pos >= rem, 0, -2147483648)
        for i in tl.static_range(31):
            cand = lo | (1 << (30 - i))
            lo = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= rem, cand, lo)
        return lo


@triton.jit
def _write_selected(
    out_row,
    key,
    valid,
    pos,
    K,
    KP: tl.constexpr,
    EARLY: tl.constexpr,
    TERNARY: tl.constexpr,
    PACK_MAX: tl.constexpr,
):
    """The ``K`` largest valid ``key`` (fewer if fewer are valid; in position order, ``pos``
    ascending) into ``out_row``: every key above the threshold of ``_kth_key``, then the ties at
    it from the first; -1 after them. Where a row holds at most ``PACK_MAX`` keys (16,384 at
    most), the keys above and the ties are counted and placed by one sum and one cumulative sum
    of both packed; else by a sum and two cumulative sums."""
    n_valid, n_pos = _counts_of(key, valid)
    rem = tl.minimum(n_valid, K)
    if rem > 0:
        kth = _kth_key(key, rem, n_pos, EARLY, 0, TERNARY)
        above = (key > kth) & valid
        eq = (key == kth) & valid
        if key.shape[0] <= PACK_MAX:
            tl.static_assert(key.shape[0] <= 16384)  # two counts in one int32
            both = above.to(tl.int32) + eq.to(tl.int32) * 65536
            need = rem - (tl.sum(both, axis=0) & 65535)
            before = tl.cumsum(both, axis=0) - both
            ties_before = before >> 16
            sel = above | (eq & (ties_before < need))
            idx = (before & 65535) + tl.minimum(ties_before, need)
        else:
            need = rem - tl.sum(above.to(tl.int32), axis=0)
            ei = eq.to(tl.int32)
            sel = above | (eq & (tl.cumsum(ei, axis=0) - ei < need))
            si = sel.to(tl.int32)
            idx = tl.cumsum(si, axis=0) - si
        tl.store(out_row + idx, pos.to(tl.int64), mask=sel)
    j = tl.arange(0, KP)
    tl.store(out_row + j, tl.full((KP,), -1, tl.int64), mask=(j >= rem) & (j < K))


@triton.jit
def select_resident_kernel(
    score_ptr,
    s_score_row,
    bound_ptr,
    out_ptr,
    s_out_row,
    K,
    N,
    HAS_BOUND: tl.constexpr,
    NP: tl.constexpr,
    KP: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    TERNARY: tl.constexpr = False,
    PACK_MAX: tl.constexpr = 4096,
):
    """Top-``K`` ids of row ``t`` (``N <= NP`` elements, ties to the smaller position, ids
    ascending into ``out [T, K]``, -1 padded), the row read once and held in registers: a
    threshold at the k-th largest key found by counts over the held keys (``_kth_key``: 31 bit
    steps, or with ``EARLY`` and ``TERNARY`` about 16 steps of two counts), then a cumulative
    sum in position order places the keys above it and the first ties at it (``PACK_MAX``:
    the two counted in one int32 scan up to that many keys). The digit passes of
    ``select_kernel`` read the row up to five times with a 256-bin histogram each; here a step
    costs a compare or two and a sum."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    if HAS_BOUND:
        n_elem = tl.minimum(tl.load(bound_ptr + t), N)
    else:
        n_elem = N + tl.zeros((), dtype=tl.int64)
    e = tl.arange(0, NP)
    key, valid = _row_keys(score_ptr + t * s_score_row, e, n_elem)
    _write_selected(out_ptr + t * s_out_row, key, valid, e, K, KP, EARLY, TERNARY, PACK_MAX)


# -- the long-row select: segment bounds, then the candidates above them --------------------------
# A row longer than one program holds takes two launches. Each segment program finds its own
# k-th key (held in registers, as select_resident_kernel): the row's k-th key is at least the
# largest of them, since that segment alone holds k keys at or above it. The segment program
# also writes the keys at or above its own bound (k, save ties) to its list in position order.
# One program a row then takes the keys at or above the largest bound from the segments' lists
# (every such key is at or above its own segment's bound, so in its list) into a list, and
# selects from that list held in registers. The lists are a few thousand entries the segment
# programs wrote in parallel, where the row itself is a long serial read (64 rows of 32,768
# scores: 16 steps a row, each waiting on its load). A segment list that overflows (many ties at
# its bound) makes the row's program read the row instead; a final list that overflows takes
# the digit select over the whole row.


@triton.jit
def select_bound_kernel(
    score_ptr,
    s_score_row,
    bound_ptr,
    ws_ptr,
    s_ws_row,
    seg_ptr,
    s_seg_row,
    K,
    N,
    SEG,
    HAS_BOUND: tl.constexpr,
    NP: tl.constexpr,
    SP: tl.constexpr,
    LC: tl.constexpr,
    EARLY: tl.constexpr = False,
    TERNARY: tl.constexpr = False,
    LOOSE: tl.constexpr = False,
):
    """Segment ``s`` of row ``t`` (``SEG <= NP`` elements): its bound into ``ws[t, s]`` (its own
    k-th key, or with ``EARLY`` a threshold below it with no key between), or ``NEG_INF_KEY``
    where it holds fewer than ``K`` valid keys (no bound from it); the valid keys at or above
    it, in position order, into its list (``seg[t, s * 2 * LC:]``: up to ``LC`` positions, then
    their keys) and how many there are into ``ws[t, SP + s]``. ``LOOSE`` (with ``EARLY``): a
    threshold with ``K`` to ``LC`` keys at or above it, as good a bound for the row's select
    (every key at or above it still fits the list) for about half the search."""
    t = tl.program_id(0)
    sg = tl.program_id(1)
    if HAS_BOUND:
        n_elem = tl.minimum(tl.load(bound_ptr + t), N)
    else:
        n_elem = N + tl.zeros((), dtype=tl.int64)
    i = tl.arange(0, NP)
    e = sg * SEG + i
    key, valid = _row_keys(score_ptr + t * s_score_row, e, tl.where(i < SEG, n_elem, 0))
    valid = valid & (i < SEG)
    key = tl.where(valid, key, NEG_INF_KEY)
    have, n_pos = _counts_of(key, valid)
    kth = NEG_INF_KEY + tl.zeros((), dtype=tl.int32)
    if (have >= K) & (K > 0):
        kth = _kth_key(key, K, n_pos, EARLY, LC if LOOSE else 0, TERNARY)
    tl.store(ws_ptr + t * s_ws_row + sg, kth)
    cand = valid & (key >= kth)
    ci = cand.to(tl.int32)
    idx = tl.cumsum(ci, axis=0) - ci
    lst = seg_ptr + t * s_seg_row + sg * (2 * LC)
    fits = cand & (idx < LC)
    tl.store(lst + idx, e.to(tl.int32), mask=fits)
    tl.store(lst + LC + idx, key, mask=fits)
    tl.store(ws_ptr + t * s_ws_row + SP + sg, tl.sum(ci, axis=0))


@triton.jit
def _append_positions(lst, count, pos, cand, NPC: tl.constexpr):
    """Append the positions ``pos`` where ``cand`` to ``lst`` (``count`` held, up to ``NPC``
    stored); the new count, which may pass ``NPC``."""
    ci = cand.to(tl.int32)
    idx = count + tl.cumsum(ci, axis=0) - ci
    tl.store(lst + idx, pos.to(tl.int32), mask=cand & (idx < NPC))
    return count + tl.sum(ci, axis=0)


@triton.jit
def select_final_kernel(
    score_ptr,
    s_score_row,
    bound_ptr,
    ws_ptr,
    s_ws_row,
    seg_ptr,
    s_seg_row,
    list_ptr,
    s_list_row,
    out_ptr,
    s_out_row,
    K,
    N,
    S,
    HAS_BOUND: tl.constexpr,
    SP: tl.constexpr,
    LC: tl.constexpr,
    CHUNK: tl.constexpr,
    NPC: tl.constexpr,
    KP: tl.constexpr,
    EARLY: tl.constexpr = False,
    TERNARY: tl.constexpr = False,
    HELD: tl.constexpr = False,
    PACK_MAX: tl.constexpr = 4096,
):
    """Row ``t``'s top-``K`` ids from its segments' bounds and lists (``select_bound_kernel``):
    the keys at or above the largest bound. ``HELD`` (the lists fit one program, ``SP * LC``
    entries) and no list overflowed: selected from the lists themselves, loaded at once and
    held in registers (positions and keys in position order, segment after segment). Else taken
    from the lists (from the row where a segment's list overflowed) in position order into
    ``list [T, NPC]`` (their positions), then selected from the list held in registers; past
    ``NPC`` of them, the digit select over the row."""
    t = tl.program_id(0)
    row_ptr = score_ptr + t * s_score_row
    if HAS_BOUND:
        n_elem = tl.minimum(tl.load(bound_ptr + t), N)
    else:
        n_elem = N + tl.zeros((), dtype=tl.int64)
    sj = tl.arange(0, SP)
    floor = tl.max(tl.load(ws_ptr + t * s_ws_row + sj, mask=sj < S, other=NEG_INF_KEY), axis=0)
    lst = list_ptr + t * s_list_row
    count = tl.zeros((), dtype=tl.int32)
    ws_counts = ws_ptr + t * s_ws_row + SP
    overflow = tl.max(tl.load(ws_counts + sj, mask=sj < S, other=0), axis=0) > LC
    if HELD and not overflow:
        # every list at once: no list written and read back, no scores gathered from the row
        i = tl.arange(0, SP * LC)
        sg = i // LC
        j = i % LC
        held = (sg < S) & (j < tl.load(ws_counts + sg, mask=sg < S, other=0))
        entry = seg_ptr + t * s_seg_row + sg * (2 * LC) + j
        pos = tl.load(entry, mask=held, other=0)
        key = tl.load(entry + LC, mask=held, other=NEG_INF_KEY)
        valid = held & (key >= floor)
        key = tl.where(valid, key, NEG_INF_KEY)
        _write_selected(out_ptr + t * s_out_row, key, valid, pos, K, KP, EARLY, TERNARY, PACK_MAX)
    else:
        if overflow:
            for e0 in range(0, n_elem, CHUNK):
                e = e0 + tl.arange(0, CHUNK)
                key, valid = _row_keys(row_ptr, e, n_elem)
                count = _append_positions(lst, count, e, valid & (key >= floor), NPC)
        else:
            j = tl.arange(0, LC)
            for sg in range(S):
                held = j < tl.load(ws_counts + sg)
                seg = seg_ptr + t * s_seg_row + sg * (2 * LC)
                pos = tl.load(seg + j, mask=held, other=0)
                key = tl.load(seg + LC + j, mask=held, other=NEG_INF_KEY)
                count = _append_positions(lst, count, pos, held & (key >= floor), NPC)
        if count <= NPC:
            i = tl.arange(0, NPC)
            held = i < count
            pos = tl.load(lst + i, mask=held, other=0)
            key, valid = _row_keys(row_ptr, pos, tl.where(held, n_elem, 0))
            valid = valid & held
            key = tl.where(valid, key, NEG_INF_KEY)
            _write_selected(
                out_ptr + t * s_out_row, key, valid, pos, K, KP, EARLY, TERNARY, PACK_MAX
            )
        else:
            _digit_select(
                t, score_ptr, s_score_row, bound_ptr, out_ptr, s_out_row, K, N,
                HAS_BOUND, 1, False, CHUNK, KP,
            )  # fmt: skip


# -- the select over segments: a row's elements split among programs (few rows, long rows) --------
# Four launches, each over (row, segment) programs but the third: a histogram of the keys' top
# 11 bits (atomics into the row's 2048 bins); a gather of the elements in the bin holding the
# k-th key (its candidates: few, save ties) into a per-row list; one program a row finishes
# the k-th key from the list alone and turns it into each segment's output offset and tie
# quota; each segment then writes its ids in position order, so the output comes out ascending
# as the one-program select's does. Workspace columns of a row (int32, zeroed):
# [0, 2048) the histogram, 2048 the list's length, 2049 the k-th key, then SP def counts
# (elements of a segment above the bin), SP offsets and SP tie quotas.
SEL_BINS = tl.constexpr(2048)
SEL_LEN = tl.constexpr(2048)
SEL_KTH = tl.constexpr(2049)
SEL_SEG = tl.constexpr(2052)


@triton.jit
def _seg_keys(row_ptr, e, n_elem):
    """Ordered keys of elements ``e`` and which of them count (inside the row, above -inf)."""
    inb = e < n_elem
    v = tl.load(row_ptr + e, mask=inb, other=float("-inf")).to(tl.float32)
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return key, inb & (key > NEG_INF_KEY)


@triton.jit
def _seg_span(bound_ptr, t, s, N, SEG, HAS_BOUND: tl.constexpr):
    """Segment ``s`` of row ``t``: ``[lo, hi)`` inside the row's bound."""
    if HAS_BOUND:
        n_elem = tl.minimum(tl.load(bound_ptr + t), N)
    else:
        n_elem = N + tl.zeros((), dtype=tl.int64)
    lo = s.to(tl.int64) * SEG
    return lo, tl.minimum(lo + SEG, n_elem)


@triton.jit
def _coarse_bin(ws_row, K):
    """The bin of the k-th key and how many of the k remain for it (``rem``), from the row's
    histogram; ``rem0`` is k capped by the row's valid elements."""
    bins = tl.arange(0, SEL_BINS)
    hist = tl.load(ws_row + bins)
    total = tl.sum(hist, axis=0)
    rem0 = tl.minimum(total, K)
    at_least = total - tl.cumsum(hist, axis=0) + hist
    dstar = tl.max(tl.where(at_least >= rem0, bins, 0), axis=0)
    rem = rem0 - tl.sum(tl.where(bins > dstar, hist, 0), axis=0)
    return dstar, rem


@triton.jit
def select_hist_kernel(
    score_ptr, s_score_row, bound_ptr, ws_ptr, s_ws_row, N, SEG,
    HAS_BOUND: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program ``(t, s)``: segment ``s`` of row ``t`` into the row's 2048-bin histogram of the
    keys' top 11 bits (unsigned order: the sign bit flipped)."""
    t, s = tl.program_id(0), tl.program_id(1)
    lo, hi = _seg_span(bound_ptr, t, s, N, SEG, HAS_BOUND)
    if lo >= hi:
        return
    row_ptr = score_ptr + t * s_score_row
    hist = tl.zeros((SEL_BINS,), dtype=tl.int32)
    for e0 in range(lo, hi, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        key, valid = _seg_keys(row_ptr, e, hi)
        hist += tl.histogram(((key >> 21) & 2047) ^ 1024, SEL_BINS, mask=valid)
    bins = tl.arange(0, SEL_BINS)
    tl.atomic_add(ws_ptr + t * s_ws_row + bins, hist, mask=hist > 0)


@triton.jit
def select_gather_kernel(
    score_ptr, s_score_row, bound_ptr, ws_ptr, s_ws_row, key_ptr, pos_ptr, s_list_row, K, N,
    SEG, SP: tl.constexpr, HAS_BOUND: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program ``(t, s)``: counts the segment's elements above the k-th key's bin and appends
    those in it (key, position) to the row's list (in any order: the positions rank ties)."""
    t, s = tl.program_id(0), tl.program_id(1)
    lo, hi = _seg_span(bound_ptr, t, s, N, SEG, HAS_BOUND)
    ws_row = ws_ptr + t * s_ws_row
    dstar, _rem = _coarse_bin(ws_row, K)
    row_ptr = score_ptr + t * s_score_row
    above = tl.zeros((), dtype=tl.int32)
    for e0 in range(lo, hi, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        key, valid = _seg_keys(row_ptr, e, hi)
        digit = ((key >> 21) & 2047) ^ 1024
        above += tl.sum((valid & (digit > dstar)).to(tl.int32), axis=0)
        at = (valid & (digit == dstar)).to(tl.int32)
        n_at = tl.sum(at, axis=0)
        if n_at > 0:
            base = tl.atomic_add(ws_row + SEL_LEN, n_at)
            slot = base + tl.cumsum(at, axis=0) - at
            tl.store(key_ptr + t * s_list_row + slot, key, mask=at != 0)
            tl.store(pos_ptr + t * s_list_row + slot, e.to(tl.int32), mask=at != 0)
    tl.store(ws_row + SEL_SEG + s, above)


@triton.jit
def select_refine_kernel(
    ws_ptr, s_ws_row, key_ptr, pos_ptr, s_list_row, out_ptr, s_out_row, K, SEG, S,
    SP: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """Program ``t``: the k-th key from the row's list (three more digit passes over the low
    21 bits), then each segment's output offset and tie quota (ties to the smaller position:
    the earlier segments' first); pads the output past the selection with -1."""
    t = tl.program_id(0)
    ws_row = ws_ptr + t * s_ws_row
    dstar, rem = _coarse_bin(ws_row, K)
    n_list = tl.load(ws_row + SEL_LEN)
    keys_row, pos_row = key_ptr + t * s_list_row, pos_ptr + t * s_list_row
    prefix = (dstar ^ 1024) << 21
    bins = tl.arange(0, 256)
    for p in tl.static_range(3):
        shift = 13 - 8 * p + 3 * (p // 2)  # 13, 5, 0
        width = 8 - 3 * (p // 2)  # 8, 8, 5
        hist = tl.zeros((256,), dtype=tl.int32)
        for c0 in range(0, n_list, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            key = tl.load(keys_row + c, mask=c < n_list, other=0)
            match = (c < n_list) & ((key & -(1 << (shift + width))) == prefix)
            hist += tl.histogram((key >> shift) & ((1 << width) - 1), 256, mask=match)
        total = tl.sum(hist, axis=0)
        at_least = total - tl.cumsum(hist, axis=0) + hist
        d = tl.max(tl.where(at_least >= rem, bins, 0), axis=0)
        if width < 8:
            d = tl.minimum(d, (1 << width) - 1)
        rem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
        prefix = prefix | (d << shift)
    # per segment: list elements above the k-th key, and its ties
    segs = tl.arange(0, SP)
    gt = tl.load(ws_row + SEL_SEG + segs, mask=segs < S, other=0)
    eq = tl.zeros((SP,), dtype=tl.int32)
    for c0 in range(0, n_list, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        inl = c < n_list
        key = tl.load(keys_row + c, mask=inl, other=0)
        seg = tl.load(pos_row + c, mask=inl, other=0) // SEG
        gt += tl.histogram(seg, SP, mask=inl & (key > prefix))
        eq += tl.histogram(seg, SP, mask=inl & (key == prefix))
    quota = tl.minimum(tl.maximum(rem - (tl.cumsum(eq, axis=0) - eq), 0), eq)
    count = gt + quota
    tl.store(ws_row + SEL_KTH, prefix)
    tl.store(ws_row + SEL_SEG + SP + segs, tl.cumsum(count, axis=0) - count, mask=segs < S)
    tl.store(ws_row + SEL_SEG + 2 * SP + segs, quota, mask=segs < S)
    j = tl.arange(0, KP)
    fill = tl.full((KP,), -1, tl.int64)
    tl.store(out_ptr + t * s_out_row + j, fill, mask=(j >= tl.sum(count, axis=0)) & (j < K))


@triton.jit
def select_write_kernel(
    score_ptr, s_score_row, bound_ptr, ws_ptr, s_ws_row, out_ptr, s_out_row, N, SEG,
    SP: tl.constexpr, HAS_BOUND: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program ``(t, s)``: the segment's selected ids, ascending, at its offset: every element
    above the k-th key and its first ``quota`` ties."""
    t, s = tl.program_id(0), tl.program_id(1)
    lo, hi = _seg_span(bound_ptr, t, s, N, SEG, HAS_BOUND)
    ws_row = ws_ptr + t * s_ws_row
    kth = tl.load(ws_row + SEL_KTH)
    taken = tl.load(ws_row + SEL_SEG + SP + s)
    quota = tl.load(ws_row + SEL_SEG + 2 * SP + s)
    row_ptr = score_ptr + t * s_score_row
    ties = tl.zeros((), dtype=tl.int32)
    for e0 in range(lo, hi, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        key, valid = _seg_keys(row_ptr, e, hi)
        eq = (valid & (key == kth)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, axis=0) - eq
        sel = valid & ((key > kth) | ((eq != 0) & (tie_rank < quota)))
        si = sel.to(tl.int32)
        tl.store(
            out_ptr + t * s_out_row + taken + tl.cumsum(si, axis=0) - si, e.to(tl.int64), mask=sel
        )
        taken += tl.sum(si, axis=0)
        ties += tl.sum(eq, axis=0)
