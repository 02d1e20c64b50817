"""CUDA-graph decode on a GPU: replay equals eager, capture touches nothing, the guard fires.

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TABLES = ((9, 7, 5, 3), (8, 6, 4, 2), (1, 10, 11, 12))
PROMPTS = (13, 6, 17)
DECODES = 4


@functools.cache
def _weights(spec_name: str):
    """(compiled spec, config, float32 CUDA weights, Engram host) of the seeded random checkpoint
    (the compiled spec: the GPU image has no YAML reader)."""
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec

    spec = resolve_spec(spec_name)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    return spec, cfg, ckpt.process(torch.float32, "cuda"), ckpt.engram_host()


def _models(spec_name: str, kv: str = "bf16", ix: str = "fp8", dtype=torch.float32, **kw):
    """Two CUDA runtime models over the same random weights (``kw``: more ``RuntimeModel``
    arguments)."""
    from v41plan.runtime.paged_model import RuntimeModel

    spec, cfg, wc, eng = _weights(spec_name)
    args = {
        "num_pages": 24,
        "num_slots": 4,
        "max_tokens": 64,
        "max_bs": 4,
        "table_width": 12,
        "dtype": dtype,
        "device": "cuda",
        "cfg": cfg,
        **kw,
    }
    return (
        spec,
        eng,
        [
            RuntimeModel(spec, wc, eng, kv_cache_dtype=kv, index_cache_dtype=ix, **args)
            for _ in range(2)
        ],
    )


def _prefill(spec, m, ids):
    from tests.runtime.paged_helpers import step

    for slot in range(3):
        m.pools.reset_slot(slot)
    plan = step(spec, [(s, TABLES[s], PROMPTS[s], 0, PROMPTS[s], "prefill") for s in range(3)])
    m.forward(plan, np.concatenate([ids[s][: PROMPTS[s]] for s in range(3)]))


def _graph_vs_eager(spec_name: str, mode: str, kv: str = "bf16", ix: str = "fp8", **kw):
    from tests.runtime.paged_helpers import token_ids
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets, pad_decode_step, select_bucket

    spec, _, (eager, graphed) = _models(spec_name, kv, ix, **kw)
    runner = CudaGraphs(graphed, spec, capture_buckets(spec, 4, 64), mode)
    report = runner.capture()
    ids = [token_ids(p + DECODES, seed) for seed, p in enumerate(PROMPTS)]
    _prefill(spec, eager, ids)
    _prefill(spec, graphed, ids)
    done = list(PROMPTS)
    for _ in range(DECODES):
        reqs = tuple(
            RequestInput(
                slot=s,
                block_table=TABLES[s],
                prompt_len=PROMPTS[s],
                start=done[s],
                chunk_len=1,
                phase="decode",
            )
            for s in range(3)
        )
        bucket = select_bucket(runner.buckets, 3, 1)
        plan = plan_step(pad_decode_step(StepInput(reqs), bucket, graphed.table_width), spec)
        flat = np.array([ids[s][done[s]] for s in range(3)])
        want = eager.forward(plan, flat).logits
        got = runner.run(graphed.prepare(plan, flat)).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert torch.equal(eager.pools.backing, graphed.pools.backing)
        done = [d + 1 for d in done]
    return runner, report


@pytest.mark.parametrize("spec_name", ["tiny", "tiny40"])
def test_full_graph_replay_equals_eager_decode(spec_name):
    runner, report = _graph_vs_eager(spec_name, "FULL")
    assert report["pages_untouched"] and report["slots_untouched"]
    assert runner.stats["graph_steps"] == DECODES
    assert runner.stats["replays"] / runner.stats["graph_steps"] <= 2
    assert runner.stats["replays"] == DECODES  # FULL: one replay per decode step


def test_full_graph_fp4_planes_equal_eager():
    _graph_vs_eager("tiny", "FULL", "fp4", "fp4")


def test_piecewise_replay_equals_eager_decode():
    runner, _ = _graph_vs_eager("tiny", "PIECEWISE")
    layers = len(runner.model.cfg.layers)
    # the embedding, per layer the dense pieces before and after attention, the head
    assert runner.replays_per_step() == 2 * layers + 2
    assert runner.stats["replays"] == (2 * layers + 2) * DECODES


def test_capture_restores_the_pools_and_checks_untouched_pages():
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets

    spec, _, (m, _) = _models("tiny")
    g = torch.Generator(device="cuda").manual_seed(0)
    m.pools.backing.copy_(
        torch.randint(0, 256, m.pools.backing.shape, generator=g, device="cuda", dtype=torch.uint8)
    )
    before = m.pools.backing.clone()
    runner = CudaGraphs(m, spec, capture_buckets(spec, 4, 64), "FULL")
    report = runner.capture()
    assert report["pages_untouched"] and report["slots_untouched"]
    assert report["untouched_from_page"] >= 1
    assert torch.equal(m.pools.backing, before)


def test_capture_guard_catches_a_planted_host_sync():
    from v41plan.runtime.graphs import CaptureGuardError, CudaGraphs, capture_buckets

    spec, _, (m, _) = _models("tiny")
    runner = CudaGraphs(m, spec, capture_buckets(spec, 1, 64), "FULL")
    real = m.backend.cursor_write

    def syncing_cursor_write(cursor, slot, values, sink_slot):
        if values.sum().item() < -1:  # a host read of device data: a sync
            pass
        return real(cursor, slot, values, sink_slot)

    m.backend.cursor_write = syncing_cursor_write
    with pytest.raises(CaptureGuardError, match=r"capture of (primer|decode)\[bs=1"):
        runner.capture()  # the primer capture, the first to run the decode forward, catches it


def test_capture_guard_alone_catches_sync_inside_a_graph():
    from v41plan.runtime.graphs import CaptureGuardError, capture_guard

    x = torch.ones(4, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureGuardError), capture_guard("planted"), torch.cuda.graph(g):
        (x * 2).sum().item()


def test_capture_guard_refuses_a_segment_outside_the_graph_pool():
    from v41plan.runtime.graphs import CaptureGuardError, capture_guard

    x = torch.ones(1 << 20, device="cuda")
    (x * 2).sum()
    torch.cuda.synchronize()
    guarded, other = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    g, record = torch.cuda.CUDAGraph(), []
    # the capture allocates into a fresh pool the guard was not told about: a new segment
    # outside the guarded pool, as an allocation escaping the graph's pool would be
    with (
        pytest.raises(CaptureGuardError, match="outside the graph pool"),
        capture_guard("planted", guarded, record),
        torch.cuda.graph(g, pool=other),
    ):
        x * 3
    assert record and record[0]["outside_pool"]


def test_runner_capture_allocates_only_inside_its_pool():
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets

    spec, _, (m, _) = _models("tiny40")
    runner = CudaGraphs(m, spec, capture_buckets(spec, 4, 64), "FULL")
    report = runner.capture()  # refuses a segment outside the pool after the primer
    assert report["segments_outside_graph_pool"] == []
    assert report["pool_ids_reported"]
    print("primer segments outside the pool:", report["primer_segments_outside_graph_pool"])


def test_engine_with_full_graphs_generates_eager_tokens():
    """The engine's FULL decode graphs (with the CUDA default ``async_scheduling``) generate the
    eager engine's tokens. In float64, as ``validate_runtime --graph``: random tiny40 weights
    turn float32 differences of a few ulps (Inductor's reduction order at level 3, the FULL
    engine's default) into other tokens (``test_random_weights_amplify_op_differences``). On the
    H200 two float32 engines built one after the other in one process already differed in the
    first token of a prefill (``reports/gpu/gpu_async_check_1d97cb6.log``; the cause is not
    found yet)."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 40))]
    outs = {}
    for mode in ("NONE", "FULL"):
        llm = LLM(
            "tiny40",
            enforce_eager=mode == "NONE",
            cudagraph_mode=mode,
            device="cuda",
            dtype="float64",
            max_num_seqs=4,
            max_model_len=256,
        )
        assert llm.async_scheduling
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.overlapped_steps > 0
        if mode == "FULL":
            stats = llm.runner.graph_stats()
            assert stats["stats"]["graph_steps"] > 0
            assert stats["stats"]["replays"] == stats["stats"]["graph_steps"]
    assert outs["FULL"] == outs["NONE"]


def test_a_whole_prefill_and_decode_step_make_no_host_sync():
    """``prepare`` + ``run`` of a prefill step (decoder replay on, ragged, two requests) and of a
    decode step, eager and FULL, under ``set_sync_debug_mode("error")``: any synchronizing CUDA
    call inside raises. The step's results are then read back once, outside."""
    from tests.runtime.paged_helpers import step, token_ids
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets, pad_decode_step, select_bucket

    spec, _, (m, g) = _models("tiny40")
    runner = CudaGraphs(g, spec, capture_buckets(spec, 4, 64), "FULL")
    runner.capture()
    ids = [token_ids(40, 1), token_ids(20, 2)]  # 60 rows fit the model's 64
    outs = {}
    for name, model in (("eager", m), ("full", g)):
        for slot in range(2):
            model.pools.reset_slot(slot)
        prefill = step(
            spec,
            [(0, TABLES[0], 40, 0, 40, "prefill"), (1, TABLES[1], 20, 0, 20, "prefill")],
            decoder_replay=True,
        )
        flat = np.concatenate([ids[0], ids[1]])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            first = model.run(model.prepare(prefill, flat))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        from v41plan.planner.step import RequestInput, StepInput, plan_step

        reqs = tuple(
            RequestInput(slot=s, block_table=TABLES[s], prompt_len=n, start=n, chunk_len=1,
                         phase="decode")
            for s, n in ((0, 40), (1, 20))
        )  # fmt: skip
        bucket = select_bucket(runner.buckets, 2, 1)
        dec = plan_step(pad_decode_step(StepInput(reqs), bucket, model.table_width), spec)
        nxt = np.array([5, 6])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            inputs = model.prepare(dec, nxt)
            res = runner.run(inputs) if model is g else model.run(inputs)
            assert res is not None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs[name] = (first.logits.cpu(), res.logits.cpu())
    assert runner.stats["replays"] == 1
    torch.testing.assert_close(outs["full"][0], outs["eager"][0], rtol=0, atol=0)
    torch.testing.assert_close(outs["full"][1], outs["eager"][1], rtol=1e-5, atol=1e-5)


def test_the_runner_reads_each_step_back_once_without_a_sync_inside():
    """Engine steps on the paged runner, overlapped and not: a launch (plan, prepare, the
    forward, the queued copy of its results) runs under the sync debug mode; ``collect``, the
    step's one wait, runs once per batch."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    for overlap in (False, True):
        llm = LLM("tiny40", enforce_eager=False, cudagraph_mode="FULL", device="cuda",
                  dtype="float32", max_num_seqs=4, max_model_len=256,
                  async_scheduling=overlap)  # fmt: skip
        runner = llm.runner
        real_launch, real_collect = runner.launch, runner.collect
        seen = []

        def collect(launched, real_collect=real_collect, seen=seen):
            seen.append(launched.batch.step)
            return real_collect(launched)

        def launch(batch, real_launch=real_launch):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real_launch(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.launch, runner.collect = launch, collect
        out = llm.generate(
            [[1, 2, 3, 4, 5], [9, 8, 7]], SamplingParams(max_tokens=12, ignore_eos=True)
        )
        assert all(len(o.outputs[0].token_ids) == 12 for o in out)
        assert sorted(seen) == list(range(1, llm.batches + 1))
        assert (runner.stats["pending_rows"] > 0) == overlap
