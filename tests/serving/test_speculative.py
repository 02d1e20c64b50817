"""DSpark speculative decoding through the engine (``tests/data/tiny8_dspark.yaml``, float64, CPU).

Greedy tokens with speculation equal greedy tokens without it, whatever the draft proposes:
the random draft (nothing accepted), an oracle draft with one wrong token per block (every
accepted length from 0 to 5), and the oracle with the rows written for rejected positions
poisoned after every verify step (they are never read before they are rewritten). The paged
draft proposes what the dense reference draft proposes. Options are refused before loading."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from v41plan.model.config import ConfigError
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

SPEC = str(Path(__file__).resolve().parents[1] / "data" / "tiny8_dspark.yaml")
"""tiny40_dspark's draft on tiny cut to 8 layers (every role kept, the taps on decoder layers
5-7 as tiny40_dspark's 37-39 are): these scenarios in about a quarter of tiny40's time.
tiny40_dspark itself still serves speculatively in ``tests/serving/test_server.py`` and has its
layout checked in ``tests/spec/test_dspark_layout.py``."""
DSPARK = {"method": "dspark", "num_speculative_tokens": 5}
PROMPTS = [[40 + (7 * i + j) % 200 for i in range(n)] for j, n in enumerate((20, 45, 9))]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _llm(**options) -> LLM:
    return LLM(SPEC, **{"dtype": "float64", "device": "cpu", "max_num_seqs": 4, **options})


@pytest.fixture(scope="module")
def plain_tokens():
    return [o.outputs[0].token_ids for o in _llm().generate(PROMPTS, GREEDY)]


def _oracle(llm: LLM, full: dict[int, list[int]], wrong_at=None):
    """Make ``llm``'s runner verify the true continuation (``full``: request id -> prompt and
    greedy output), with the token at block index ``wrong_at(step, row)`` changed."""
    runner = llm.runner
    inner = runner._spec_inputs
    step = [0]

    def spec_inputs(batch, slots):
        rows = batch.requests
        step[0] += 1
        for i in range(len(rows)):
            if rows.start[i] < rows.prompt_len[i]:
                continue
            seq, s = full[int(rows.seq_id[i])], int(rows.start[i])
            d = np.array((seq[s + 1 : s + 6] + [0] * 5)[:5])
            j = None if wrong_at is None else wrong_at(step[0], i)
            if j is not None and j < 5:
                d[j] = (d[j] + 1) % 250
            runner._drafts[slots[i], :5] = d
        return inner(batch, slots)

    runner._spec_inputs = spec_inputs


def _run(llm: LLM, full=None) -> list[list[int]]:
    seqs = [llm.add_request(p, GREEDY) for p in PROMPTS]
    if full is not None:
        full.update({s.seq_id: p for s, p in zip(seqs, full.pop("prompts"), strict=True)})
    llm.run_until_done()
    return [s.token_ids[s.num_prompt_tokens :] for s in seqs]


def test_random_draft_tokens_equal_plain_greedy(plain_tokens):
    llm = _llm(speculative_config=DSPARK)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_tokens
    st = llm.speculative_stats()
    assert st["drafts"] > 0 and st["draft_tokens"] == 5 * st["drafts"]
    assert sum(st["accepted_length_histogram"]) == st["drafts"]
    # every sampling step proposes: each request's prefill and each verify step
    assert st["proposals"] == st["drafts"] + len(PROMPTS)
    conf = st["mean_confidence"]
    assert len(conf) == 5 and all(np.isfinite(conf)) and len(set(conf)) > 1


def test_the_draft_follows_the_decoder_under_replay():
    """A non-final chunk runs no decoder row: the draft's rings stay as the slot reset left
    them. The final chunk seeds them from its tail only (the draft reads the window before the
    anchor, and the tail holds it)."""
    from v41plan.serving.engine import SamplingParams as SP

    llm = _llm(speculative_config=DSPARK, max_num_seqs=1, long_prefill_token_threshold=32,
               max_num_batched_tokens=64)  # fmt: skip
    pools = llm.runner.model.pools
    W, R, L = 8, pools.geometry.ring_rows, llm.spec.dims.num_hidden_layers
    prompt = [40 + (3 * i) % 200 for i in range(80)]
    seq = llm.add_request(prompt, SP(max_tokens=1, ignore_eos=True))
    seen = []
    while not seq.is_finished:
        llm.step()
        draft = pools.rings[0, L:].float()
        seen.append((seq.num_cached_tokens, bool(draft.abs().sum() > 0)))
        if seq.num_cached_tokens == len(prompt):
            # written: the ring slots of the tail's positions; left zero: none of them
            held = (draft.abs().sum(dim=(0, 2)) > 0).nonzero().flatten().tolist()
            tail = sorted({p % R for p in range(len(prompt) - W, len(prompt))})
            assert set(tail) <= set(held)
    assert seen[0] == (32, False) and seen[1] == (64, False) and seen[-1][1]


def _poison_rejected(llm: LLM) -> list[int]:
    """After each step, NaN (or 0xFF bytes) into every row a verify wrote for a rejected
    position: ring rows of every layer (the draft's too), compressed main rows and index keys
    of groups those positions closed, and the FP32 tails where no group is left open."""
    runner = llm.runner
    model, pools = runner.model, runner.model.pools
    B, R = runner.spec_block, pools.geometry.ring_rows
    inner = runner.collect
    poisoned = [0]

    def collect(launched):
        out = inner(launched)
        if launched.spec is None or out.spec_tokens is None:
            return out
        rows = launched.batch.requests
        for i in np.flatnonzero(launched.spec.verify).tolist():
            a = int((out.spec_tokens[i] >= 0).sum()) - 1
            slot, start = int(launched.slots[i]), int(rows.start[i])
            table = runner.tables.blocks[slot]
            for q in range(start + a + 1, start + B + 1):
                pools.rings[slot, :, q % R] = float("nan")
                for owner in model.spec.dims.kv_source_layer_ids:
                    r = model.cfg.layers[owner].ratio
                    if (q + 1) % r:
                        continue
                    c, per = q // r, pools.rows_per_page[owner]
                    page, row = int(table[c // per]), c % per
                    pools.main[owner][page, row] = float("nan")
                    for plane in model.index_planes(owner):
                        plane[page, row] = 0xFF
                poisoned[0] += 1
            if (start + a) % 2:  # the last accepted position closed its group: no tail open
                pools.tail_values[slot] = float("nan")
                pools.tail_scores[slot] = float("nan")
        return out

    runner.collect = collect
    return poisoned


@pytest.mark.parametrize("poison", [False, True], ids=["oracle", "oracle_poisoned"])
def test_oracle_drafts_accept_every_length(plain_tokens, poison):
    """One wrong token per block, at a place that cycles: every accepted length occurs, and
    the cursor, Engram history and tails committed at each length give the plain tokens."""
    llm = _llm(speculative_config=DSPARK)
    full = {"prompts": [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]}
    _oracle(llm, full, wrong_at=lambda step, row: (step + row) % 6)
    poisoned = _poison_rejected(llm) if poison else None
    assert _run(llm, full) == plain_tokens
    st = llm.speculative_stats()
    hist = st["accepted_length_histogram"]
    assert all(h > 0 for h in hist), hist
    assert st["accepted_tokens"] == sum(a * h for a, h in enumerate(hist))
    assert st["mean_accepted_length"] > 2.5  # fewer forwards than tokens
    if poison:
        assert poisoned[0] > 20


def test_a_whole_block_is_accepted_with_the_bonus_token(plain_tokens):
    llm = _llm(speculative_config=DSPARK)
    full = {"prompts": [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]}
    _oracle(llm, full)
    assert _run(llm, full) == plain_tokens
    st = llm.speculative_stats()
    # 20 tokens each: the prefill's, then three whole blocks of 6; the fourth verify step's
    # drafts run past the known continuation (zeros), so at least 15 of its 20 drafts accept
    assert st["accepted_length_histogram"][5] >= 3 * 3
    assert st["acceptance_rate"] >= 0.75


def test_a_written_checkpoint_loads_its_draft(tmp_path, plain_tokens):
    """``init-checkpoint`` writes the draft's ``mtp.*`` tensors; a speculating engine loads
    them from the directory and drafts what the in-memory random draft drafts."""
    from v41plan.cli.main import main

    assert main(["init-checkpoint", "--spec", SPEC, "--out", str(tmp_path / "ck")]) == 0
    runs = []
    for checkpoint in (str(tmp_path / "ck"), None):
        llm = LLM(SPEC, checkpoint, dtype="float64", device="cpu", max_num_seqs=4,
                  speculative_config=DSPARK)  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY)]
        runs.append((got, llm.runner._drafts.copy()))
    assert runs[0][0] == runs[1][0] == plain_tokens[:1]
    assert np.array_equal(runs[0][1], runs[1][1])


def test_paged_draft_proposes_the_reference_drafts():
    """After a prefill the paged draft's first block equals ``DraftReference``'s from the
    dense target's taps (float64, the same weights; decoder replay off, as the reference runs
    every layer on every row)."""
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.model.dspark import DraftReference
    from v41plan.model.reference import ReferenceModel

    llm = _llm(speculative_config=DSPARK, max_num_seqs=1, decoder_swa_bounded_replay=False)
    cfg = config_from_cache_spec(llm.spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0, draft=True))
    weights = ckpt.process(torch.float64)
    for prompt in PROMPTS:
        target = ReferenceModel(
            cfg, weights, ckpt.engram_host(), torch.float64, index_cache_dtype="fp8"
        )
        logits = target.prefill(prompt)
        draft = DraftReference(cfg, weights, torch.float64)
        draft.observe(target.taps, torch.arange(len(prompt)))
        first = int(torch.argmax(logits[-1]))
        want = draft.propose(first, len(prompt)).tokens
        seq = llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        llm.run_until_done()
        assert seq.token_ids[-1] == first
        assert llm.runner._drafts[0, :5].tolist() == want


def test_sampled_speculation_is_seeded():
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    runs = [
        [o.outputs[0].token_ids for o in _llm(speculative_config=DSPARK).generate(PROMPTS, params)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_emitted_logprobs_are_the_targets(plain_tokens):
    """The logprob of each emitted token is the target's raw log-softmax at it (what a plain
    decode step reports), accepted drafts included."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = _llm()
    want = plain.add_request(PROMPTS[0], params)
    plain.run_until_done()
    llm = _llm(speculative_config=DSPARK)
    full = {"prompts": [PROMPTS[0] + plain_tokens[0]]}
    _oracle(llm, full, wrong_at=lambda step, row: 3)
    seq = llm.add_request(PROMPTS[0], params)
    full[seq.seq_id] = full.pop("prompts")[0]
    llm.run_until_done()
    assert seq.token_ids == want.token_ids
    got = [lp for lp, _ in seq.output_logprobs]
    ref = [lp for lp, _ in want.output_logprobs]
    assert len(got) == 12 and np.allclose(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"speculative_config": {"method": "mtp"}}, "accepted: dspark"),
        ({"speculative_config": {"method": "dspark", "num_speculative_tokens": 4}}, "accepted: 5"),
        ({"speculative_config": "dspark"}, "a dict"),
        ({"speculative_config": {"method": "dspark", "draft": 1}}, "accepted keys"),
        ({"speculative_config": DSPARK, "kv_cache_dtype": "fp4"}, "packed"),
        ({"speculative_config": DSPARK, "max_model_len": 4094}, "max_position_embeddings - 5"),
        (
            {"speculative_config": DSPARK, "enforce_eager": False, "cudagraph_mode": "PIECEWISE"},
            "accepted with speculative_config: FULL, NONE",
        ),
        ({"speculative_config": DSPARK, "resident_weights": True}, "dequantised"),
    ],
)
def test_options_refused_before_load(options, needle):
    def never(*args):
        raise AssertionError("loaded")

    with pytest.raises(ConfigError, match=needle):
        LLM(SPEC, runner_factory=never, world_size=1, **options)


