"""Bounded schedule fuzzing: whatever the chunking, order, preemptions, cancellations, forks
and missing images, every surviving request finishes with the tokens of an uninterrupted run."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.helpers import fake_llm, prompt
from v41plan.serving.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
_GOLD: dict[tuple, list[int]] = {}


def gold(p: list[int]) -> list[int]:
    key = tuple(p)
    if key not in _GOLD:
        llm = fake_llm()
        s = llm.add_request(p, PARAMS)
        llm.run_until_done()
        _GOLD[key] = s.output_ids
    return _GOLD[key]


ACTIONS = st.sampled_from(
    ["none", "none", "preempt", "cancel", "cancel_inflight", "drop_images", "reverse"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(st.integers(1, 160), st.integers(0, 2)), min_size=1, max_size=4),
    fork=st.booleans(),
    cap=st.sampled_from([0, 5, 16, 32, 40]),
    budget=st.sampled_from([64, 80, 256]),
    encoder_replay=st.booleans(),
    decoder_replay=st.booleans(),
    num_pages=st.sampled_from([None, 14]),
    actions=st.lists(st.tuples(ACTIONS, st.integers(0, 3)), max_size=40),
    overlap=st.booleans(),
)
def test_fuzz_schedules_match_uninterrupted(
    specs, fork, cap, budget, encoder_replay, decoder_replay, num_pages, actions, overlap
):
    """``overlap``: the engine's ``async_scheduling`` (a decode batch stays in flight while
    the next is scheduled; the actions land between the two)."""
    prompts = [prompt(n, salt) for n, salt in specs]
    if fork:
        prompts.append(list(prompts[0]))
    llm = fake_llm(
        long_prefill_token_threshold=cap,
        max_num_batched_tokens=budget,
        encoder_swa_bounded_replay=encoder_replay,
        decoder_swa_bounded_replay=decoder_replay,
        num_pages=num_pages,
        max_num_seqs=4,
        async_scheduling=overlap,
    )
    seqs = [llm.add_request(p, PARAMS) for p in prompts]
    cancelled = set()
    for step in range(600):
        if not llm.has_unfinished():
            break
        kind, which = actions[step] if step < len(actions) else ("none", 0)
        target = seqs[which % len(seqs)]
        if kind == "preempt" and target in llm.scheduler.running:
            llm.preempt(target)
        elif kind == "cancel" and not target.is_finished:
            llm.abort(target)
            cancelled.add(target.seq_id)
        elif kind == "drop_images":
            llm.block_manager.drop_images()
        elif kind == "reverse":
            llm.scheduler.running.reverse()
        if kind == "cancel_inflight" and not target.is_finished:
            # Cancel while this step's batch (a middle chunk, a final chunk, a decode) is in flight.
            llm.drain()  # (the scheduler is driven by hand here)
            batch = llm.scheduler.schedule()
            llm.abort(target)
            cancelled.add(target.seq_id)
            if batch is not None:
                llm.scheduler.postprocess(batch, llm.runner.execute(batch))
            continue
        llm.step()
    assert not llm.has_unfinished(), "scheduler did not drain"
    for s, p in zip(seqs, prompts):
        if s.seq_id in cancelled:
            assert s.finish_reason in ("aborted", "length")
            if s.finish_reason == "aborted":  # whatever it produced is a prefix of the real run
                assert s.output_ids == gold(p)[: len(s.output_ids)]
        else:
            assert s.finish_reason == "length"
            assert s.output_ids == gold(p)
    bm = llm.block_manager
    assert bm.pages_in_use() == sum(len(im.units) for im in bm.images.values())
    assert len(bm.free_slots) == bm.num_slots
