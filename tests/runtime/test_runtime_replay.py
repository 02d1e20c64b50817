"""Bounded-replay stages, back-off, encoder rebuilds, checkpoint restore and padded steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import (
    PAIRS,
    cursor_expected,
    model,
    reference,
    runtime,
    step,
    token_ids,
)
from v41plan.planner.checkpoint import CopyPlanner, ImageOp

TABLE = (9, 7, 4, 2)
W, PAGE = 8, 32
N_REPLAY = W + PAGE + 12  # a prompt longer than W + PAGE


def _global_bytes(m) -> dict[str, torch.Tensor]:
    """Every owner's main and index planes (all pages) as bytes."""
    p = m.pools
    out = {
        f"main.{o}": t.reshape(t.shape[0], -1).contiguous().view(torch.uint8).clone()
        for o, t in p.main.items()
    }
    for name, views in (
        ("index", p.index),
        ("index_values", p.index_values),
        ("index_scales", p.index_scales),
    ):
        for o, t in views.items():
            out[f"{name}.{o}"] = t.contiguous().clone()
    return out


def _ring_bytes(m, slot, layers) -> torch.Tensor:
    return torch.stack([m.pools.rings[slot, L].contiguous().view(torch.uint8) for L in layers])


def _prefill(m, spec, ids, chunks, slot=1, table=TABLE, decoder_replay=False):
    m.pools.reset_slot(slot)
    done, out, plans = 0, None, []
    for n in chunks:
        plan = step(
            spec, [(slot, table, len(ids), done, n, "prefill")], decoder_replay=decoder_replay
        )
        out = m.forward(plan, ids[plan.forward_start[0] : done + n])
        plans.append(plan)
        done += n
    return out, plans


def test_decoder_replay_runs_fewer_decoder_rows_and_exactly_the_planned_rows():
    spec, *_ = model("tiny")
    ids = token_ids(N_REPLAY, 5)
    counts = {}
    for on in (True, False):
        m = runtime("tiny", "bf16", "fp8")
        _, plans = _prefill(m, spec, ids, (26, 26), decoder_replay=on)
        promised = {}
        for plan in plans:
            for key, rows in plan.layer_rows.items():
                promised[key] = promised.get(key, 0) + len(rows)
        ran = {k: v for k, v in m.row_counts.items() if k[1] != "compress_groups"}
        assert ran == {k: v for k, v in promised.items() if v}  # the rows the plan promised ran
        counts[on] = sum(
            v
            for (L, sub), v in ran.items()
            if L >= spec.last_kv_source and sub in ("attention", "ffn")
        )
        if on:  # the non-final chunk ran no decoder attention or FFN; the final one its tail only
            first = plans[0].layer_rows
            assert all(
                len(first[(L, s)]) == 0
                for L in range(spec.last_kv_source, 14)
                for s in ("attention", "ffn")
            )
            last = plans[1].layer_rows
            assert len(last[(13, "attention")]) == 1 and len(last[(12, "attention")]) == W
            assert len(last[(spec.last_kv_source, "compress")]) == 26
    assert counts[True] < counts[False]


# (97, 3): the short final chunk backs off to 64, recomputing rows 64..96 with windows truncated
# at 64; the group (96, 97) straddling the resume point must pair with the slot's tail
@pytest.mark.parametrize("chunks", [(26, 26), (97, 3)], ids=["two-chunks", "short-final-backs-off"])
def test_decoder_replay_keeps_the_encoder_and_global_path_exact(chunks):
    spec, *_ = model("tiny")
    ids = token_ids(sum(chunks), 6)
    runs = {}
    for on in (True, False):
        m = runtime("tiny", "fp4", "fp4")
        out, plans = _prefill(m, spec, ids, chunks, decoder_replay=on)
        runs[on] = (m, out, plans)
    (m_on, out_on, plans_on), (m_off, out_off, _) = runs[True], runs[False]
    if chunks == (97, 3):
        assert plans_on[-1].forward_start[0] == 64  # backed off a whole hash block, on the grid
    for name, t in _global_bytes(m_on).items():
        assert torch.equal(t, _global_bytes(m_off)[name]), name
    enc = range(spec.last_kv_source)
    assert torch.equal(_ring_bytes(m_on, 1, enc), _ring_bytes(m_off, 1, enc))
    assert torch.equal(m_on.pools.tail_values[1], m_off.pools.tail_values[1])
    # the candidate source's selections on the tail rows from the resume point on equal the
    # dense reference's (rows a backed-off forward recomputes below it saw truncated windows)
    _, ref_sel = reference("tiny", "fp4", 6, sum(chunks))
    last = plans_on[-1]
    tail = torch.from_numpy(last.tail_rows.astype(np.int64))
    tail = tail[torch.from_numpy(last.positions)[tail] >= int(last.resume_points[0])]
    assert tail.numel() >= min(W, chunks[-1])
    L = spec.last_kv_source
    assert torch.equal(m_on.selections[L][tail], ref_sel[L][torch.from_numpy(last.positions)[tail]])
    assert m_on.pools.cursor[1].tolist() == m_off.pools.cursor[1].tolist()
    assert torch.isfinite(out_on.logits[0]).all() and not torch.equal(
        out_on.logits[0], out_off.logits[0]
    )