class _Recorded:
    """A "graph" that keeps the captured call and, on replay, re-runs it and refreshes every
    tensor of the captured output in place (what a CUDA replay does to its output)."""

    fn = out = None

    def replay(self):
        _refresh(self.out, self.fn())


def _refresh(old, new):
    if isinstance(old, torch.Tensor):
        old.copy_(new)
    elif old is not None:
        for f in dataclasses.fields(old):
            _refresh(getattr(old, f.name), getattr(new, f.name))


class _RecordingAPI:
    """``CudaGraphAPI`` on the CPU: a capture records the callable (FULL runs exactly what a
    CUDA capture would record: ``RuntimeModel.run`` on the bucket's prepared inputs)."""

    def new_graph(self):
        return _Recorded()

    def pool(self):
        return None

    def capture(self, graph, pool, fn):
        graph.fn, graph.out = fn, fn()
        return graph.out

    def guard(self, what, pool, record, refuse_outside=True):
        record.append({"what": what, "new_segments": 0, "pool_ids_reported": True,
                       "outside_pool": []})  # fmt: skip
        return contextlib.nullcontext()

    def synchronize(self):
        pass


def test_full_graph_verify_steps_give_the_plain_tokens(plain_tokens):
    """FULL graphs of the verify step (buckets ``(bs, 6)``, captured from ``run`` with its
    draft, acceptance and commit): every decode step a replay, the oracle's every accepted
    length, the plain tokens; the capture leaves the pools as they were."""
    from v41plan.runtime.graphs import FULL_SAMPLER, GREEDY, CudaGraphs

    llm = _llm(speculative_config=DSPARK)
    runner = llm.runner
    graphs = CudaGraphs(runner.model, llm.spec, [(1, 6), (2, 6), (4, 6)], "FULL",
                        api=_RecordingAPI(), samplings=(GREEDY, FULL_SAMPLER))  # fmt: skip
    before = runner.model.pools.backing.clone()
    graphs.capture()
    assert torch.equal(runner.model.pools.backing, before)
    assert graphs.report["pages_untouched"] and graphs.report["slots_untouched"]
    runner.graphs = graphs
    full = {"prompts": [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]}
    _oracle(llm, full, wrong_at=lambda step, row: (2 * step + row) % 6)
    assert _run(llm, full) == plain_tokens
    assert graphs.stats["graph_steps"] >= 5 and graphs.stats["eager_decode_steps"] == 0
    assert all(h > 0 for h in llm.speculative_stats()["accepted_length_histogram"])


