"""The columnar decode batch: the scheduler's per-slot rows stay equal to its requests, a decode
step's columns are the per-request spans, the vectorised stop checks are the scalar ones, and
tokens do not change when requests finish, join, stop or are preempted around each other."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tests.serving.helpers import fake_llm, prompt
from v41plan.serving.batch import RequestColumns, ScheduledRequest
from v41plan.serving.sampling import SamplingParams
from v41plan.serving.sequence import Sequence

IGNORE = SamplingParams(max_tokens=12, ignore_eos=True)


def solo(p: list[int], params: SamplingParams, **options) -> Sequence:
    """``p`` run alone (the uninterrupted reference)."""
    llm = fake_llm(**options)
    s = llm.add_request(p, params)
    llm.run_until_done()
    return s


def check_rows(llm) -> None:
    """Every running request past its prefill has a row equal to its record, no other has one,
    and the rows' order is the queue's."""
    sched, rows = llm.scheduler, llm.scheduler.rows
    decoding = [s for s in sched.running if s.num_cached_tokens >= s.prefill_end]
    members, slots = sched._members()
    assert members == decoding and slots.tolist() == [s.slot for s in decoding]
    assert sorted(np.flatnonzero(rows.seq_id >= 0).tolist()) == sorted(slots.tolist())
    for s in decoding:
        k = s.slot
        assert rows.seq[k] is s and rows.seq_id[k] == s.seq_id
        assert rows.pos[k] == s.num_cached_tokens and rows.prompt_len[k] == s.prefill_end
        assert rows.num_tokens[k] == len(s.token_ids) and rows.last_token[k] == s.token_ids[-1]
        assert rows.num_blocks[k] == len(s.block_table)
        assert rows.published[k] == s.num_published_blocks
        assert rows.prefix_hit[k] == (s.hits[-1] if s.hits else 0)


def per_request_spans(llm) -> list[ScheduledRequest]:
    """The decode rows a per-request scheduler builds for the running requests (one
    ``ScheduledRequest`` each, in queue order)."""
    spans = []
    for s in llm.scheduler.running:
        pos, hit = s.num_cached_tokens, s.hits[-1] if s.hits else 0
        if pos >= s.prefill_end:
            spans.append(ScheduledRequest(s.seq_id, s.slot, pos, pos, pos + 1, s.prefill_end,
                                          hit, False, True))  # fmt: skip
    return spans


def drive(llm, check=True, on_step=None) -> int:
    """Step ``llm`` until it drains, checking the rows and each decode batch's columns."""
    steps = 0
    while llm.has_unfinished():
        if on_step is not None:
            on_step(steps)
        want, before = per_request_spans(llm), list(llm.scheduler.running)
        batch = llm.scheduler.schedule()
        if batch is None:
            break
        preempted = any(s not in llm.scheduler.running for s in before)
        if check and batch.phase == "decode" and not preempted:  # (the budget may cut rows)
            assert list(batch.requests) == want[: len(batch.requests)]
        llm.scheduler.postprocess(batch, llm.runner.execute(batch))
        if check:
            check_rows(llm)
        steps += 1
        assert steps < 2000
    return steps


def test_request_columns_are_the_requests():
    reqs = (
        ScheduledRequest(3, 1, 0, 0, 17, 40, 0, True, False, True),
        ScheduledRequest(5, 0, 32, 48, 60, 60, 48, True, True),
    )
    cols = RequestColumns.from_requests(reqs)
    assert list(cols) == list(reqs) and len(cols) == 2 and cols.row(1) == reqs[1]
    assert cols.chunk_len.tolist() == [17, 28] and cols.all_logits.tolist() == [True, False]
    dec = RequestColumns.decode(np.array([9, 4]), np.array([2, 3]), np.array([50, 61]),
                                np.array([40, 60]), np.array([0, 32]))  # fmt: skip
    want = [ScheduledRequest(9, 2, 50, 50, 51, 40, 0, False, True),
            ScheduledRequest(4, 3, 61, 61, 62, 60, 32, False, True)]  # fmt: skip
    assert list(dec) == want and dec.row(0) == want[0]
    both = RequestColumns.concat([dec, cols])
    assert list(both) == want + list(reqs) and both.row(3) == reqs[1]
    assert len(RequestColumns.concat([])) == 0 and RequestColumns.concat([dec, cols[:0]]) is dec


