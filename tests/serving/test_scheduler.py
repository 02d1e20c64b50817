"""Scheduler, block manager and engine behaviour over the deterministic fake runner."""

from __future__ import annotations

import dataclasses

import pytest

from tests.serving.helpers import TINY, fake_factory, fake_llm, prompt
from v41plan.planner.replay import grid_back_off
from v41plan.serving.admission import ConfigError
from v41plan.serving.block_manager import READY, BlockManager
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams
from v41plan.serving.sequence import Sequence

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
TRANSFERS = [True, False]  # encoder_swa_bounded_replay: replay / copy


def run(llm: LLM, prompts, params=GREEDY, hook=None, max_steps=500):
    """Add every prompt, step to completion calling ``hook(llm, seqs, batch)`` before each
    execute."""
    seqs = [llm.add_request(p, params) for p in prompts]
    inner = llm.runner

    class Hooked:
        vocab_size = inner.vocab_size

        def execute(self, batch):
            if hook is not None:
                hook(llm, seqs, batch)
            return inner.execute(batch)

    llm.runner = Hooked()
    try:
        llm.run_until_done(max_steps)
    finally:
        llm.runner = inner
    return seqs


def outputs(seqs):
    return [s.output_ids for s in seqs]


def gold(prompts, params=GREEDY):
    """Each prompt alone, unchunked, in its own engine."""
    return [outputs(run(fake_llm(), [p], params))[0] for p in prompts]


def assert_idle(llm: LLM):
    bm = llm.block_manager
    image_units = sum(len(im.units) for im in bm.images.values())
    assert bm.pages_in_use() == image_units
    assert len(bm.free_slots) == bm.num_slots
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_replay_start_grid():
    assert grid_back_off(64, 32) == 32
    assert grid_back_off(70, 32) == 32
    assert grid_back_off(40, 32) == 0
    assert grid_back_off(31, 32) == 0
    assert grid_back_off(0, 32) == 0


@pytest.mark.parametrize("enc", TRANSFERS)
def test_chunked_budget_and_cap(enc):
    prompts = [prompt(150), prompt(97, 1), prompt(40, 2)]
    llm = fake_llm(
        long_prefill_token_threshold=16, max_num_batched_tokens=64, encoder_swa_bounded_replay=enc
    )
    seqs = run(llm, prompts)
    assert outputs(seqs) == gold(prompts)
    for ev in llm.scheduler.events:
        rows = sum(e - s for s, e in zip(ev["starts"], ev["ends"]))
        assert rows <= 64
        for r, e in zip(ev["resumes"], ev["ends"]):
            assert e - r <= 16 or ev["phase"] == "decode"
    # Every batch was also laid out by plan_step, with the same forward starts.
    assert llm.runner.plans == len(llm.scheduler.events)
    # Ragged multi-request prefill batches happened, and prefill and decode never mixed.
    assert any(ev["phase"] == "prefill" and len(ev["ids"]) > 1 for ev in llm.scheduler.events)
    assert_idle(llm)


def test_final_backoff_cap_counts_from_resume():
    # 70 tokens, cap 32: [0,32) [32,64) then 6 rows left < min_final_prefill_rows=8: back off to 32.
    llm = fake_llm(long_prefill_token_threshold=32)
    seqs = run(llm, [prompt(70)])
    pre = [ev for ev in llm.scheduler.events if ev["phase"] == "prefill"]
    assert [(e["starts"][0], e["resumes"][0], e["ends"][0]) for e in pre] == [
        (0, 0, 32),
        (32, 32, 64),
        (32, 64, 70),
    ]
    assert seqs[0].replay_rows == 32
    assert outputs(seqs) == gold([prompt(70)])


def test_decoder_replay_off_no_backoff():
    llm = fake_llm(long_prefill_token_threshold=32, decoder_swa_bounded_replay=False)
    run(llm, [prompt(70)])
    pre = [ev for ev in llm.scheduler.events if ev["phase"] == "prefill"]
    assert [e["starts"][0] for e in pre] == [0, 32, 64]