def test_a_spec_without_a_draft_is_refused():
    with pytest.raises(ConfigError, match="declares no DSpark draft"):
        LLM("tiny40", runner_factory=lambda *a: None, world_size=1, speculative_config=DSPARK)


def test_server_metrics_name_the_acceptance_counters():
    from v41plan.serving.metrics import ServerMetrics

    snap = {
        "step_counters": {
            "spec_verify_rows": 4,
            "spec_drafted": 20,
            "spec_accepted": 7,
            "spec_accepted_len_0": 1,
            "spec_accepted_len_2": 3,
            "forwards": 9,
        }
    }
    text = ServerMetrics(lambda: snap, "m").render().decode()
    assert 'v41plan:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'v41plan:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'v41plan:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'v41plan:spec_decode_accepted_length_total{accepted_len="2",model_name="m"} 3.0' in text
    assert 'v41plan:runner_forwards_total{model_name="m"} 9.0' in text
    assert "runner_spec_" not in text


@pytest.mark.slow
def test_validate_runtime_speculative_matches_plain(tmp_path):
    """``validate_runtime --speculative`` (replay transfer) over the scenarios where the
    scheduler moves a speculating request (a prefix fork, a preemption mid-prefill, decode rows
    beside a prefill): each passes, and its tokens equal the same scenario run without
    speculation. About 18 s of CPU; both transfers over every scenario are the README's command
    (``reports/cpu/validate_runtime_speculative.json``), and the copy transfer's images after a
    verify step are ``test_an_image_stored_after_a_verify_step_resumes_exactly``."""
    import json

    from v41plan.validation import validate_runtime

    out = tmp_path / "report.json"
    cases = "prefix_fork,preempt_resume,mixed_decode_and_prefill"
    rc = validate_runtime.main(
        ["--spec", SPEC, "--speculative", "--transfer", "replay", "--cases", cases,
         "--output", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"] and report["speculative"]
    for transfer in ("replay",):
        got = report["transfers"][transfer]["cases"]
        assert all(c["passed"] for c in got.values()), got
        match = got["speculative_matches_plain"]
        assert match["differ"] == [] and match["cases"] == len(cases.split(","))
        assert match["drafted"] > 0
        stats = report["transfers"][transfer]["runner_stats"]
        assert stats["spec_verify_rows"] > 0


def test_an_image_stored_after_a_verify_step_resumes_exactly(plain_tokens):
    """Copy transfer: a verify step whose accepted tokens end on the hash-block grid (32) has
    the slot's image stored there, holding the accepted state; a request whose prompt is that
    prefix plus one token restores it and continues with the plain engine's tokens."""
    opts = {"encoder_swa_bounded_replay": False, "speculative_config": DSPARK}
    llm = _llm(**opts)
    prompt = PROMPTS[0]  # 20 tokens: the prefill's token, then whole blocks end at 26 and 32
    full = {"prompts": [prompt + plain_tokens[0]]}
    _oracle(llm, full)
    seq = llm.add_request(prompt, SamplingParams(max_tokens=19, ignore_eos=True))
    full[seq.seq_id] = full.pop("prompts")[0]
    llm.run_until_done()
    assert seq.token_ids[20:] == plain_tokens[0][:19]
    assert len(llm.block_manager.images) >= 1  # the image at 32, stored after a verify step
    resumed = llm.add_request(seq.token_ids[:33], SamplingParams(max_tokens=6, ignore_eos=True))
    full[resumed.seq_id] = full[seq.seq_id]
    llm.run_until_done()
    assert resumed.hits == [32] and resumed.restores == 1
    cold = _llm(encoder_swa_bounded_replay=False).generate(
        [seq.token_ids[:33]], SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert resumed.token_ids[33:] == cold[0].outputs[0].token_ids