def test_vectorised_stop_checks_equal_the_scalar_ones():
    """Random stop ids, EOS, ignore_eos, max_tokens (1 included) and lengths: the rows' masks
    give the reason ``_stop_reason`` gives, stop winning on the last allowed token."""
    llm = fake_llm(max_num_seqs=64, max_model_len=80)
    sched, rows = llm.scheduler, llm.scheduler.rows
    eos = sched.config.eos_token_id
    rng = random.Random(0)
    seqs = []
    for i in range(64):
        n_prompt = rng.randint(1, 30)
        params = SamplingParams(
            max_tokens=rng.choice([1, 2, 5, 60]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=tuple(rng.sample(range(8), rng.randint(0, 3))),
        )
        seq = Sequence(i, [rng.randrange(8) for _ in range(n_prompt)], n_prompt, params, slot=i)
        seq.num_cached_tokens = seq.prefill_end = n_prompt
        seq.token_ids += [rng.randrange(8) for _ in range(rng.randint(0, 60))]
        rows.load(seq, sched._stop_rule(seq))
        seqs.append(seq)
    tokens = np.array([rng.choice([0, 1, 2, 7, eos if eos is not None else 3]) for _ in seqs])
    slots = np.arange(64)
    for seq, tok in zip(seqs, tokens.tolist()):
        seq.token_ids.append(tok)
    rows.num_tokens[slots] += 1
    stop, length = rows.stop_reasons(slots, tokens)
    for k, seq in enumerate(seqs):
        want = sched._stop_reason(seq, int(tokens[k]))
        got = "stop" if stop[k] else "length" if length[k] else None
        assert got == want, (k, seq.params, len(seq.token_ids))
    assert stop.any() and length.any() and (stop & (rows.num_tokens >= rows.limit)).any()


def test_stop_token_on_the_last_allowed_token_and_max_tokens_one():
    p = prompt(50, 4)
    gold = solo(p, IGNORE).output_ids
    # a stop id sampled at the last allowed token: stop, not length
    last = SamplingParams(max_tokens=5, stop_token_ids=(gold[4],), ignore_eos=True)
    first_at = gold.index(gold[4])
    s = solo(p, last)
    assert s.output_ids == gold[: first_at + 1] and s.finish_reason == "stop"
    # max_tokens=1 ends in the prefill's step: no decode row ever
    llm = fake_llm()
    one = llm.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    drive(llm)
    assert one.output_ids == gold[:1] and one.finish_reason == "length"
    assert (llm.scheduler.rows.seq_id == -1).all()
    # EOS sampled but ignored: the request runs to max_tokens
    eos_llm = fake_llm()
    eos_llm.scheduler.config = dataclasses.replace(eos_llm.scheduler.config, eos_token_id=gold[2])
    kept = eos_llm.add_request(p, IGNORE)
    stopped = eos_llm.add_request(p, SamplingParams(max_tokens=12))
    drive(eos_llm)
    assert kept.output_ids == gold and kept.finish_reason == "length"
    assert stopped.output_ids == gold[: gold.index(gold[2]) + 1]
    assert stopped.finish_reason == "stop"


def test_finishing_and_joining_in_one_step_keep_tokens_and_order():
    """Requests of many lengths arriving over time: some finish while others end their prefill
    in the same step; every output is its solo run's, and finishes come in queue order."""
    rng = random.Random(3)
    specs = [(rng.randint(5, 90), rng.randint(1, 9)) for _ in range(10)]
    llm = fake_llm(max_num_seqs=6, long_prefill_token_threshold=24)
    seqs: list[tuple[Sequence, list[int], SamplingParams]] = []
    finish_order: list[list[int]] = []

    def add(step):
        if step % 2 == 0 and len(seqs) < len(specs):
            n, k = specs[len(seqs)]
            p, params = prompt(n, len(seqs)), SamplingParams(max_tokens=k, ignore_eos=True)
            seqs.append((llm.add_request(p, params), p, params))

    orig = llm.scheduler.postprocess

    def postprocess(batch, out):
        running = list(llm.scheduler.running)
        done = orig(batch, out)
        index = {id(s): i for i, s in enumerate(running)}
        assert [index[id(s)] for s in done] == sorted(index[id(s)] for s in done)
        finish_order.append([s.seq_id for s in done])
        return done

    llm.scheduler.postprocess = postprocess
    while len(seqs) < len(specs) or llm.has_unfinished():
        drive(llm, on_step=add) if llm.has_unfinished() else add(0)
    assert any(len(ids) > 1 for ids in finish_order)
    for s, p, params in seqs:
        assert s.output_ids == solo(p, params).output_ids and s.finish_reason == "length"


@pytest.mark.parametrize("enc", [True, False])
def test_preemption_mid_decode_keeps_tokens_and_rows(enc):
    prompts = [prompt(60, i) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm = fake_llm(num_pages=11, max_num_seqs=4, encoder_swa_bounded_replay=enc)
    seqs = [llm.add_request(p, params) for p in prompts]
    drive(llm)
    assert sum(s.preemptions for s in seqs) >= 1
    for s, p in zip(seqs, prompts):
        assert s.output_ids == solo(p, params, encoder_swa_bounded_replay=enc).output_ids


def test_cancel_preempt_and_reorder_between_steps_keep_rows_consistent():
    """Random cancellations, preemptions and queue reversals between steps: the rows follow
    (checked after every step) and survivors decode their solo tokens."""
    rng = random.Random(11)
    prompts = [prompt(rng.randint(10, 100), i) for i in range(6)]
    llm = fake_llm(max_num_seqs=4, num_pages=16, max_num_batched_tokens=64)
    seqs = [llm.add_request(p, IGNORE) for p in prompts]
    cancelled = set()

    def act(step):
        target = rng.choice(seqs)
        kind = rng.choice(["none", "none", "preempt", "cancel", "reverse"])
        if kind == "preempt" and any(s is target for s in llm.scheduler.running):
            llm.preempt(target)
        elif kind == "cancel" and not target.is_finished and step % 5 == 0:
            llm.abort(target)
            cancelled.add(target.seq_id)
        elif kind == "reverse":
            llm.scheduler.running.reverse()

    drive(llm, on_step=act)
    for s, p in zip(seqs, prompts):
        gold = solo(p, IGNORE).output_ids
        if s.seq_id in cancelled and s.finish_reason == "aborted":
            assert s.output_ids == gold[: len(s.output_ids)]
        else:
            assert s.output_ids == gold
    assert (llm.scheduler.rows.seq_id == -1).all()


def test_preempt_and_cancel_while_a_decode_batch_is_in_flight():
    """A request preempted (its row unloaded) or cancelled between a decode batch's schedule
    and its postprocess gets no token from it; the others advance, and all end as alone."""
    prompts = [prompt(40, i) for i in range(4)]
    llm = fake_llm(max_num_seqs=4)
    seqs = [llm.add_request(p, IGNORE) for p in prompts]
    sched = llm.scheduler
    while any(s.num_cached_tokens < s.prefill_end or not s.output_ids for s in seqs):
        llm.step()
    for act in ("preempt", "cancel"):
        batch = sched.schedule()
        decoding = {r.seq_id for r in batch.requests if r.start >= r.prompt_len}
        sampled = {r.seq_id for r in batch.requests if r.is_final_chunk}
        victim = sched._members()[0][1]
        assert victim.seq_id in decoding
        before = {s.seq_id: len(s.token_ids) for s in seqs}
        if act == "preempt":
            llm.preempt(victim)
        else:
            llm.abort(victim)
        sched.postprocess(batch, llm.runner.execute(batch))
        check_rows(llm)
        for s in seqs:
            grew = len(s.token_ids) - before[s.seq_id]
            assert grew == (s.seq_id in sampled and s is not victim), (act, s.seq_id)
    drive(llm)
    for s, p in zip(seqs, prompts):
        gold = solo(p, IGNORE).output_ids
        if s.finish_reason == "aborted":
            assert s.output_ids == gold[: len(s.output_ids)]
        else:
            assert s.output_ids == gold and s.preemptions <= 1
