"""The capturable decode forward and the graph plumbing that runs without CUDA.

``DecodeForward`` (what a FULL graph captures) against the eager ``RuntimeModel.forward`` on
decode steps: two models over the same weights run the same prefill, then each decode step
runs eager on one and through the decode forward on the other. Logits must agree to float64
summation order (observed: bit-equal) and the pools must hold the same bytes afterwards. TINY
has every layer role (window, Full owners, Reindex, the candidate source, Engram); the 40-layer
schedule runs in ``tests/gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import model, runtime, step, token_ids
from v41plan.planner.step import RequestInput, StepInput
from v41plan.runtime.graphs import (
    DecodeForward,
    GraphRunner,
    build_graph_runner,
    capture_buckets,
    graph_validation,
    pad_for_graphs,
    select_bucket,
    synthetic_plan,
)
from v41plan.serving.admission import ConfigError, check_options

REL_TOL = 1e-12
TABLES = ((9, 7, 5, 3), (8, 6, 4, 2), (1, 10, 11, 12))


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
def test_decode_forward_equals_eager_decode(spec_name, kv, ix):
    spec, eager, dec, prompts, ids = _pair(spec_name, kv, ix)
    d = DecodeForward(dec)
    done = list(prompts)
    for k in range(3):  # three decode steps, the last padded to a wider bucket
        pad_bs = 1 if k == 2 else 0
        plan = step(
            spec,
            [(s, TABLES[s], prompts[s], done[s], 1, "decode") for s in range(3)],
            pad_bs=pad_bs,
            pad_tokens=pad_bs,
        )
        assert plan.graph_key[0] == "decode"
        flat = np.array([ids[s][done[s]] for s in range(3)])
        want = eager.forward(plan, flat).logits
        got = d.forward(plan, flat)
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= REL_TOL * want.abs().max().item(), (k, err)
        assert torch.equal(eager.pools.backing, dec.pools.backing), (
            f"pool bytes differ after decode step {k}"
        )
        done = [x + 1 for x in done]


def test_decode_forward_refuses_prefill_steps():
    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8")
    plan = step(spec, [(0, (1, 2), 5, 0, 5, "prefill")])
    with pytest.raises(ValueError, match="decode steps only"):
        DecodeForward(m).load(plan, np.zeros(5, dtype=np.int64))


def test_static_buffers_keep_their_addresses_and_padding_sentinels():
    spec, _, dec, prompts, ids = _pair("tiny", "bf16", "fp8")
    d = DecodeForward(dec)
    ptrs = [
        dec.buf.positions.data_ptr(),
        dec.buf.slots.data_ptr(),
        d.buf.token_ids.data_ptr(),
        d.buf.cursors.data_ptr(),
    ] + [c.data_ptr() for c in d.buf.engram_codes]
    plan = step(
        spec,
        [(s, TABLES[s], prompts[s], prompts[s], 1, "decode") for s in range(2)],
        pad_bs=2,
        pad_tokens=2,
    )
    d.load(plan, np.array([ids[0][prompts[0]], ids[1][prompts[1]]]))
    after = [
        dec.buf.positions.data_ptr(),
        dec.buf.slots.data_ptr(),
        d.buf.token_ids.data_ptr(),
        d.buf.cursors.data_ptr(),
    ] + [c.data_ptr() for c in d.buf.engram_codes]
    assert ptrs == after
    assert dec.buf.batch_ids[:4].tolist() == [0, 1, -1, -1]
    assert dec.buf.slots[:4].tolist() == [0, 1, -1, -1]
    assert dec.buf.last_rows[:4].tolist() == [0, 1, -1, -1]
    assert d.buf.token_ids[:2].tolist() == [int(ids[0][prompts[0]]), int(ids[1][prompts[1]])]
    assert d.buf.cursors[0, 0].item() == prompts[0] + 1  # committed position after the step
    # padding requests write nothing: their logits are zero and other slots are untouched
    before = dec.pools.state[2:].clone()
    logits = d.run(plan.running_tokens, plan.running_bs)
    assert torch.equal(logits[2:], torch.zeros_like(logits[2:]))
    assert torch.equal(dec.pools.state[2:], before)


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
        m.buf.block_tables.shape[1],
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
    assert (plan.block_tables == 0).all() and plan.block_tables.shape[
        1
    ] == m.buf.block_tables.shape[1]
    assert (plan.positions == spec.dims.sliding_window).all()


def test_graph_runner_refuses_cpu_and_eager_options_build_none():
    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8")
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(m, spec, [(1, 1)], "FULL")
    with pytest.raises(ValueError, match="accepted: FULL, PIECEWISE"):
        GraphRunner(m, spec, [(1, 1)], "NONE")
    eager = check_options({}, spec)
    assert build_graph_runner(m, spec, eager) is None
    full = check_options({"enforce_eager": False, "cudagraph_mode": "FULL"}, spec)
    assert build_graph_runner(m, spec, full) is None  # CPU model: eager, with a warning


@pytest.mark.parametrize(
    "opts,msg",
    [
        ({"cudagraph_mode": "FULL"}, "enforce_eager=False"),
        (
            {"enforce_eager": False, "cudagraph_mode": "PIECEWISE", "compilation_level": 3},
            "FULL graphs or eager",
        ),
        (
            {"enforce_eager": False, "cudagraph_mode": "SOMETIMES"},
            "accepted: NONE, FULL, PIECEWISE",
        ),
        ({"compilation_level": 2}, "accepted: 0, 3"),
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
    ):
        check_options(ok, spec)


def _graph_case(graph_steps=3, replays=3, eager_steps=0, eager_tokens=None, mode="FULL"):
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
    assert (
        ok["decode_steps"] == 3 and ok["replays_per_decode_step"] == 1.0
    )  # other runner's step not counted
    assert _graph_case(graph_steps=2, eager_steps=1, replays=2)["passed"]
    bad = _graph_case(eager_tokens=[[4]])
    assert not bad["passed"] and bad["mismatched"] == ["fork"]
    lost = _graph_case(graph_steps=2, replays=2)
    assert not lost["passed"] and "3 decode steps, but 2 replayed" in lost["error"]
    assert "replays per decode step" in _graph_case(replays=9)["error"]
    assert (
        "no decode step replayed" in _graph_case(graph_steps=0, replays=0, eager_steps=3)["error"]
    )
