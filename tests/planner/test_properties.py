"""Hypothesis properties of plan_step, checked by simulating requests through whole lifetimes.

The simulator keeps what the cache holds (ring rows per layer and slot, compressed groups per
owner, the FP32 tail per ratio-2 owner) and, for every forward, checks every read against what
this or an earlier forward produced, then applies the forward's writes.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.planner.helpers import spec, variant
from v41plan.planner.stages import PHASES
from v41plan.planner.step import RequestInput, StepInput, plan_step

TINY = spec("tiny")  # W 8, hash block 32, min_final 8
WIDE = variant(TINY, name="tiny_w16", sliding_window=16, replay={"min_final_prefill_rows": 16})
SPECS = {"tiny": TINY, "wide": WIDE}

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Cache:
    """What one request's slot and the prefix cache hold."""

    def __init__(self, s, cached_groups_below: int = 0):
        self.s = s
        self.ring_rows = s.dims.sliding_window
        self.ring = {layer.index: {} for layer in s.layers}  # ring slot -> position
        self.groups = {}  # owner -> set of compressed rows written
        self.tail = {}  # ratio-2 owner -> position stored
        for o in (layer for layer in s.layers if layer.role == "full"):
            self.groups[o.index] = set(range(cached_groups_below // o.ratio))
        self.written: dict[int, list[int]] = {o: [] for o in self.groups}

    def ring_has(self, layer: int, pos: int) -> bool:
        return self.ring[layer].get(pos % self.ring_rows) == pos


def check_forward(cache: Cache, p, i: int) -> None:
    """Check request ``i``'s reads in plan ``p`` and apply its writes to ``cache``."""
    s = cache.s
    W = s.dims.sliding_window
    lo, hi = int(p.cu_seqlens_q[i]), int(p.cu_seqlens_q[i + 1])
    fs = int(p.forward_start[i])
    pos_of = {row: int(p.positions[row]) for row in range(lo, hi)}
    scu = int(p.swa_cached_until[i])
    decode = bool(p.is_decode[i])

    def mine(arr):
        return {int(x) for x in arr if lo <= x < hi}

    # Closing groups of this forward (written after the check below).
    new_groups = {}
    for o in cache.groups:
        r = s.layers[o].ratio
        c = p.compress[r]
        sel = (c.rows >= lo) & (c.rows < hi)
        new_groups[o] = c.compressed_rows[sel].tolist()
        assert (c.rope_positions[sel] == c.compressed_rows[sel] * r).all()
        # Never rewrite what the cache holds.
        assert not set(new_groups[o]) & cache.groups[o], (o, new_groups[o])
        for row, first, from_tail in zip(
            c.rows[sel], c.rope_positions[sel], c.first_from_tail[sel], strict=True
        ):
            if from_tail:
                assert cache.tail.get(o) == first, "group's first member not in the FP32 tail"
            else:
                assert first >= fs and pos_of[int(row)] - (r - 1) == first
    produced = {o: cache.groups[o] | set(new_groups[o]) for o in cache.groups}

    prev_ffn = set(range(lo, hi))  # the embedding: every row
    for layer in s.layers:
        L = layer.index
        ring_rows = mine(p.layer_rows[(L, "ring_write")])
        attn = mine(p.layer_rows[(L, "attention")])
        ffn = mine(p.layer_rows[(L, "ffn")])
        assert ring_rows <= prev_ffn and attn <= prev_ffn and ffn <= attn
        if layer.role == "full":
            assert mine(p.layer_rows[(L, "compress")]) <= prev_ffn
        floor_kind = p.table.floor(PHASES[p.row_phase[i]], L)
        if decode:
            floor = 0
        elif layer.segment == "decoder":
            floor = int(p.swa_replay_start[i])
        else:
            floor = int(p.encoder_window_floor[i])
        # A layer floored at the tail reads only this forward's rows; the others read the
        # slot's ring below swa_cached_until from rows at or past it.
        split = int(p.ring_limits(L)[1][i])
        assert split == (fs if floor_kind == "tail" else scu)
        kv_here = {pos_of[row] for row in ring_rows}
        for row in attn:
            q = pos_of[row]
            first = max(floor, q - W + 1) if q >= split else max(floor, fs, q - W + 1)
            for k in range(first, q + 1):
                if k >= split or (q < split and k >= fs):
                    assert k in kv_here, f"layer {L} row {q} reads KV {k} not computed"
                else:
                    assert cache.ring_has(L, k), f"layer {L} row {q} reads ring {k} not held"
            if layer.kv_owner is not None:
                r = s.layers[layer.kv_owner].ratio
                need = (q + 1) // r
                assert int(p.visible[r][row]) == need
                missing = set(range(need)) - produced[layer.kv_owner]
                assert not missing, (
                    f"layer {L} row {q} reads unwritten groups {sorted(missing)[:3]}"
                )
        prev_ffn = ffn
    if p.is_final_chunk[i]:
        assert int(p.last_rows[i]) in prev_ffn  # the LM head's row

    # Writes: rings (skipping rows below cached_until), groups, tails.
    for layer in s.layers:
        # Layers floored at the tail write their whole tail; the others keep the ring rows
        # below cached_until.
        cu = int(p.ring_limits(layer.index)[0][i])
        for row in sorted(mine(p.layer_rows[(layer.index, "ring_write")])):
            if pos_of[row] >= cu:
                cache.ring[layer.index][pos_of[row] % cache.ring_rows] = pos_of[row]
    for o, rows_ in new_groups.items():
        cache.groups[o] |= set(rows_)
        cache.written[o] += rows_
        if s.layers[o].ratio == 2:
            c = p.compress[2]
            for row in c.tail_store_rows[(c.tail_store_rows >= lo) & (c.tail_store_rows < hi)]:
                cache.tail[o] = pos_of[int(row)]


def run_lifetime(s, prompt_len, cuts, decode_steps, hit=0, fresh=False, full=False, **flags):
    """Run one request through chunks ending at ``cuts`` and then decode; return its cache."""
    cache = Cache(s, cached_groups_below=hit if fresh else 0)
    bounds = [hit] + sorted(c for c in set(cuts) if hit < c < prompt_len) + [prompt_len]
    bt = tuple(range(40))
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        rq = RequestInput(slot=0, block_table=bt, prompt_len=prompt_len, start=a, chunk_len=b - a,
                          prefix_hit=hit, fresh_slot=fresh and k == 0, full_rows=full)  # fmt: skip
        p = plan_step(StepInput((rq,)), s, **flags)
        check_forward(cache, p, 0)
    for t in range(decode_steps):
        rq = RequestInput(slot=0, block_table=bt, prompt_len=prompt_len, start=prompt_len + t,
                          chunk_len=1, phase="decode")  # fmt: skip
        p = plan_step(StepInput((rq,), running_bs=2, running_tokens=4), s, **flags)
        check_forward(cache, p, 0)
        assert p.swa_replay_start[0] == 0 and p.encoder_window_floor[0] == 0
    return cache


prompts = st.integers(1, 150)


@SETTINGS
@given(
    name=st.sampled_from(sorted(SPECS)),
    prompt_len=prompts,
    cuts=st.lists(st.integers(1, 149), max_size=6),
    decode_steps=st.integers(0, 3),
    dec=st.booleans(),
    full=st.booleans(),
)
def test_every_read_was_produced_and_splits_write_the_unsplit_rows(
    name, prompt_len, cuts, decode_steps, dec, full
):
    s = SPECS[name]
    cache = run_lifetime(s, prompt_len, cuts, decode_steps, full=full, decoder_replay=dec)
    # Splitting the prompt anywhere writes exactly the unsplit prompt's groups, each once.
    final_len = prompt_len + decode_steps
    for o, written in cache.written.items():
        r = s.layers[o].ratio
        assert sorted(written) == list(range(final_len // r))


@SETTINGS
@given(
    name=st.sampled_from(sorted(SPECS)),
    blocks=st.integers(1, 3),
    suffix=st.integers(1, 90),
    cuts=st.lists(st.integers(1, 200), max_size=3),
    decode_steps=st.integers(0, 2),
    fresh=st.booleans(),
)
def test_prefix_hits_rebuild_or_resume_without_rewriting(
    name, blocks, suffix, cuts, decode_steps, fresh
):
    s = SPECS[name]
    hit = blocks * s.replay.hash_block_tokens
    prompt_len = hit + suffix
    if fresh:  # encoder replay: a fresh slot rebuilt from a block below the hit
        cache = run_lifetime(s, prompt_len, cuts, decode_steps, hit=hit, fresh=True)
        pre = {o: list(range(hit // s.layers[o].ratio)) for o in cache.written}
    else:  # copy transfer: the slot resumes from the state a forward ending at the hit left
        cache = run_lifetime(s, prompt_len, [hit, *cuts], decode_steps, encoder_replay=False)
        pre = {o: [] for o in cache.written}
    for o, written in cache.written.items():
        r = s.layers[o].ratio
        assert sorted(pre[o] + written) == list(range((prompt_len + decode_steps) // r))


request = st.tuples(
    st.integers(1, 120),  # prompt_len
    st.integers(0, 119),  # start (clipped below)
    st.integers(1, 60),  # chunk_len (clipped below)
    st.booleans(),  # decode
)


@SETTINGS
@given(
    reqs=st.lists(request, min_size=1, max_size=6),
    pad_bs=st.integers(0, 3),
    pad_tokens=st.integers(0, 20),
)
def test_batches_never_overlap_and_padding_writes_nothing(reqs, pad_bs, pad_tokens):
    rqs = []
    for slot, (prompt_len, start, chunk, decode) in enumerate(reqs):
        if decode:
            rqs.append(RequestInput(slot=slot, block_table=tuple(range(10)),
                                    prompt_len=prompt_len, start=prompt_len + start % 100,
                                    chunk_len=1, phase="decode"))  # fmt: skip
        else:
            start = start % prompt_len
            chunk = 1 + (chunk - 1) % (prompt_len - start)
            rqs.append(RequestInput(slot=slot, block_table=tuple(range(10)), prompt_len=prompt_len,
                                    start=start, chunk_len=chunk))  # fmt: skip
    probe = plan_step(StepInput(tuple(rqs)), TINY)
    n, total = len(rqs), probe.scheduled_tokens
    p = plan_step(
        StepInput(tuple(rqs), running_bs=n + pad_bs, running_tokens=total + pad_tokens), TINY
    )
    cu = p.cu_seqlens_q
    assert cu[0] == 0 and (np.diff(cu) >= 0).all() and (cu[n:] == total).all()
    # Every real row belongs to exactly one request, in order; positions are its forward.
    for i in range(n):
        assert (p.batch_ids[cu[i] : cu[i + 1]] == i).all()
        assert p.positions[cu[i] : cu[i + 1]].tolist() == list(
            range(p.forward_start[i], p.forward_end[i])
        )
        if p.is_decode[i]:  # decode never floors windows
            assert p.swa_replay_start[i] == 0 and p.encoder_window_floor[i] == 0
    assert (p.batch_ids[total:] == -1).all() and (p.positions[total:] == 0).all()
    assert (p.slots[n:] == -1).all() and (p.last_rows[n:] == -1).all()
    # Nothing reads or writes a padding row; rows of a set are unique and sorted.
    arrays = list(p.layer_rows.values()) + [p.tail_rows]
    for c in p.compress.values():
        arrays += [c.rows, c.tail_store_rows]
        assert (p.batch_ids[c.rows] == c.batch_ids).all()
        assert (p.batch_ids[c.tail_store_rows] == c.tail_store_batch_ids).all()
    for arr in arrays:
        assert ((arr >= 0) & (arr < total)).all()
        assert (np.diff(arr) > 0).all()
    assert (p.batch_ids[p.tail_rows] == p.tail_batch_ids).all()


@SETTINGS
@given(
    prompt_len=st.integers(1, 400),
    resume=st.integers(0, 399),
    budget=st.integers(0, 300),
    cap=st.one_of(st.none(), st.integers(1, 200)),
    hit_fresh=st.booleans(),
    dec=st.booleans(),
)
def test_chunk_choice_matches_the_plan(prompt_len, resume, budget, cap, hit_fresh, dec):
    from v41plan.planner.replay import choose_prefill_chunk, replay_start_for_spec

    s = TINY
    B = s.replay.hash_block_tokens
    resume %= prompt_len
    fresh = hit_fresh and resume > 0
    if fresh:
        resume -= resume % B  # a rebuild resumes at a hit, on the grid
    choice = choose_prefill_chunk(resume, prompt_len, budget, hash_block=B,
                                  min_final_rows=s.replay.min_final_prefill_rows,
                                  long_prefill_cap=cap, fresh_slot=fresh,
                                  decoder_replay=dec)  # fmt: skip
    point = replay_start_for_spec(s, resume, prompt_len, fresh_slot=fresh, decoder_replay=dec)
    if choice is None:  # the budget cannot carry the forward past the resume point
        assert budget - (resume - point.forward_start) < 1
        return
    assert choice.rows <= budget and (cap is None or choice.chunk_len <= cap)
    rq = RequestInput(slot=0, block_table=tuple(range(20)), prompt_len=prompt_len, start=resume,
                      chunk_len=choice.chunk_len, prefix_hit=resume if fresh else 0,
                      fresh_slot=fresh)  # fmt: skip
    p = plan_step(StepInput((rq,)), s, decoder_replay=dec)
    assert p.forward_start[0] == choice.forward_start == point.forward_start
    assert p.scheduled_tokens == choice.rows
    assert bool(p.is_final_chunk[0]) == choice.is_final_chunk