def test_wait_rule_when_budget_cannot_pass_resume():
    llm = fake_llm(long_prefill_token_threshold=32)
    seq = Sequence(0, prompt(70), 70, GREEDY)
    seq.prefill_end = 70
    sch = llm.scheduler
    assert sch._chunk(seq, 64, None, 100) == (32, 70)  # the finishing forward backs off
    assert (
        sch._chunk(seq, 64, None, 30) is None
    )  # would end at 62 <= 64: recomputes cached rows only
    assert sch._chunk(seq, 64, None, 33) == (32, 65)  # carries past the resume point
    # A rebuild in a fresh slot that the budget cannot carry past its resume point waits.
    assert sch._chunk(seq, 64, 32, 32) is None
    assert sch._chunk(seq, 64, 32, 33) == (32, 65)


@pytest.mark.parametrize("enc", TRANSFERS)
def test_reorder_is_order_independent(enc):
    prompts = [prompt(120), prompt(90, 3), prompt(64, 4)]

    def reverse(llm, seqs, batch):
        llm.scheduler.running.reverse()

    llm = fake_llm(long_prefill_token_threshold=24, encoder_swa_bounded_replay=enc)
    assert outputs(run(llm, prompts, hook=reverse)) == gold(prompts)


def test_prefix_hit_replay_transfer():
    p = prompt(100)
    llm = fake_llm()
    first = run(llm, [p])
    second = run(llm, [p])[0]
    assert second.hits == [96]
    assert second.starts == [64]  # one hash block below the hit, in a fresh slot
    assert second.replay_rows == 32
    assert second.output_ids == first[0].output_ids
    assert not llm.block_manager.images  # the replay transfer keeps no image


def test_prefix_hit_short_suffix_backoff():
    base = prompt(64)
    llm = fake_llm()
    run(llm, [base + [5]])
    s = run(llm, [base + [7, 8]])[0]  # hit 32 (the block holding the last token is never reused)
    assert s.hits == [64] and s.starts == [32]
    assert s.output_ids == gold([base + [7, 8]])[0]


def test_copy_transfer_images_and_restore():
    p = prompt(100)
    llm = fake_llm(encoder_swa_bounded_replay=False, long_prefill_token_threshold=32)
    first = run(llm, [p])[0]
    bm = llm.block_manager
    assert bm.images and all(im.state == READY for im in bm.images.values())
    positions = sorted(im.position for im in bm.images.values())
    assert positions[:3] == [32, 64, 96]
    second = run(llm, [p])[0]
    assert second.hits == [96] and second.restores == 1
    assert second.starts == [64]  # 4 rows left < 8: decoder back-off in the restored slot
    assert second.output_ids == first.output_ids
    assert llm.runner.restores == 1 and all(im.pins == 0 for im in bm.images.values())


def test_copy_missing_image_replays_from_zero():
    p = prompt(100)
    llm = fake_llm(encoder_swa_bounded_replay=False, long_prefill_token_threshold=32)
    first = run(llm, [p])[0]
    assert llm.block_manager.drop_images() >= 3
    second = run(llm, [p])[0]
    assert second.hits == [0] and second.restores == 0
    assert llm.block_manager.stats.hits_gated >= 1
    assert second.output_ids == first.output_ids


def test_image_lifecycle_copying_ready_pins_lru():
    bm = BlockManager(num_pages=10, page_tokens=32, num_slots=2, transfer="copy", units_per_image=2)
    assert bm.begin_store(b"a", 0, 32)
    assert bm.images[b"a"].state == "copying"
    assert not bm.begin_store(b"a", 0, 32)  # already pending
    ops = bm.take_stores()
    assert len(ops) == 1 and bm.images[b"a"].state == "copying"
    bm.complete_batch()
    assert bm.images[b"a"].state == READY
    assert bm.resumable([b"a"], 1) == 1
    bm.begin_restore(b"a", 1)
    assert bm.images[b"a"].pins == 1
    assert bm.begin_store(b"b", 0, 64)
    bm.take_stores()
    bm.complete_batch()  # unpins a, readies b
    # Filling the pool evicts the least recently used unpinned READY image first.
    table = bm.allocate([], 8)
    assert b"a" not in bm.images and b"b" in bm.images
    bm.free(table)


