"""The graph plumbing that runs without CUDA, and proof that graphs capture the eager forward.

``CudaGraphs`` takes its device calls from a small API; here an API that records each captured
callable and re-runs it on replay (refreshing the captured output tensors in place, as a CUDA
replay refreshes them) stands in for CUDA. FULL graphs then run exactly what a CUDA capture
records: ``RuntimeModel.run`` on the inputs ``prepare`` laid out for the bucket. Two models over
the same weights run the same prefill; each decode step then runs eagerly on one and through a
"replay" on the other: logits must agree bit for bit and the pools must hold the same bytes.
TINY has every layer role (window, Full owners, Reindex, the candidate source, Engram); the
40-layer schedule and real CUDA graphs run in ``tests/gpu``.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import model, runtime, step, token_ids
from v41plan.planner.step import RequestInput, StepInput
from v41plan.runtime.graphs import (
    CudaGraphs,
    build_cuda_graphs,
    capture_buckets,
    graph_validation,
    pad_for_graphs,
    select_bucket,
    synthetic_plan,
)
from v41plan.runtime.paged_model import RuntimeModel
from v41plan.serving.admission import ConfigError, check_options

TABLES = ((9, 7, 5, 3), (8, 6, 4, 2), (1, 10, 11, 12))


class _Recorded:
    """A "graph" that keeps the captured callable and its outputs."""

    fn = None
    out = None

    def replay(self):
        new = self.fn()
        for a, b in zip(
            (self.out.logits, self.out.row_logits), (new.logits, new.row_logits), strict=True
        ):
            if a is not None:
                a.copy_(b)


class EagerGraphAPI:
    """Records captured callables and re-runs them on replay (FULL only: a PIECEWISE piece
    rebinds frame tensors, which only a real capture freezes)."""

    def __init__(self):
        self.captured = []

    def new_graph(self):
        return _Recorded()

    def pool(self):
        return None

    def capture(self, graph, pool, fn):
        graph.fn, graph.out = fn, fn()
        self.captured.append(fn)
        return graph.out

    def guard(self, what, pool, record, refuse_outside=True):
        record.append(
            {"what": what, "new_segments": 0, "pool_ids_reported": True, "outside_pool": []}
        )
        return nullcontext()

    def synchronize(self):
        pass


def _pair(spec_name, kv, ix):
    """Two runtime models over the same weights, with three requests prefilled identically."""
    spec = model(spec_name)[0]
    a, b = runtime(spec_name, kv, ix), runtime(spec_name, kv, ix)
    prompts = (13, 6, 17)  # odd and even ends: ratio-2 groups open and closed at the decode
    ids = [token_ids(p + 4, seed) for seed, p in enumerate(prompts)]
    for m in (a, b):
        for slot in range(3):
            m.pools.reset_slot(slot)
        plan = step(spec, [(s, TABLES[s], prompts[s], 0, prompts[s], "prefill") for s in range(3)])
        m.forward(plan, np.concatenate([ids[s][: prompts[s]] for s in range(3)]))
    return spec, a, b, prompts, ids


@pytest.mark.parametrize("spec_name,kv,ix", [("tiny", "bf16", "fp8"), ("tiny", "fp4", "fp4")])
def test_replayed_full_graph_is_the_eager_forward(spec_name, kv, ix, monkeypatch):
    spec, eager, graphed, prompts, ids = _pair(spec_name, kv, ix)
    runs = []
    real_run = RuntimeModel.run

    def counted(self, inputs):
        runs.append(self)
        return real_run(self, inputs)

    monkeypatch.setattr(RuntimeModel, "run", counted)
    api = EagerGraphAPI()
    graphs = CudaGraphs(graphed, spec, [(1, 1), (2, 1), (4, 1)], "FULL", api=api)
    before = graphed.pools.backing.clone()
    graphs.capture()
    assert torch.equal(graphed.pools.backing, before), "capture left the pools changed"
    assert graphs.report["pages_untouched"] and graphs.report["slots_untouched"]
    runs.clear()
    done = list(prompts)
    for k in range(3):  # three decode steps, the last padded to a wider bucket
        reqs = tuple(
            RequestInput(
                slot=s, block_table=TABLES[s], prompt_len=prompts[s], start=done[s], chunk_len=1,
                phase="decode",
            )
            for s in range(3 - (k == 1))
        )  # fmt: skip
        padded = pad_for_graphs(graphs, StepInput(reqs), True)
        from v41plan.planner.step import plan_step

        plan = plan_step(padded, spec)
        flat = np.array([ids[r.slot][r.start] for r in reqs])
        want = eager.forward(plan, flat).logits
        got = graphs.run(graphed.prepare(plan, flat)).logits
        assert torch.equal(got, want), f"replay differs from eager at decode step {k}"
        assert torch.equal(eager.pools.backing, graphed.pools.backing), (
            f"pool bytes differ after decode step {k}"
        )
        done = [x + 1 if (k != 1 or s < 2) else x for s, x in enumerate(done)]
    # every replay re-ran the captured call, and that call was RuntimeModel.run
    assert graphs.stats["replays"] == 3 and graphs.stats["graph_steps"] == 3
    assert runs.count(graphed) == 3 and runs.count(eager) == 3
    assert graphs.replays_per_step() == 1


def test_prepare_keeps_device_addresses_per_bucket_and_padding_sentinels():
    spec, _, m, prompts, ids = _pair("tiny", "bf16", "fp8")
    plan = step(
        spec,
        [(s, TABLES[s], prompts[s], prompts[s], 1, "decode") for s in range(2)],
        pad_bs=2,
        pad_tokens=2,
    )
    flat = np.array([ids[0][prompts[0]], ids[1][prompts[1]]])
    a = m.prepare(plan, flat)
    ptrs = [a.token_ids.data_ptr(), a.slots.data_ptr(), a.cursors.data_ptr()]
    b = m.prepare(plan, flat[::-1].copy())
    assert a.key == b.key
    assert [b.token_ids.data_ptr(), b.slots.data_ptr(), b.cursors.data_ptr()] == ptrs
    assert b.batch_ids[:4].tolist() == [0, 1, -1, -1]
    assert b.slots[:4].tolist() == [0, 1, -1, -1]
    assert b.per_request["last_rows"][:4].tolist() == [0, 1, -1, -1]
    assert b.token_ids[:2].tolist() == [int(flat[1]), int(flat[0])]
    assert b.cursors[0, 0].item() == prompts[0] + 1  # committed position after the step
    assert m.pools.cursor_host[0, 0] == prompts[0] + 1  # the host mirror holds it already
    # padding requests write nothing: their logits are zero and other slots are untouched
    before = m.pools.state[2:].clone()
    logits = m.run(b).logits
    assert torch.equal(logits[2:], torch.zeros_like(logits[2:]))
    assert torch.equal(m.pools.state[2:], before)
    assert m.pools.cursor[:2].tolist() == m.pools.cursor_host[:2].tolist()


def test_prepare_reads_the_cursor_mirror_not_the_device():
    """``prepare`` takes every request's Engram history from the host mirror: a device cursor
    poisoned before the step changes nothing (the forward then commits the right values)."""
    spec, clean, poisoned, prompts, ids = _pair("tiny", "bf16", "fp8")
    plan = step(spec, [(s, TABLES[s], prompts[s], prompts[s], 1, "decode") for s in range(3)])
    flat = np.array([ids[s][prompts[s]] for s in range(3)])
    poisoned.pools.cursor[:3, 1:] = 7  # wrong history on the device only
    want = clean.forward(plan, flat).logits
    got = poisoned.forward(plan, flat).logits
    assert torch.equal(got, want)
    assert torch.equal(poisoned.pools.backing, clean.pools.backing)


def test_capture_refuses_cpu_without_an_api():
    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8")
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphs(m, spec, [(1, 1)], "FULL")
    with pytest.raises(ValueError, match="accepted: FULL, PIECEWISE"):
        CudaGraphs(m, spec, [(1, 1)], "NONE", api=EagerGraphAPI())


def test_capture_buckets_filter_and_selection():
    spec = model("tiny")[0]  # batch_sizes [1, 2, 4, 8], query_buckets [1]
    assert capture_buckets(spec, 8, 512) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert capture_buckets(spec, 4, 512) == [(1, 1), (2, 1), (4, 1)]
    assert capture_buckets(spec, 8, 3) == [(1, 1), (2, 1)]
    b = [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2)]
    assert select_bucket(b, 3, 1) == (4, 1)
    assert select_bucket(b, 1, 1) == (1, 1)
    assert select_bucket(b, 3, 2) == (4, 2)
    assert select_bucket(b, 9, 1) is None
    assert select_bucket(b, 2, 3) is None


def test_decode_steps_pad_to_their_bucket():
    m = runtime("tiny", "bf16", "fp8")

    class _G:  # what pad_for_graphs reads from a captured runner
        pass

    _G.buckets, _G.model = [(1, 1), (2, 1), (4, 1)], m
    reqs = tuple(
        RequestInput(slot=i, block_table=(i,), prompt_len=5, start=5, chunk_len=1, phase="decode")
        for i in range(3)
    )
    s = pad_for_graphs(_G, StepInput(reqs), True)
    assert (s.running_bs, s.running_tokens, s.block_table_width) == (
        4,
        4,
        m.table_width,
    )
    assert pad_for_graphs(None, StepInput(reqs), True) == StepInput(reqs)
    assert pad_for_graphs(_G, StepInput(reqs), False) == StepInput(reqs)
    big = tuple(
        RequestInput(slot=i, block_table=(i,), prompt_len=5, start=5, chunk_len=1, phase="decode")
        for i in range(4)
    ) + (
        RequestInput(slot=4, block_table=(9,), prompt_len=5, start=5, chunk_len=1, phase="decode"),
    )
    assert (
        pad_for_graphs(_G, StepInput(big), True).running_bs is None
    )  # larger than every bucket: eager


def test_synthetic_capture_step_binds_slots_and_page_zero():
    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8")
    plan = synthetic_plan(m, spec, 4, 1)
    assert plan.graph_key == ("decode", 4, 4)
    assert plan.slots.tolist() == [0, 1, 2, 3]
    assert (plan.block_tables == 0).all() and plan.block_tables.shape[1] == m.table_width
    assert (plan.positions == spec.dims.sliding_window).all()


def test_eager_options_and_cpu_models_build_no_graphs():
    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8")
    eager = check_options({}, spec)
    assert build_cuda_graphs(m, spec, eager) is None
    full = check_options({"enforce_eager": False, "cudagraph_mode": "FULL"}, spec)
    assert build_cuda_graphs(m, spec, full) is None  # CPU model: eager, with a warning


@pytest.mark.parametrize(
    "opts,msg",
    [
        ({"cudagraph_mode": "FULL"}, "enforce_eager=False"),
        ({"compile_backend": "tvm"}, "accepted: inductor, aot_eager, eager"),
        (
            {"enforce_eager": False, "cudagraph_mode": "SOMETIMES"},
            "accepted: NONE, FULL, PIECEWISE",
        ),
        ({"compilation_level": 2}, "accepted: 0, 3, None"),
    ],
)
def test_admission_refuses_graph_combinations_before_loading(opts, msg):
    spec = model("tiny")[0]
    with pytest.raises(ConfigError, match=msg):
        check_options(opts, spec)
    for ok in (
        {"enforce_eager": False, "cudagraph_mode": "FULL", "compilation_level": 3},
        {"compilation_level": 3},
        {"enforce_eager": False, "cudagraph_mode": "PIECEWISE"},
        {"enforce_eager": False, "cudagraph_mode": "PIECEWISE", "compilation_level": 3},
    ):
        check_options(ok, spec)


def _graph_case(graph_steps=3, replays=3, eager_steps=0, eager_tokens=None, mode="FULL", per=1):
    graph = {
        "baseline": {"passed": True, "tokens": [[1, 2]]},
        "fork": {"passed": True, "tokens": [[3]]},
        "ranks_agree": {"passed": True},
    }
    eager = {
        "baseline": {"passed": True, "tokens": [[1, 2]]},
        "fork": {"passed": True, "tokens": eager_tokens or [[3]]},
    }
    stats = {
        "mode": mode,
        "replays_per_step": per,
        "stats": {
            "replays": replays,
            "graph_steps": graph_steps,
            "eager_decode_steps": eager_steps,
        },
        "capture": {
            "graph_shapes": [[1, 1, 1]],
            "untouched_from_page": 1,
            "pages_untouched": True,
            "slots_untouched": True,
        },
    }
    events = (
        [{"phase": "prefill"}]
        + [{"phase": "decode"}] * 3
        + [{"phase": "decode", "runner": "replay_off"}]
    )
    return graph_validation(graph, eager, stats, events)


def test_graph_validation_compares_every_scenario_and_accounts_every_decode_step():
    ok = _graph_case()
    assert ok["passed"] and ok["scenarios_compared"] == ["baseline", "fork"]
    # the other runner's step is not counted
    assert ok["decode_steps"] == 3 and ok["replays_per_decode_step"] == 1.0
    eager_step = _graph_case(graph_steps=2, eager_steps=1, replays=2)
    assert not eager_step["passed"] and "1 decode steps ran eager" in eager_step["error"]
    bad = _graph_case(eager_tokens=[[4]])
    assert not bad["passed"] and bad["mismatched"] == ["fork"]
    lost = _graph_case(graph_steps=2, replays=2)
    assert not lost["passed"] and "3 decode steps, but 2 were graph steps" in lost["error"]
    assert "exactly 1 per step" in _graph_case(replays=6)["error"]
    assert "exactly 1 per step" in _graph_case(replays=2)["error"]
    assert (
        "no decode step replayed" in _graph_case(graph_steps=0, replays=0, eager_steps=3)["error"]
    )
    assert _graph_case(replays=3 * 30, mode="PIECEWISE", per=30)["passed"]
    assert not _graph_case(replays=3 * 29, mode="PIECEWISE", per=30)["passed"]


def test_finding_triton_kernels_survives_dead_weak_proxies():
    """The heap walk before capture meets dead weak proxies (Inductor leaves some): ``isinstance``
    on one raises ``ReferenceError``; the walk skips them."""
    import gc
    import weakref

    pytest.importorskip("triton")
    from v41plan.runtime.graphs import find_triton_kernels

    class Target:
        pass

    t = Target()
    proxy = weakref.proxy(t)
    del t
    gc.collect()
    assert any(o is proxy for o in gc.get_objects())
    with pytest.raises(ReferenceError):
        isinstance(proxy, int)
    assert find_triton_kernels() >= 0