def test_encoder_replay_rebuilds_rings_in_a_fresh_slot_without_rewriting_cached_kv():
    spec, _, _, eng = model("tiny")
    shared = token_ids(64, 7)
    x_ids = np.concatenate([shared, token_ids(12, 8)])
    y_ids = np.concatenate([shared, token_ids(12, 9)])
    m = runtime("tiny", "bf16", "fp8")
    _prefill(m, spec, x_ids, (76,), slot=1, table=(9, 7, 4))
    before = _global_bytes(m)
    # Y hits X's first two pages (64 tokens) and resumes in a fresh slot with its own last pages
    m.pools.reset_slot(2)
    plan = step(
        spec,
        [(2, (9, 7, 5), 76, 64, 12, "prefill", True, tuple(int(t) for t in eng.compress(y_ids)))],
        encoder_replay=True,
    )
    assert plan.forward_start[0] == 32 and plan.write_from[0] == 64
    out = m.forward(plan, y_ids[32:76], all_row_logits=True)
    after = _global_bytes(m)
    for o in (2, 4, 6, 8):
        rows = m.pools.rows_per_page[o]
        for page in (9, 7):  # the hit's pages: nothing below the hit rewritten
            assert torch.equal(after[f"main.{o}"][page], before[f"main.{o}"][page])
            planes = [k for k in after if k.endswith(f".{o}") and not k.startswith("main")]
            for k in planes:
                assert torch.equal(after[k][page], before[k][page]), (k, page, rows)
    assert m.pools.cursor[2].tolist() == cursor_expected(eng, y_ids, 76)
    # the rebuilt rings hold Y's last W positions; Y's logits approximate a cold prefill's
    cold = runtime("tiny", "bf16", "fp8")
    ref_out, _ = _prefill(cold, spec, y_ids, (76,), slot=1, table=(9, 7, 5))
    rel = ((out.logits[0] - ref_out.logits[0]).abs().max() / ref_out.logits[0].abs().max()).item()
    assert rel < 0.5


def test_restored_image_resumes_with_identical_logits_and_overwrites_its_own_tails():
    spec, _, _, _eng = model("tiny")
    ids = token_ids(140, 10)
    first, rest = (3, 1, 124), (7, 5)  # 128 = a PAGE boundary; 135 leaves an open ratio-2 group
    ref = runtime("tiny", "bf16", "fp4")
    ref_logits, ref_tails = [], []
    ref.pools.reset_slot(1)
    done = 0
    for n in first + rest:
        plan = step(spec, [(1, TABLE + (11, 12), 140, done, n, "prefill")])
        ref_logits.append(ref.forward(plan, ids[done : done + n]).logits[0])
        ref_tails.append(ref.pools.tail_values[1].clone())
        done += n
    m = runtime("tiny", "bf16", "fp4")
    m.pools.reset_slot(1)
    done = 0
    for n in first:
        plan = step(spec, [(1, TABLE + (11, 12), 140, done, n, "prefill")])
        m.forward(plan, ids[done : done + n])
        done += n
    # store at the PAGE boundary and restore into slot 3, by the planner's copy schedule
    g = m.geometry
    units = (20, 17)[: g.units_per_image]
    cp = CopyPlanner(g, m.pools.num_pages, m.pools.num_slots)
    m.pools.state[3].fill_(0xFF)  # the destination slot's own tails: NaN bytes
    for spans in (
        cp.store(ImageOp(1, units, g.layout_id, g.image_bytes)),
        cp.restore(ImageOp(3, units, g.layout_id, g.image_bytes)),
    ):
        m.pools.copy_spans(cp.regions, spans, m.backend)
    assert torch.isnan(m.pools.tail_values[3]).all()
    for i, n in enumerate(rest):
        plan = step(spec, [(3, TABLE + (11, 12), 140, done, n, "prefill")])
        got = m.forward(plan, ids[done : done + n]).logits[0]
        assert torch.equal(got, ref_logits[len(first) + i])
        done += n
        if i == 0:  # the resumed forward wrote the open group's tail before anything read it
            assert torch.equal(m.pools.tail_values[3], ref_tails[len(first)])
    assert m.pools.cursor[3].tolist() == ref.pools.cursor[1].tolist()


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_a_padded_step_changes_no_byte(pair):
    spec, *_ = model("tiny")
    m = runtime("tiny", *pair)
    m.pools.backing.fill_(0x3C)
    before = m.pools.backing.clone()
    plan = step(spec, [], pad_tokens=4, pad_bs=2)
    assert plan.graph_key == ("decode", 2, 4)
    m.forward(plan, np.zeros(4, dtype=np.int64))
    assert torch.equal(m.pools.backing, before)
    assert sum(m.row_counts.values()) == 0


