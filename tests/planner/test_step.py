"""plan_step hand cases: one test per rule, numbers worked out by hand.

TINY: W = 8, hash block = PAGE = 32, min_final_prefill_rows = 8, 3 history ids; layers 0..7
encoder, 8 the last KV source, 13 the last layer; owners 2, 4, 6 (ratio 2) and 8 (ratio 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.planner.helpers import spec
from v41plan.planner.step import PlanError, RequestInput, StepInput, plan_step

TINY = spec("tiny")


def req(slot, prompt_len, start, chunk_len, **kw):
    kw.setdefault("block_table", tuple(range(slot * 100, slot * 100 + 40)))
    return RequestInput(slot=slot, prompt_len=prompt_len, start=start, chunk_len=chunk_len, **kw)


def plan(*reqs, s=TINY, bs=None, tokens=None, **kw):
    return plan_step(StepInput(tuple(reqs), running_bs=bs, running_tokens=tokens), s, **kw)


def rows(p, layer, sub):
    return p.layer_rows[(layer, sub)].tolist()


def test_single_whole_prompt():
    p = plan(req(0, 20, 0, 20))
    assert p.positions.tolist() == list(range(20))
    assert p.cu_seqlens_q.tolist() == [0, 20]
    assert p.is_final_chunk.tolist() == [True]
    assert (p.forward_start[0], p.forward_end[0], p.write_from[0], p.cached_until[0]) == (
        0,
        20,
        0,
        0,
    )
    assert p.tail_start.tolist() == [12] and p.swa_replay_start.tolist() == [12]
    assert p.tail_rows.tolist() == list(range(12, 20))
    assert p.last_rows.tolist() == [19]
    for layer in range(8):  # the encoder: every row
        assert rows(p, layer, "attention") == list(range(20))
    assert rows(p, 8, "compress") == list(range(20))
    assert rows(p, 8, "attention") == list(range(12, 20))
    assert rows(p, 13, "ring_write") == list(range(12, 20))
    assert rows(p, 13, "attention") == rows(p, 13, "ffn") == [19]
    c2 = p.compress[2]
    assert c2.rows.tolist() == list(range(1, 20, 2))
    assert c2.compressed_rows.tolist() == list(range(10))
    assert c2.rope_positions.tolist() == list(range(0, 20, 2))
    assert not c2.first_from_tail.any() and c2.tail_store_rows.tolist() == []
    c1 = p.compress[1]
    assert c1.rows.tolist() == list(range(20)) and c1.rope_positions.tolist() == list(range(20))
    assert p.visible[2].tolist() == [(i + 1) // 2 for i in range(20)]
    assert p.visible[1].tolist() == [i + 1 for i in range(20)]
    assert p.graph_key == ("prefill_replay", 1, 20) and p.decoder_replay
    assert [s.name for s in p.stages] == ["early", "layer8", "late", "layer13"]
    assert p.stages[2].rows["attention"].tolist() == list(range(12, 20))
    assert p.stages[2].rows["compress"].tolist() == []


def test_prompt_shorter_than_the_window():
    p = plan(req(0, 5, 0, 5))
    assert p.forward_start.tolist() == [0] and p.tail_start.tolist() == [0]
    assert p.tail_rows.tolist() == [0, 1, 2, 3, 4]
    assert rows(p, 13, "attention") == [4]
    # End 5 is odd: the ratio-2 group (4, 5) is open; position 4 goes to the FP32 tail.
    assert p.compress[2].tail_store_rows.tolist() == [4]
    assert p.compress[2].rows.tolist() == [1, 3]


def test_multi_chunk_prompt():
    a = plan(req(0, 100, 0, 40))
    assert a.is_final_chunk.tolist() == [False] and a.tail_start.tolist() == [-1]
    assert rows(a, 8, "attention") == [] and rows(a, 8, "ring_write") == []
    assert rows(a, 8, "compress") == list(range(40)) and rows(a, 7, "ffn") == list(range(40))
    assert rows(a, 13, "attention") == [] and a.tail_rows.tolist() == []
    b = plan(req(0, 100, 40, 50))
    assert b.positions.tolist() == list(range(40, 90)) and b.is_final_chunk.tolist() == [False]
    c = plan(req(0, 100, 90, 10))  # 10 rows >= W: no back-off
    assert c.forward_start.tolist() == [90] and c.tail_start.tolist() == [92]
    assert c.tail_rows.tolist() == list(range(2, 10))
    assert c.swa_replay_start.tolist() == [92] and not c.history_from_plan[0]


def test_short_final_chunk_backs_off_on_the_grid():
    ids = tuple(range(1000, 1100))
    p = plan(req(0, 100, 95, 5, token_ids=ids))
    # (95 // 32 - 1) * 32 = 32
    assert (p.forward_start[0], p.forward_end[0]) == (32, 100)
    assert (p.write_from[0], p.cached_until[0], p.swa_cached_until[0]) == (95, 95, 95)
    assert p.tail_start.tolist() == [92] and p.swa_replay_start.tolist() == [92]
    assert p.positions.tolist() == list(range(32, 100))
    assert p.tail_rows.tolist() == list(range(60, 68))
    assert p.last_rows.tolist() == [67]
    # Groups ending below 95 are cached: ratio 2 writes (94, 95), (96, 97), (98, 99).
    c2 = p.compress[2]
    assert c2.compressed_rows.tolist() == [47, 48, 49]
    assert c2.rope_positions.tolist() == [94, 96, 98]
    assert c2.rows.tolist() == [95 - 32, 97 - 32, 99 - 32]
    # 94 is below the resume point: the slot's tail holds it exactly as a forward resuming at 95
    # reads it (the recomputed row 94 saw windows cut at the forward start)
    assert c2.first_from_tail.tolist() == [True, False, False]
    assert p.compress[1].compressed_rows.tolist() == [95, 96, 97, 98, 99]
    # Engram history: the 3 ids before the forward's first row, oldest first.
    assert p.history_from_plan.tolist() == [True]
    assert p.history_ids.tolist() == [[1029, 1030, 1031]]
    assert p.encoder_window_floor.tolist() == [0]


def test_prefix_hit_with_short_suffix_copy_transfer():
    # The image restored the slot at 64; 6 rows remain: back off to 32 in the same slot.
    p = plan(req(0, 70, 64, 6, prefix_hit=64), encoder_replay=False)
    assert (p.forward_start[0], p.write_from[0], p.cached_until[0]) == (32, 64, 64)
    assert p.prefix_hits.tolist() == [64] and p.encoder_window_floor.tolist() == [0]
    assert p.compress[2].compressed_rows.tolist() == [32, 33, 34]


def test_encoder_replay_rebuild():
    ids = tuple(range(500, 700))
    p = plan(req(3, 200, 64, 136, prefix_hit=64, fresh_slot=True, token_ids=ids))
    assert (p.forward_start[0], p.write_from[0]) == (32, 64)
    assert (p.cached_until[0], p.swa_cached_until[0], p.encoder_window_floor[0]) == (32, 32, 32)
    assert p.prefix_hits.tolist() == [64]  # the hit stays the reported hit
    assert p.tail_start.tolist() == [192] and p.swa_replay_start.tolist() == [192]
    assert p.history_ids.tolist() == [[529, 530, 531]]
    assert p.compress[2].compressed_rows[0] == 32 and p.compress[1].compressed_rows[0] == 64


def test_rebuild_at_the_first_block_has_dead_history():
    p = plan(req(0, 100, 32, 20, prefix_hit=32, fresh_slot=True, token_ids=tuple(range(100))))
    assert p.forward_start.tolist() == [0] and p.history_ids.tolist() == [[-1, -1, -1]]
    assert p.is_final_chunk.tolist() == [False] and p.swa_replay_start.tolist() == [0]


def test_history_marks_dead_ids_and_missing_token_ids():
    ids = (7, 8, -1, 9) + tuple(range(60))
    p = plan(req(0, 40, 35, 5, token_ids=ids))  # backs off to 0: no history at all
    assert p.history_ids.tolist() == [[-1, -1, -1]]
    p = plan(req(0, 70, 66, 4, token_ids=ids[:33]))  # backs off to 32: ids 29, 30 given
    assert p.history_ids.tolist() == [[ids[29], ids[30], ids[31]]]
    p = plan(req(0, 70, 66, 4, token_ids=ids[:31]))  # position 31 missing
    assert p.history_ids.tolist() == [[ids[29], ids[30], -1]]
    p = plan(req(0, 70, 66, 4))  # no ids given
    assert p.history_ids.tolist() == [[-1, -1, -1]]


def test_odd_resume_reads_the_fp32_tail():
    a = plan(req(0, 100, 0, 41))
    assert a.compress[2].tail_store_rows.tolist() == [40]  # (40, 41) is open at the end
    b = plan(req(0, 100, 41, 59))
    c2 = b.compress[2]
    assert c2.compressed_rows[0] == 20 and c2.rope_positions[0] == 40 and c2.rows[0] == 0
    assert c2.first_from_tail.tolist() == [True] + [False] * (len(c2.rows) - 1)


def test_decode_never_floors_windows():
    p = plan(req(0, 10, 12, 1, phase="decode"), req(1, 10, 13, 1, phase="decode"))
    assert p.graph_key == ("decode", 2, 2) and not p.decoder_replay
    assert p.positions.tolist() == [12, 13]
    assert p.swa_replay_start.tolist() == [0, 0] and p.tail_start.tolist() == [-1, -1]
    assert p.is_final_chunk.tolist() == [True, True]
    for layer in range(14):
        assert rows(p, layer, "attention") == [0, 1]
    c2 = p.compress[2]
    assert c2.rows.tolist() == [1] and c2.first_from_tail.tolist() == [True]
    assert c2.rope_positions.tolist() == [12] and c2.tail_store_rows.tolist() == [0]
    assert p.tail_rows.tolist() == [0, 1] and p.last_rows.tolist() == [0, 1]


def test_padding_writes_nothing():
    p = plan(req(0, 20, 0, 20), req(1, 10, 12, 1, phase="decode"), bs=4, tokens=32)
    assert p.cu_seqlens_q.tolist() == [0, 20, 21, 21, 21]
    assert p.batch_ids[21:].tolist() == [-1] * 11 and p.positions[21:].tolist() == [0] * 11
    assert p.slots.tolist() == [0, 1, -1, -1] and p.last_rows.tolist() == [19, 20, -1, -1]
    assert (p.block_tables[2:] == -1).all()
    assert all(v[21:].tolist() == [0] * 11 for v in p.visible.values())
    for arr in list(p.layer_rows.values()) + [p.tail_rows]:
        assert (arr < 21).all()
    for c in p.compress.values():
        assert (c.rows < 21).all() and (c.tail_store_rows < 21).all()
    assert p.graph_key == ("prefill_replay", 4, 32)


def test_mixed_ragged_batch():
    p = plan(
        req(0, 100, 0, 30),  # non-final
        req(1, 60, 50, 10),  # final, tail [52, 60)
        req(2, 9, 20, 1, phase="decode"),
        req(3, 100, 97, 3),  # short final: backs off to 64
    )
    assert p.cu_seqlens_q.tolist() == [0, 30, 40, 41, 77]
    assert p.forward_start.tolist() == [0, 50, 20, 64]
    assert p.tail_start.tolist() == [-1, 52, -1, 92]
    tail1 = list(range(32, 40))
    decode = [40]
    tail3 = list(range(41 + 28, 77))
    assert p.tail_rows.tolist() == tail1 + decode + tail3
    assert p.tail_batch_ids.tolist() == [1] * 8 + [2] + [3] * 8
    assert rows(p, 8, "attention") == tail1 + decode + tail3
    assert rows(p, 13, "attention") == [39, 40, 76]
    assert rows(p, 3, "ffn") == list(range(77))
    assert rows(p, 8, "compress") == list(range(77))
    assert p.write_from.tolist() == [0, 50, 20, 97]
    assert p.compress[1].compressed_rows.tolist() == list(range(30)) + list(range(50, 60)) + [
        20,
        97,
        98,
        99,
    ]


def test_decoder_replay_off():
    p = plan(req(0, 100, 95, 5), decoder_replay=False)
    assert p.forward_start.tolist() == [95]  # no back-off needed
    assert p.tail_start.tolist() == [-1] and p.swa_replay_start.tolist() == [0]
    assert p.graph_key == ("prefill", 1, 5) and [s.name for s in p.stages] == ["backbone"]
    for layer in range(14):
        assert rows(p, layer, "attention") == list(range(5))


def test_flash_final_chunk():
    s = spec("deepseek_v41_flash")
    p = plan(req(0, 1000, 896, 104, block_table=tuple(range(8))), s=s)
    assert (p.forward_start[0], p.write_from[0]) == (768, 896)  # 104 < 128: back off a block
    assert p.tail_start.tolist() == [872] and len(p.tail_rows) == 128
    assert len(p.layer_rows[(20, "compress")]) == 232
    assert len(p.layer_rows[(30, "ffn")]) == 128 and p.layer_rows[(39, "ffn")].tolist() == [231]


def test_arrays_have_declared_dtypes_and_widths():
    p = plan(req(0, 20, 0, 20), bs=2, tokens=24)
    assert p.positions.dtype == np.int64 and p.positions.shape == (24,)
    assert p.batch_ids.dtype == np.int32 and p.cu_seqlens_q.dtype == np.int32
    assert p.cu_seqlens_q.shape == (3,) and p.slots.shape == (2,)
    assert p.history_ids.shape == (2, 3) and p.block_tables.shape == (2, 40)


@pytest.mark.parametrize(
    ("r", "kw", "match"),
    [
        (req(0, 10, 11, 1), {}, "start 11 is not inside the prompt"),
        (req(0, 10, 5, 6), {}, r"chunk \[5, 11\) runs past the prompt end 10"),
        (req(0, 10, -1, 2), {}, "start -1 must be >= 0"),
        (req(0, 10, 0, 0), {}, "chunk_len 0 must be >= 1"),
        (req(0, 0, 0, 1), {}, "prompt_len 0 must be >= 1"),
        (req(0, 100, 40, 10, prefix_hit=33), {}, "not on the hash-block grid"),
        (req(0, 100, 40, 10, prefix_hit=64), {}, "past the resume point"),
        (req(0, 10, 5, 1, phase="decode"), {}, "decode start 5 is inside the prompt"),
        (req(0, 100, 0, 80, block_table=(1, 2)), {}, "block table holds 2 pages"),
        (
            req(0, 100, 64, 10, prefix_hit=64, fresh_slot=True),
            {"encoder_replay": False},
            "needs a restored image",
        ),
        (req(-1, 10, 0, 10), {}, "slot -1"),
        (
            req(0, 100, 95, 5, fresh_slot=True),
            {"encoder_replay": True},
            "fresh-slot rebuild resumes at 95, off the hash-block grid",
        ),
    ],
)
def test_invalid_requests_are_refused(r, kw, match):
    with pytest.raises(PlanError, match=match):
        plan(r, **kw)


def test_invalid_widths_and_slots():
    with pytest.raises(PlanError, match="running_tokens 10 is smaller than the 20"):
        plan(req(0, 20, 0, 20), tokens=10)
    with pytest.raises(PlanError, match="running_bs 1 is smaller than the 2"):
        plan(req(0, 20, 0, 20), req(1, 20, 0, 20), bs=1)
    with pytest.raises(PlanError, match="share STATE slot 0"):
        plan(req(0, 20, 0, 20), req(0, 20, 0, 20))
    with pytest.raises(PlanError, match="phase"):
        plan(req(0, 20, 0, 20, phase="verify"))


def test_step_arrays_from_ragged_tuple_and_array_tables():
    from v41plan.planner.step import step_arrays

    reqs = (req(0, 20, 0, 20, block_table=(5,)), req(1, 70, 0, 70, block_table=(7, 8, 9)))
    a = step_arrays(StepInput(reqs))
    assert a.block_tables.tolist() == [[5, -1, -1], [7, 8, 9]]
    reqs_np = tuple(
        RequestInput(r.slot, np.asarray(r.block_table), r.prompt_len, r.start, r.chunk_len)
        for r in reqs
    )
    assert (step_arrays(StepInput(reqs_np)).block_tables == a.block_tables).all()
    p, q = plan_step(StepInput(reqs), TINY), plan_step(a, TINY)
    assert (p.block_tables == q.block_tables).all() and (p.positions == q.positions).all()
    assert p.block_tables.dtype == np.int32 and p.block_tables.tolist() == [[5, -1, -1], [7, 8, 9]]


def test_full_rows_request_runs_every_layer_without_back_off():
    p = plan(req(0, 100, 95, 5, full_rows=True), req(1, 100, 95, 5))
    # Request 0 opts out of decoder replay: no back-off, no tail, every row everywhere.
    assert p.forward_start.tolist() == [95, 32] and p.tail_start.tolist() == [-1, 92]
    assert p.row_phase.tolist() == [2, 1] and p.swa_replay_start.tolist() == [0, 92]
    assert rows(p, 13, "attention") == [0, 1, 2, 3, 4, 72]
    assert rows(p, 10, "ffn") == [0, 1, 2, 3, 4] + list(range(65, 73))
    assert p.tail_rows.tolist() == [0, 1, 2, 3, 4] + list(range(65, 73))
    ring_cu, ring_scu = p.ring_limits(10)
    assert ring_cu.tolist() == [95, 32] and ring_scu.tolist() == [95, 32]
    assert p.ring_limits(3)[0].tolist() == [95, 95]  # encoder layers keep cached rows in both
    assert p.decoder_replay
