"""Overlapped stepping (``async_scheduling``) on the paged runner: a decode batch stays in
flight while the next one is scheduled and launched, its sampled tokens handed over on the
device. Everything a request gets must equal synchronous stepping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v41plan.serving.admission import ConfigError
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

BASE = {"device": "cpu", "dtype": "float64", "max_num_seqs": 3, "max_model_len": 256}


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * k) % 200 + 1 for k in range(4 + 11 * i)] for i in range(6)]


def params(stop: dict[int, int] | None = None) -> list[SamplingParams]:
    out = []
    for i in range(6):
        sampled = i % 2 == 1
        out.append(
            SamplingParams(
                max_tokens=14 + 3 * i,
                ignore_eos=True,
                temperature=0.9 if sampled else 0.0,
                top_k=20 if i == 3 else 0,
                top_p=0.8 if i == 5 else 1.0,
                seed=100 + i,
                logprobs=2 if i == 2 else None,
                stop_token_ids=[stop[i]] if stop and i in stop else [],
            )
        )
    return out


def run(overlap: bool, ps: list[SamplingParams], **options) -> tuple[LLM, list]:
    llm = LLM("tiny", **BASE, async_scheduling=overlap, **options)
    return llm, llm.generate(prompts(), ps)


def summary(outs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("encoder_replay", [True, False], ids=["replay", "copy"])
def test_overlapped_stepping_gives_the_synchronous_tokens(encoder_replay):
    opts = {"encoder_swa_bounded_replay": encoder_replay}
    _, sync0 = run(False, params(), **opts)
    # stop three requests on a token they produce midway: their in-flight rows are discarded
    stop = {i: sync0[i].outputs[0].token_ids[5 + i] for i in (0, 1, 4)}
    ps = params(stop)
    llm_s, sync = run(False, ps, **opts)
    llm_a, over = run(True, ps, **opts)
    assert summary(over) == summary(sync)
    assert [summary(sync)[i][1] for i in (0, 1, 4)] == ["stop"] * 3
    for a, b in zip(over, sync, strict=True):  # logprobs travel with their tokens
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    seq_a = [s for s in llm_a.scheduler.finished if s.params.logprobs]
    seq_s = [s for s in llm_s.scheduler.finished if s.params.logprobs]
    assert [s.output_logprobs for s in seq_a] == [s.output_logprobs for s in seq_s]
    assert llm_a.overlapped_steps > 0 and llm_a.runner.stats["pending_rows"] > 0
    assert llm_s.overlapped_steps == 0 and llm_s.runner.stats["pending_rows"] == 0
    # a request ending on its length limit gets no row past it: the same rows ran
    assert llm_a.runner.stats["rows"] >= llm_s.runner.stats["rows"]
    assert llm_a.runner.stats["rows"] - llm_s.runner.stats["rows"] <= 3  # the stopped ones
    bm = llm_a.block_manager
    assert len(bm.free_slots) == bm.num_slots


def test_cursors_equal_their_host_mirror_after_every_overlapped_step():
    """The in-flight rows' newest Engram id is written on the device (cursor) and, once the
    token is read, on the host mirror that the next prepare reads."""
    llm = LLM("tiny", **BASE, async_scheduling=True)
    for p, sp in zip(prompts()[:3], params()[:3], strict=True):
        llm.add_request(p, sp)
    pools = llm.runner.model.pools
    checked = 0
    while llm.has_unfinished():
        llm.step()
        rows = llm.scheduler.rows
        slots = np.flatnonzero(rows.seq_id >= 0)
        for s in slots.tolist():
            assert torch.equal(pools.cursor[s].cpu(), torch.from_numpy(pools.cursor_host[s]))
            checked += 1
    assert checked > 10 and llm.overlapped_steps > 5


def preempted_run(overlap: bool, at: int | None):
    """Step the six requests; preempt request 0 once it holds ``at`` tokens (None: the first
    step after 5 with a batch in flight), and cancel request 1 mid-decode."""
    llm = LLM("tiny", **BASE, async_scheduling=overlap)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts(), params(), strict=True)]
    state = {}
    while llm.has_unfinished():
        llm.step()
        s0, s1 = seqs[0], seqs[1]
        if "at" not in state and s0 in llm.scheduler.running and s0.num_output_tokens > 4:
            inflight = llm._inflight
            flying = inflight is not None and s0.seq_id in inflight.batch.requests.seq_id
            if (at is None and flying) or s0.num_output_tokens == at:
                llm.preempt(s0)  # drains a batch in flight first
                assert llm._inflight is None
                state["at"], state["flying"] = s0.num_output_tokens, flying
        if "cancel" not in state and s1.num_output_tokens > 3:
            state["cancel"] = llm._inflight is not None
            llm.abort(s1)  # the next step drains, then finishes it
    return llm, seqs, state


def test_preemption_and_cancellation_while_a_batch_is_in_flight():
    """A preempted request resumes from its recomputed prefix (not exactly the uninterrupted
    tokens under replay): the overlapped run equals a synchronous one preempted at the same
    token, and every other request equals its uninterrupted run."""
    llm, seqs, state = preempted_run(True, None)
    assert state["flying"] and state["cancel"] and seqs[0].preemptions == 1
    _, ref, ref_state = preempted_run(False, state["at"])
    assert ref_state["at"] == state["at"] and ref[0].preemptions == 1
    _, alone = run(False, params())
    assert seqs[0].output_ids == ref[0].output_ids
    assert seqs[1].finish_reason == "aborted"
    got = seqs[1].output_ids
    assert got == alone[1].outputs[0].token_ids[: len(got)]
    for i in (2, 3, 4, 5):
        assert seqs[i].output_ids == alone[i].outputs[0].token_ids, i
    bm = llm.block_manager
    assert len(bm.free_slots) == bm.num_slots


def test_async_scheduling_is_checked():
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM("tiny", **BASE, async_scheduling="yes")

    class Blocking:  # a runner that only executes, waiting for each batch
        vocab_size = 256

        def execute(self, batch):
            raise AssertionError("never stepped")

    with pytest.raises(ConfigError, match="accepted with this runner: False"):
        LLM("tiny", **BASE, async_scheduling=True, runner_factory=lambda *a: Blocking())
    llm = LLM("tiny", **BASE)
    assert llm.async_scheduling is False  # the default on the CPU


def test_an_image_stored_by_an_overlapped_batch_resumes_exactly():
    """Under ``copy`` the image of a decode row ending on the hash-block grid is stored by the
    batch launched behind it (before that batch's forward): a later request whose prompt
    extends the first one's tokens restores it and continues as in synchronous stepping."""
    copy = {"encoder_swa_bounded_replay": False}
    first = prompts()[1][:10]
    ps = SamplingParams(max_tokens=40, ignore_eos=True)
    got = {}
    for overlap in (False, True):
        llm = LLM("tiny", **BASE, async_scheduling=overlap, **copy)
        a = llm.generate([first], ps)[0].outputs[0].token_ids
        stored = llm.runner.stats["stores"]
        follow = first + a[:30]  # past the image at 32 tokens, inside the generated text
        out = llm.generate([follow], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        got[overlap] = (a, out.outputs[0].token_ids, stored, out.stats["hits"])
        if overlap:
            assert llm.overlapped_steps > 20
    assert got[True][:2] == got[False][:2]
    assert got[True][2] == got[False][2] >= 1  # the same images were stored
    assert got[True][3] == got[False][3] and got[True][3][0] >= 32  # and resumed from