def test_padding_rows_next_to_a_real_request_touch_only_its_slot_and_pages():
    spec, *_ = model("tiny")
    m = runtime("tiny", "fp4", "fp8")
    m.pools.backing.fill_(0x3C)
    before = m.pools.backing.clone()
    plan = step(spec, [(2, (5, 3), 40, 0, 40, "prefill")], pad_tokens=5, pad_bs=2)
    m.forward(plan, token_ids(40, 3))
    changed = torch.zeros_like(m.pools.backing, dtype=torch.bool)
    changed |= m.pools.backing != before
    touched = torch.zeros_like(changed)
    g = m.geometry
    p0 = m.pools.page_region[0]
    for page in (5, 3):
        touched[p0 + page * g.page_bytes : p0 + (page + 1) * g.page_bytes] = True
        for pl in g.planes:
            if pl.kind != "main":
                base = m.pools.region_bases()[pl.name] + page * pl.bytes_per_page
                touched[base : base + pl.bytes_per_page] = True
    s0 = m.pools.state_region[0] + 2 * g.state_bytes
    touched[s0 : s0 + g.state_bytes] = True
    assert changed.any() and not (changed & ~touched).any()


def test_one_step_mixes_decode_a_rebuild_with_a_tail_and_a_nonfinal_chunk_under_both_replays():
    spec, _, _, eng = model("tiny")
    ids = {k: token_ids(120, 30 + k) for k in range(3)}
    ids[1] = np.concatenate([ids[0][:64], ids[1][64:]])  # request 1 hits request 0's first 64
    m = runtime("tiny", "fp4", "fp8")
    for s in (1, 2, 3):
        m.pools.reset_slot(s)
    m.forward(step(spec, [(1, (9, 7, 4, 2), 120, 0, 120, "prefill")], decoder_replay=True), ids[0])
    hit = _global_bytes(m)
    c1 = tuple(int(x) for x in eng.compress(ids[1]))
    plan = step(
        spec,
        [
            (1, (9, 7, 4, 2, 5), 120, 120, 1, "decode"),
            (2, (9, 7, 10, 11), 120, 64, 56, "prefill", True, c1),  # rebuild, finishes its prompt
            (3, (12, 13, 14, 15), 120, 0, 40, "prefill"),  # does not finish its prompt
        ],
        decoder_replay=True,
        encoder_replay=True,
        pad_tokens=3,
        pad_bs=1,
    )
    assert plan.forward_start.tolist()[:3] == [120, 32, 0] and plan.tail_start.tolist()[:3] == [
        -1,
        112,
        -1,
    ]
    m.row_counts.clear()
    flat = np.concatenate([[7], ids[1][32:120], ids[2][:40]])
    out = m.forward(plan, flat)
    promised = {k: len(v) for k, v in plan.layer_rows.items() if len(v)}
    assert {k: v for k, v in m.row_counts.items() if k[1] != "compress_groups"} == promised
    after = _global_bytes(m)
    for name in hit:
        assert torch.equal(after[name][[9, 7]], hit[name][[9, 7]]), name
    # the decode and the finishing rebuild have logits; the chunk that does not finish its
    # prompt ran no decoder row (NaN, never numbers); the padding request is zero
    assert torch.isfinite(out.logits[:2]).all() and torch.isnan(out.logits[2]).all()
    assert not out.logits[3].any()
    assert m.pools.cursor[1].tolist() == cursor_expected(eng, np.concatenate([ids[0], [7]]), 121)
    assert m.pools.cursor[2].tolist() == cursor_expected(eng, ids[1], 120)
    assert m.pools.cursor[3].tolist() == cursor_expected(eng, ids[2], 40)


def test_row_counts_fold_keeps_the_log_bounded_and_the_sums():
    """Unread per-step row counts are folded every ``row_count_fold_steps`` steps: the log stays
    bounded and the sums equal those of reading after every step."""
    spec, *_ = model("tiny")
    m = runtime("tiny", *PAIRS[0])
    m.row_count_fold_steps = 2
    plan = step(spec, [(0, (1, 2), 40, 0, 40, "prefill")])
    ids = np.arange(40, dtype=np.int64) % 200
    for _ in range(5):
        m.prepare(plan, ids)
        assert len(m._row_count_log) < 2
    per_step = {k: len(v) for k, v in plan.layer_rows.items() if len(v)}
    got = {k: v for k, v in m.row_counts.items() if k[1] != "compress_groups"}
    assert got == {k: 5 * n for k, n in per_step.items()}