@pytest.mark.parametrize("enc", TRANSFERS)
def test_preempt_mid_prefill_resumes(enc):
    p = prompt(140, 5)
    done = []

    def preempt(llm, seqs, batch):
        s = seqs[0]
        if not done and s.is_prefilling and s.num_cached_tokens >= 64:
            llm.preempt(s)
            done.append(True)

    llm = fake_llm(long_prefill_token_threshold=32, encoder_swa_bounded_replay=enc)
    seqs = run(llm, [p], hook=preempt)
    assert done and seqs[0].preemptions == 1
    assert seqs[0].hits[-1] >= 64
    if enc:
        assert seqs[0].replay_rows >= 32
    else:
        assert seqs[0].restores == 1
    assert outputs(seqs) == gold([p])
    assert_idle(llm)


@pytest.mark.parametrize("enc", TRANSFERS)
def test_decode_preemption_under_page_pressure(enc):
    prompts = [prompt(60, i) for i in range(3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm = fake_llm(num_pages=9, max_num_seqs=3, encoder_swa_bounded_replay=enc)
    seqs = run(llm, prompts, params)
    assert sum(s.preemptions for s in seqs) >= 1
    assert outputs(seqs) == gold(prompts, params)


@pytest.mark.parametrize("enc", TRANSFERS)
def test_cancel_middle_chunk_and_deferred_step(enc):
    a, b = prompt(100, 1), prompt(100, 2)
    state = {}

    def cancel(llm, seqs, batch):
        by = {r.seq_id: r for r in batch.requests}
        sa, sb = seqs
        ra = by.get(sa.seq_id)
        if "a" not in state and ra is not None and not ra.is_final_chunk and ra.start >= 32:
            llm.abort(sa)  # while its middle chunk is in flight
            state["a"] = batch.step
        if "b" not in state and sb.is_prefilling and sb.seq_id not in by and sb.slot is not None:
            llm.abort(sb)  # running but deferred this step: no row at all
            state["b"] = batch.step

    llm = fake_llm(
        long_prefill_token_threshold=32, max_num_batched_tokens=64, encoder_swa_bounded_replay=enc
    )
    seqs = run(llm, [a, b], hook=cancel)
    assert "a" in state
    assert seqs[0].finish_reason == "aborted" and seqs[0].output_ids == []
    assert_idle(llm)


def test_cancel_first_deferred_step():
    # Both requests hold a slot mid-prefill; then the first takes the whole budget, so the second
    # is deferred (no row at all this step). Cancel it there: it must finish and free everything.
    a, b = prompt(200, 1), prompt(100, 2)
    llm = fake_llm(long_prefill_token_threshold=32)
    sa = llm.add_request(a, GREEDY)
    sb = llm.add_request(b, GREEDY)
    llm.step()
    assert sa.num_cached_tokens == sb.num_cached_tokens == 32
    llm.scheduler.config = dataclasses.replace(
        llm.scheduler.config, max_num_batched_tokens=64, long_prefill_token_threshold=0
    )
    batch = llm.scheduler.schedule()
    assert [r.seq_id for r in batch.requests] == [sa.seq_id]  # sb deferred
    llm.abort(sb)
    llm.scheduler.postprocess(batch, llm.runner.execute(batch))
    assert sb.finish_reason == "aborted" and sb.output_ids == [] and sb.slot is None
    llm.run_until_done()
    assert sa.output_ids == gold([a])[0]
    assert_idle(llm)


def test_cancel_waiting_request():
    llm = fake_llm(max_num_seqs=1)
    s0 = llm.add_request(prompt(40), GREEDY)
    s1 = llm.add_request(prompt(40, 1), GREEDY)
    llm.abort(s1)
    llm.run_until_done()
    assert s1.finish_reason == "aborted" and s0.finish_reason == "length"
    assert_idle(llm)


def test_slot_recycling_resets_position_zero():
    llm = fake_llm(max_num_seqs=1)
    s0 = llm.add_request(prompt(80, 1), GREEDY)
    llm.step()
    llm.abort(s0)
    llm.step()
    assert s0.finish_reason == "aborted"
    s1 = run(llm, [prompt(50, 2)])[0]
    assert llm.scheduler.events[-1]["ids"] == [s1.seq_id]
    assert s1.output_ids == gold([prompt(50, 2)])[0]
    assert_idle(llm)


def test_prefix_fork_two_identical_prompts():
    # Submitted together; the budget admits the second once the first has published blocks.
    p = prompt(200, 9)
    for enc in TRANSFERS:
        llm = fake_llm(
            long_prefill_token_threshold=64,
            max_num_batched_tokens=64,
            encoder_swa_bounded_replay=enc,
        )
        seqs = run(llm, [p, p])
        assert seqs[0].output_ids == seqs[1].output_ids == gold([p])[0]
        assert seqs[1].hits == [192 if enc else 128]  # copy: the image at 192 is still COPYING
        assert seqs[1].restores == (0 if enc else 1)


def test_stop_rules_and_seeded_sampling():
    llm = fake_llm()
    greedy = run(llm, [prompt(50)], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids
    stop = greedy[3]
    s = run(llm, [prompt(50)], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert s.output_ids == greedy[: greedy.index(stop) + 1] and s.finish_reason == "stop"
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    alone = run(fake_llm(), [prompt(50)], sp)[0].output_ids
    mixed = run(fake_llm(long_prefill_token_threshold=16), [prompt(30, 3), prompt(50)], sp)[
        1
    ].output_ids
    assert alone == mixed
    other = run(
        fake_llm(),
        [prompt(50)],
        SamplingParams(temperature=0.8, seed=8, max_tokens=8, ignore_eos=True),
    )
    assert other[0].output_ids != alone


def test_eos_stops_unless_ignored():
    eos = int(TINY.model_config["eos_token_id"])

    def run_eos(params):
        llm = fake_llm()
        inner = llm.runner

        class EosAfterTwo:
            vocab_size = inner.vocab_size

            def execute(self, batch):
                out = inner.execute(batch)
                for r in batch.requests:
                    if r.end - r.prompt_len >= 2 and r.seq_id in out.last_logits:
                        out.last_logits[r.seq_id][eos] = 1e9
                return out

        llm.runner = EosAfterTwo()
        return llm.generate([prompt(40)], params)[0].outputs[0]

    stopped = run_eos(SamplingParams(max_tokens=6))
    assert (
        stopped.token_ids[-1] == eos
        and len(stopped.token_ids) == 3
        and stopped.finish_reason == "stop"
    )
    ignored = run_eos(SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(ignored.token_ids) == 6 and ignored.finish_reason == "length"


def test_prompt_logprobs_independent_of_chunking():
    p = prompt(90, 4)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=True)
    whole = fake_llm(decoder_swa_bounded_replay=False).generate([p], sp)[0]
    chunked = fake_llm(decoder_swa_bounded_replay=False, long_prefill_token_threshold=16).generate(
        [p], sp
    )[0]
    assert len(whole.prompt_logprobs) == 90 and whole.prompt_logprobs[0] is None  # per position
    assert whole.prompt_logprobs == pytest.approx(chunked.prompt_logprobs)
    llm = fake_llm(decoder_swa_bounded_replay=False, long_prefill_token_threshold=16)
    seq = llm.add_request(p, sp)
    llm.step()
    llm.step()
    llm.preempt(seq)
    llm.run_until_done()
    assert [None, *seq.prompt_logprobs] == pytest.approx(whole.prompt_logprobs)
    # with decoder replay on, a scoring request opts out of it and scores every row
    replayed = fake_llm(long_prefill_token_threshold=16).generate([p], sp)[0]
    assert replayed.error is None and replayed.prompt_logprobs == pytest.approx(
        whole.prompt_logprobs
    )


def test_bad_requests_fail_alone():
    llm = fake_llm(max_model_len=200)
    outs = llm.generate(
        [prompt(30), [1, 2, 999], prompt(250), prompt(20), [], [1, 2.0, 3], [True, 2]],
        [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=-1.0), GREEDY, GREEDY, GREEDY],
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 6
    assert "999" in outs[1].error
    assert "max_model_len" in outs[2].error
    assert "temperature" in outs[3].error
    assert "empty" in outs[4].error
    assert "2.0 is not an integer" in outs[5].error
    assert "True is not an integer" in outs[6].error
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:])


def test_numpy_integer_prompts_are_admitted():
    """Token ids as numpy integers (an array's elements) run as the same Python ints."""
    import numpy as np

    llm = fake_llm()
    ids = prompt(30)
    a, b = llm.generate([ids, list(np.asarray(ids, dtype=np.int64))], [GREEDY, GREEDY])
    assert a.error is None and b.error is None
    assert len(a.outputs[0].token_ids) == 6 and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert all(type(t) is int for t in b.prompt_token_ids)


def test_penalties_fail_alone_and_logprobs_are_served():
    """Penalties validate but are not served yet (refused alone); per-token logprobs are: the
    sampled token's raw logprob and the asked-for top ones, per generated token."""
    llm = fake_llm()
    outs = llm.generate(
        [prompt(20), prompt(20), prompt(20)],
        [GREEDY, SamplingParams(repetition_penalty=1.2), SamplingParams(logprobs=2, max_tokens=3)],
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 6
    assert "penalties" in outs[1].error
    assert outs[2].error is None
    seqs = [s for s in llm.scheduler.finished if s.params.logprobs == 2]
    assert len(seqs) == 1
    seq = seqs[0]
    assert len(seq.output_logprobs) == len(seq.output_ids) == 3
    for token, (lp, top) in zip(seq.output_ids, seq.output_logprobs, strict=True):
        assert len(top) == 2 and lp <= 0 and max(top.values()) >= lp
        assert token in top or lp <= min(top.values())


def test_text_prompts_roundtrip():
    llm = fake_llm()
    out = llm.generate("hello world", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == list(b"hello world")
    assert len(out.outputs[0].token_ids) == 4 and isinstance(out.outputs[0].text, str)


def _never_load(*a, **k):
    raise AssertionError("weights loaded for a refused configuration")


@pytest.mark.parametrize(
    "option,value,needle",
    [
        ("pipeline_parallel_size", 2, "pipeline"),
        ("data_parallel_size", 2, "data parallel"),
        ("context_parallel_size", 2, "context parallel"),
        ("enable_dp_attention", True, "DP attention"),
        ("enable_tbo", "prefill", "TBO"),
        ("enable_eplb", True, "EPLB"),
        ("kv_transfer_config", {"kv_connector": "nixl"}, "lmcache_mp"),
        ("kv_cache_dtype", "fp8", "bf16, fp4"),
        ("index_cache_dtype", "bf16", "fp8, fp4"),
        ("block_size", 31, "accepted: 32"),
        ("cudagraph_mode", "FULL_AND_PIECEWISE", "NONE, FULL, PIECEWISE"),
        ("tensor_parallel_size", 2, "world size"),
        ("max_num_batched_tokens", 40, ">= 2 * page_tokens"),
        ("frobnicate", 1, "unknown option"),
    ],
)
def test_refused_before_load(option, value, needle):
    with pytest.raises(ConfigError) as exc:
        LLM(TINY, runner_factory=_never_load, world_size=1, **{option: value})
    assert option.split("_config")[0] in str(exc.value) or option in str(exc.value)
    assert needle in str(exc.value)


def test_packed_speculative_cache_refused():
    with pytest.raises(ConfigError, match="packed"):
        LLM(
            "tiny40_dspark",  # (a spec with a draft: tiny has none)
            runner_factory=_never_load,
            world_size=1,
            kv_cache_dtype="fp4",
            speculative_config={"method": "dspark", "num_speculative_tokens": 5},
        )


def test_tensor_parallel_admission():
    # 3 does not divide tiny's 4 heads: refused before load, naming the dimension.
    with pytest.raises(ConfigError, match="tensor_parallel_size=3.*num_attention_heads=4"):
        LLM(TINY, runner_factory=_never_load, world_size=3, tensor_parallel_size=3)
    # 1 under a world of 2: every rank a full replica; 3 matches neither.
    LLM(TINY, runner_factory=fake_factory, world_size=2, tensor_parallel_size=1)
    with pytest.raises(ConfigError, match="world size \\(2\\), or 1"):
        LLM(TINY, runner_factory=_never_load, world_size=2, tensor_parallel_size=3)
    for ep in (True, False):
        LLM(
            TINY,
            runner_factory=fake_factory,
            world_size=2,
            tensor_parallel_size=2,
            enable_expert_parallel=ep,
        )


def test_odd_page_and_short_page_refused():
    odd = dataclasses.replace(TINY, replay=dataclasses.replace(TINY.replay, hash_block_tokens=33))
    with pytest.raises(ConfigError, match="must be even"):
        LLM(odd, runner_factory=_never_load, world_size=1)
    dims = dataclasses.replace(TINY.dims, sliding_window=64)
    wide = dataclasses.replace(
        TINY, dims=dims, replay=dataclasses.replace(TINY.replay, min_final_prefill_rows=64)
    )
    with pytest.raises(ConfigError, match="encoder_swa_bounded_replay.*window - 1 = 63"):
        LLM(wide, runner_factory=_never_load, world_size=1)
    LLM(wide, runner_factory=fake_factory, world_size=1, encoder_swa_bounded_replay=False)


def test_decoder_replay_switched_on_needs_the_final_rows_rule():
    # A spec compiled with decoder replay off may keep min_final_prefill_rows below W; switching
    # the replay on at launch would let a final forward hold fewer than W rows: refused.
    short = dataclasses.replace(
        TINY,
        replay=dataclasses.replace(
            TINY.replay, decoder_swa_bounded_replay=False, min_final_prefill_rows=1
        ),
    )
    with pytest.raises(
        ConfigError, match="decoder_swa_bounded_replay.*min_final_prefill_rows >= window = 8"
    ):
        LLM(short, runner_factory=_never_load, world_size=1, decoder_swa_bounded_replay=True)
    LLM(short, runner_factory=fake_factory, world_size=1)
    # an Engram layer in the decoder reads every row: decoder replay cannot be switched on
    late = dataclasses.replace(
        short,
        dims=dataclasses.replace(short.dims, engram_layer_ids=(1, 9)),
        replay=dataclasses.replace(short.replay, min_final_prefill_rows=8),
    )
    with pytest.raises(ConfigError, match=r"Engram layers \[9\] read every row"):
        LLM(late, runner_factory=_never_load, world_size=1, decoder_swa_bounded_replay=True)


def test_graph_mode_needs_eager_off():
    with pytest.raises(ConfigError, match="enforce_eager=False"):
        LLM(TINY, runner_factory=_never_load, world_size=1, cudagraph_mode="FULL")


def test_fake_runner_catches_wrong_resume():
    llm = fake_llm(long_prefill_token_threshold=32)
    seq = llm.add_request(prompt(100), GREEDY)
    llm.step()
    seq.num_cached_tokens = 40  # corrupt the cursor: the slot holds state at 32
    with pytest.raises(RuntimeError, match="needs state at 40, found 32"):
        llm.step()
    _ = fake_factory  # the factory is what fake_llm uses


def test_hashes_chain_and_publish_after_forward():
    from v41plan.serving.block_manager import chain_hashes

    a, b = prompt(96), prompt(96)
    b[40] += 1  # differs in block 1: blocks 1 and 2 hash differently, block 0 does not
    ha, hb = chain_hashes(a, 32, 3), chain_hashes(b, 32, 3)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]
    assert b[64:] == a[64:]  # block 2's tokens agree, yet its hash differs through the chain
    llm = fake_llm(long_prefill_token_threshold=32)
    seq = llm.add_request(a, GREEDY)
    batch = llm.scheduler.schedule()
    assert llm.block_manager.lookup(ha) == []  # allocated, not yet written: not published
    llm.scheduler.postprocess(batch, llm.runner.execute(batch))
    assert llm.block_manager.lookup(ha) == [seq.block_table[0]]  # block 0 written, published


def test_generated_token_count_is_the_output_length():
    seq = Sequence(0, prompt(7), 7, GREEDY)
    assert seq.num_output_tokens == len(seq.output_ids) == 0
    seq.token_ids += [3, 4, 5]
    assert seq.num_output_tokens == len(seq.output_ids) == 3
    assert seq.output_ids == [3, 4, 5]
