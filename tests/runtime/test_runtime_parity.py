"""Paged runtime vs the dense reference, both replays off, float64 with the quantizers on.

The reference's ``index_cache_dtype`` matches the plane (``fp8``: E4M3 rows with fp32 scales;
``fp4``: the published FP4 arithmetic), so both sides round the same values the same way and
differ only in summation order. Tolerance: max |paged - reference| <= 1e-12 * max |reference|
over every row's logits (observed about 1e-15); index top-k selections must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import (
    PAIRS,
    cursor_expected,
    model,
    reference,
    runtime,
    step,
    token_ids,
)

REL_TOL = 1e-12
CHUNKS_A = (3, 1, 129, 7, 128)  # the schedule: 3, 1, 129, 7, then 128s
CHUNKS_B = (7, 1, 3, 129)  # finishes first: its decode rows share a step with A's last chunk
DECODES = 2
# non-contiguous, descending block tables; non-zero slots
TABLE_A = (22, 19, 15, 13, 11, 9, 7, 5, 3)
TABLE_B = (20, 18, 16, 14, 12, 10, 8, 6, 4)


def _index_fmt(ix: str) -> str:
    return "fp8" if ix == "fp8" else "fp4"


def _check_rows(m, out, plan, b, ref_logits, ref_sel, lo, n):
    """Request ``b``'s rows ``[lo, lo+n)`` of this step against the reference."""
    row0 = int(plan.cu_seqlens_q[b])
    got = out.row_logits[row0 : row0 + n]
    want = ref_logits[lo : lo + n]
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * want.abs().max().item(), (b, lo, n, err)
    for layer, sel in ref_sel.items():
        assert torch.equal(m.selections[layer][row0 : row0 + n], sel[lo : lo + n]), (b, layer, lo)


def _run(spec_name, kv, ix, requests, pad_tokens=3, pad_bs=1):
    """Teacher-force every request through its chunk schedule, then ``DECODES`` decode steps;
    a request that finishes first decodes in the same steps as the others' prefill chunks."""
    spec, _cfg, _w, eng = model(spec_name)
    m = runtime(spec_name, kv, ix)
    prompts = [sum(r["chunks"]) for r in requests]
    refs = [
        reference(spec_name, _index_fmt(ix), r["seed"], p + DECODES)
        for r, p in zip(requests, prompts)
    ]
    ids = [token_ids(p + DECODES, r["seed"]) for r, p in zip(requests, prompts)]
    for r in requests:
        m.pools.reset_slot(r["slot"])
    done = [0] * len(requests)
    steps = max(len(r["chunks"]) for r in requests)
    for i in range(steps + DECODES):
        batch, order = [], []
        for j, r in enumerate(requests):
            if i < len(r["chunks"]):
                n, phase = r["chunks"][i], "prefill"
            elif i - len(r["chunks"]) < DECODES:
                n, phase = 1, "decode"
            else:
                continue
            batch.append((r["slot"], r["table"], prompts[j], done[j], n, phase))
            order.append(j)
        plan = step(spec, batch, pad_tokens=pad_tokens, pad_bs=pad_bs)
        flat = np.concatenate(
            [ids[j][done[j] : done[j] + batch[k][4]] for k, j in enumerate(order)]
        )
        out = m.forward(plan, flat, all_row_logits=True)
        for k, j in enumerate(order):
            n = batch[k][4]
            _check_rows(m, out, plan, k, refs[j][0], refs[j][1], done[j], n)
            done[j] += n
            assert m.pools.cursor[requests[j]["slot"]].tolist() == cursor_expected(
                eng, ids[j], done[j]
            )
            # the last-row logits the sampler reads are the same rows
            last = out.row_logits[int(plan.last_rows[k])]
            assert (out.logits[k] - last).abs().max() <= REL_TOL * last.abs().max()
        assert not out.logits[len(order) :].any()  # padding requests read nothing
    return m


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_ragged_batches_match_the_reference_on_tiny(pair):
    reqs = [
        {"slot": 2, "table": TABLE_A, "chunks": CHUNKS_A, "seed": 11},
        {"slot": 1, "table": TABLE_B, "chunks": CHUNKS_B, "seed": 12},
    ]
    _run("tiny", *pair, reqs)


def test_single_request_matches_the_reference_on_tiny():
    _run(
        "tiny",
        "bf16",
        "fp8",
        [{"slot": 3, "table": TABLE_A, "chunks": CHUNKS_A, "seed": 11}],
        pad_tokens=0,
        pad_bs=0,
    )


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_tiny40_matches_the_reference(pair):
    # every format pair on the released 40-layer topology
    reqs = [
        {"slot": 1, "table": TABLE_B, "chunks": CHUNKS_A, "seed": 21},
        {"slot": 3, "table": TABLE_A, "chunks": CHUNKS_B, "seed": 22},
    ]
    _run("tiny40", *pair, reqs)


def test_unsupported_formats_are_refused_before_weights_load(tmp_path):
    from v41plan.runtime.paged_model import RuntimeModel

    spec, *_ = model("tiny")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' is not supported; accepted: bf16, fp4"
    ):
        RuntimeModel.from_checkpoint(tmp_path / "missing", spec, kv_cache_dtype="fp8")
    with pytest.raises(
        ValueError, match=r"index_cache_dtype='bf16' is not supported; accepted: fp8, fp4"
    ):
        RuntimeModel.from_checkpoint(tmp_path / "missing", spec, index_cache_dtype="bf16")


def test_a_forward_given_more_rows_than_its_step_declares_raises():
    spec, *_ = model("tiny")
    m = runtime("tiny", "bf16", "fp8")
    plan = step(spec, [(1, TABLE_A, 40, 0, 5, "prefill")])
    with pytest.raises(ValueError, match="given 6 rows but its step declares 5"):
        m.forward(plan, token_ids(6, 0))
