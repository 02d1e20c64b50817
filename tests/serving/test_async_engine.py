"""The asynchronous engine without HTTP: incremental text, stop strings, aborts, the bounded
queue and a failing batch (fake runner, bounded waits)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.serving.helpers import TINY, failing_factory, fake_llm, prompt
from v41plan.serving.async_engine import AsyncEngine, EngineClosed, QueueFull, TextState
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams
from v41plan.serving.tokenizer import ByteTokenizer

BYTES = ByteTokenizer(256, 257, 260)


def _feed(state: TextState, ids: list[int]) -> tuple[str, int | None]:
    """Feed ids one step at a time, as the loop does; returns the streamed text and the cut."""
    out = []
    for n in range(1, len(ids) + 1):
        delta, cut = state.update(ids[:n], final=n == len(ids))
        out.append(delta)
        if cut is not None:
            return "".join(out), cut
    return "".join(out), None


def test_partial_characters_are_held_until_complete():
    ids = list("a€b".encode())  # the euro sign is three byte tokens
    state = TextState(BYTES.decode)
    deltas = [state.update(ids[:n], final=False)[0] for n in range(1, len(ids) + 1)]
    assert deltas == ["a", "", "", "€", "b"]
    bad = [0xFF, ord("x")]  # an invalid byte is emitted as U+FFFD once text follows it
    state = TextState(BYTES.decode)
    assert [state.update(bad[:n], final=False)[0] for n in (1, 2)] == ["", "\ufffdx"]


@pytest.mark.parametrize("stop", ["cd", "d", "xyz", "bcdef"])
def test_stop_string_cut_and_held_back(stop):
    ids = list(b"abcdefg")
    text, cut = _feed(TextState(BYTES.decode, (stop,)), ids)
    full = BYTES.decode(ids)
    if stop in full:
        pos = full.index(stop)
        assert text == full[:pos]
        assert cut == pos + len(stop)  # the token completing the stop string is the last
    else:
        assert text == full and cut is None


def test_text_that_may_begin_a_stop_string_is_held():
    state = TextState(BYTES.decode, ("cx",))
    assert state.update(list(b"abc"), final=False) == ("ab", None)
    assert state.update(list(b"abcd"), final=False) == ("cd", None)


def _collect(engine, ids, params, stop=(), box=None):
    box = [] if box is None else box
    done = threading.Event()

    def emit(ev):
        box.append(ev)
        if ev.finish_reason is not None and sum(e.finish_reason is not None for e in box) == len(
            params
        ):
            done.set()

    handle = engine.submit(ids, params, emit, stop)
    return handle, box, done


def test_engine_matches_generate_and_frees_everything():
    offline = fake_llm(max_num_seqs=4)
    p = [prompt(20, s) for s in range(6)]
    params = SamplingParams(max_tokens=5)
    want = [o.outputs[0].token_ids for o in offline.generate(p, params)]
    engine = AsyncEngine(fake_llm(max_num_seqs=4), max_waiting=64).start()
    try:
        runs = [_collect(engine, ids, [params]) for ids in p]
        for _, _, done in runs:
            assert done.wait(30)
        got = [[t for e in box for t in e.token_ids] for _, box, _ in runs]
        assert got == want
        deadline = time.monotonic() + 10
        while engine.snapshot["num_slots_in_use"] and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = engine.snapshot
        assert snap["num_requests_running"] == snap["num_requests_waiting"] == 0
        assert snap["num_pages_in_use"] == snap["num_slots_in_use"] == 0
    finally:
        engine.stop()
    assert not engine.alive


def test_stop_string_aborts_in_the_engine():
    offline = fake_llm()
    ids = prompt(12, 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = offline.generate([ids], params)[0].outputs[0]
    text = offline.decode(out.token_ids)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    engine = AsyncEngine(fake_llm(), max_waiting=8).start()
    try:
        _, box, done = _collect(engine, ids, [params], stop=(stop,))
        assert done.wait(30)
    finally:
        engine.stop()
    assert box[-1].finish_reason == "stop" and box[-1].stop_reason == stop
    streamed = "".join(e.text for e in box)
    assert streamed == text[: text.index(stop)]
    n = next(k for k in range(1, 13) if stop in offline.decode(out.token_ids[:k]))
    assert [t for e in box for t in e.token_ids] == out.token_ids[:n]


def test_bounded_queue_and_closed_engine():
    engine = AsyncEngine(fake_llm(max_num_seqs=1), max_waiting=0).start()
    try:
        with pytest.raises(QueueFull):
            engine.submit(prompt(8), [SamplingParams()] * 2, lambda ev: None)
        engine.drain(0.0)
        with pytest.raises(EngineClosed):
            engine.submit(prompt(8), [SamplingParams()], lambda ev: None)
    finally:
        engine.stop()


def test_a_failing_batch_fails_its_requests_and_the_loop_goes_on():
    poison = 13
    # a prompt holding the poison id fails its batch
    factory = failing_factory(lambda batch: any(poison in d.new_tokens for d in batch.deltas))
    llm = LLM(TINY, runner_factory=factory, world_size=1, max_num_batched_tokens=256)
    engine = AsyncEngine(llm, max_waiting=8).start()
    try:
        _, bad, bad_done = _collect(engine, [poison] * 5, [SamplingParams(max_tokens=3)])
        assert bad_done.wait(30)
        _, good, good_done = _collect(engine, prompt(6), [SamplingParams(max_tokens=3)])
        assert good_done.wait(30)
    finally:
        engine.stop()
    assert bad[-1].finish_reason == "error" and "injected kernel failure" in bad[-1].error
    assert good[-1].finish_reason in ("length", "stop") and good[-1].error is None


def test_a_client_told_of_a_failure_can_submit_again_at_once():
    """A failed request's client hears of it before the next step drops the request from the
    scheduler; a retry at that moment finds the queue room (``max_waiting=0``, one slot)."""
    calls = []

    def second(batch):  # the second batch (the first decode step) fails
        calls.append(batch)
        return len(calls) == 2

    llm = LLM(TINY, runner_factory=failing_factory(second), world_size=1, max_num_seqs=1)
    engine = AsyncEngine(llm, max_waiting=0).start()
    retry: dict = {}
    retried = threading.Event()
    good: list = []
    good_done = threading.Event()

    def on_good(ev):
        good.append(ev)
        if ev.finish_reason is not None:
            good_done.set()

    def on_bad(ev):  # runs on the engine thread, as soon as the failure is known
        if ev.finish_reason is not None:
            retry["reason"] = ev.finish_reason
            try:
                engine.submit(prompt(6), [SamplingParams(max_tokens=3)], on_good)
                retry["ok"] = True
            except QueueFull as exc:
                retry["error"] = exc
            retried.set()

    try:
        engine.submit(prompt(5), [SamplingParams(max_tokens=4, ignore_eos=True)], on_bad)
        assert retried.wait(30)
        assert retry == {"reason": "error", "ok": True}
        assert good_done.wait(30)
    finally:
        engine.stop()
    assert good[-1].finish_reason in ("length", "stop") and good[-1].error is None
