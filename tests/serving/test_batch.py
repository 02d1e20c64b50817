"""The batch contract: slot tables follow the deltas, and a step's columnar input reads them."""

from __future__ import annotations

import numpy as np

from v41plan.serving.batch import (
    ScheduledBatch,
    ScheduledRequest,
    SlotDelta,
    SlotTables,
    history_window,
    step_token_ids,
    to_step_input,
)


def _delta(slot, tokens, blocks, t0=0, b0=0, reset=True):
    return SlotDelta(slot, reset, t0, np.asarray(tokens), b0, np.asarray(blocks, dtype=np.int32))


def test_tables_follow_resets_appends_and_frees():
    t = SlotTables(num_slots=3, max_pages=4)
    t.apply(ScheduledBatch(1, "prefill", (), deltas=(_delta(1, [5, 6, 7], [3, 9]),)))
    assert t.num_tokens[1] == 3 and t.last_token[1] == 7
    assert t.blocks[1].tolist() == [3, 9, -1, -1] and t.num_blocks[1] == 2
    t.apply(
        ScheduledBatch(2, "decode", (), append_slots=np.array([1]), append_tokens=np.array([8]))
    )
    assert t.tokens(1, 0, 4).tolist() == [5, 6, 7, 8] and t.last_token[1] == 8
    t.apply(ScheduledBatch(3, "decode", (), deltas=(_delta(1, [], [4], 4, 2, False),)))
    assert t.blocks[1].tolist() == [3, 9, 4, -1]
    t.apply(ScheduledBatch(4, "decode", (), freed_slots=(1,)))
    assert t.num_tokens[1] == 0 and (t.blocks[1] == -1).all()


def test_a_delta_that_skips_tokens_is_refused():
    t = SlotTables(num_slots=1, max_pages=2)
    t.apply(ScheduledBatch(1, "prefill", (), deltas=(_delta(0, [1, 2], [0]),)))
    try:
        t.apply(ScheduledBatch(2, "decode", (), deltas=(_delta(0, [3], [], 3, 1, False),)))
    except RuntimeError as exc:
        assert "delta at token 3" in str(exc)
    else:
        raise AssertionError("a delta past the runner's tokens was accepted")


def test_step_input_reads_block_tables_tokens_and_the_history_window():
    """A prefill's Engram history window is the compressed ids of exactly the positions before
    its resume point (-1 below the window), decode rows carry none, and the step's token ids
    and block tables are the tables' rows."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 250, 300)
    t = SlotTables(num_slots=2, max_pages=12)
    t.apply(
        ScheduledBatch(
            1, "prefill", (),
            deltas=(_delta(0, toks, range(10)), _delta(1, toks[:41], [11])),
        )
    )  # fmt: skip
    reqs = (
        ScheduledRequest(0, 0, 160, 192, 230, 300, 192, True, False),  # a rebuild at 192
        ScheduledRequest(1, 1, 40, 40, 41, 40, 0, False, True),  # a decode row
    )
    batch = ScheduledBatch(2, "prefill", reqs)
    compress = lambda ids: (np.asarray(ids) * 7 + 3) % 200
    hist = history_window(3, 32)
    step = to_step_input(batch, t, compress, history=hist)
    win = step.token_ids[0]
    assert len(win) == 192 and step.token_ids[1] is None
    assert (win[: 192 - hist] == -1).all()
    assert win[192 - hist :].tolist() == compress(toks[192 - hist : 192]).tolist()
    assert step.block_tables[0, :10].tolist() == list(range(10))
    assert step.block_tables[1, :1].tolist() == [11]
    assert step.starts.tolist() == [192, 40] and step.chunk_lens.tolist() == [38, 1]
    assert step.is_decode.tolist() == [False, True]
    ids = step_token_ids(batch, t)
    assert ids.tolist() == toks[160:230].tolist() + [int(toks[40])]


def test_a_decode_batch_takes_the_short_column_path_to_the_same_step():
    """A decode batch's step input (four columns built, the rest constants) equals the one the
    general path builds for the same requests, and its token ids are the slots' last tokens."""
    t = SlotTables(num_slots=3, max_pages=4)
    t.apply(
        ScheduledBatch(
            1, "prefill", (),
            deltas=(_delta(0, [5, 6, 7], [3]), _delta(2, [1, 2, 3, 4, 9], [0, 1])),
        )
    )  # fmt: skip
    reqs = (
        ScheduledRequest(7, 2, 5, 5, 6, 4, 0, False, True),
        ScheduledRequest(3, 0, 3, 3, 4, 2, 32, False, True),
    )
    fast = to_step_input(ScheduledBatch(2, "decode", reqs), t)
    general = to_step_input(ScheduledBatch(2, "prefill", reqs), t)
    for name in ("slots", "block_tables", "prompt_lens", "starts", "chunk_lens", "is_decode",
                 "prefix_hits", "fresh_slot", "full_rows"):  # fmt: skip
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert step_token_ids(ScheduledBatch(2, "decode", reqs), t).tolist() == [9, 7]


def test_check_plan_refuses_starts_the_scheduler_did_not_count():
    from types import SimpleNamespace

    from v41plan.serving.batch import check_plan

    reqs = (ScheduledRequest(1, 0, 5, 5, 6, 4, 0, False, True),)
    batch = ScheduledBatch(4, "decode", reqs)
    check_plan(batch, SimpleNamespace(forward_start=np.array([5, 0]), scheduled_bs=1))
    try:
        check_plan(batch, SimpleNamespace(forward_start=np.array([3, 0]), scheduled_bs=1))
    except RuntimeError as exc:
        assert "planner starts [3] != scheduler starts [5]" in str(exc)
    else:
        raise AssertionError("a differing forward start was accepted")
