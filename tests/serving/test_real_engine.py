"""The engine on the real paged runtime model (tiny spec, seeded random checkpoint, CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.serving.helpers import ROOT, TINY, prompt
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

pytest.importorskip("v41plan.runtime.paged_model")

CUT_SPEC = str(ROOT / "tests" / "data" / "tiny7.yaml")
"""tiny cut to 7 layers, every role kept: validate_runtime runs on it in half tiny's time."""

P = TINY.replay.hash_block_tokens
OPTS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 8 * P,
    "max_model_len": 24 * P,
    "num_pages": 160,
    "dtype": "float64",
    "world_size": 1,
}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra threads only contend
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def runners():
    """One paged runner per transfer, shared by the engines of this module."""
    from v41plan.serving.runner import build_runner

    out = {}
    for enc in (True, False):
        probe = LLM(TINY, runner_factory=lambda *a: None, encoder_swa_bounded_replay=enc, **OPTS)
        out[enc] = build_runner(TINY, None, probe.options)
    return out


def engine(runner, **overrides):
    return LLM(TINY, runner_factory=lambda *a: runner, **{**OPTS, **overrides})


def test_validate_runtime_world_size_1(tmp_path):
    from v41plan.validation import validate_runtime

    out = tmp_path / "report.json"
    rc = validate_runtime.main(["--spec", CUT_SPEC, "--output", str(out)])
    report = json.loads(out.read_text())
    failed = {
        t: {k: c.get("error") for k, c in v["cases"].items() if not c["passed"]}
        for t, v in report["transfers"].items()
    }
    assert rc == 0 and report["passed"], failed
    from v41plan.validation.provenance import tree_sha256

    assert report["provenance"]["tree_sha256"] == tree_sha256()  # the tree that ran
    for transfer, v in report["transfers"].items():
        assert v["paged"] and v["runner"] == "PagedRunner"
        cases = v["cases"]
        assert len(cases) >= 12 and all(c["passed"] for c in cases.values())
        if transfer == "copy":
            assert (
                cases["prefix_fork"]["restores"] >= 1 and cases["preempt_resume"]["restores"] >= 1
            )
            assert cases["missing_image_replay"]["hits"] == [0]
        else:
            assert (
                cases["prefix_fork"]["replay_rows"] >= P
                and cases["preempt_resume"]["replay_rows"] >= P
            )
        assert cases["prefix_hit_short_suffix"]["replay_rows"] >= P
        assert cases["decoder_replay_long_prompt"]["runner"]["decoder_replay_steps"] >= 1


def test_skipped_restore_changes_tokens(runners):
    """The copy route's token equality depends on the restore: without it the tokens change."""
    from v41plan.serving.runner import PagedRunner

    runner = runners[False]
    chunked = {"encoder_swa_bounded_replay": False, "long_prefill_token_threshold": P}
    base = prompt(4 * P + 10, 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cold = engine(runner, **chunked).generate([base], params)[0].outputs[0].token_ids
    llm = engine(runner, **chunked)
    llm.generate([base], params)
    warm = llm.generate([base], params)[0]
    assert warm.stats["restores"] == 1 and warm.outputs[0].token_ids == cold

    class NoRestore:
        vocab_size = runner.vocab_size

        def execute(self, batch):
            for op in batch.restores:  # scribble over the slot instead of restoring it
                runner.model.pools.state[op.slot].fill_(7)
            return PagedRunner.execute(
                runner, type(batch)(batch.step, batch.phase, batch.requests, batch.stores, ())
            )

    llm = engine(runner, **chunked)
    llm.generate([base], params)
    llm.runner = NoRestore()
    broken = llm.generate([base], params)[0]
    assert broken.stats["restores"] == 1 and broken.outputs[0].token_ids != cold


def test_prompt_logprobs_match_dense_reference(runners):
    from v41plan.model.reference import ReferenceModel
    from v41plan.serving.runner import load_weights

    runner = runners[True]
    # prompt_logprobs needs every row: the decoder-replay-off runner is built here.
    from v41plan.serving.runner import build_runner

    probe = LLM(TINY, runner_factory=lambda *a: None, decoder_swa_bounded_replay=False, **OPTS)
    off = build_runner(TINY, None, probe.options)
    p = prompt(70, 5)
    out = engine(off, decoder_swa_bounded_replay=False, long_prefill_token_threshold=P).generate(
        [p], SamplingParams(max_tokens=1, prompt_logprobs=True)
    )[0]
    ref = ReferenceModel.from_checkpoint(
        load_weights(TINY, None, probe.options),
        torch.float64,
        index_cache_dtype=probe.options.index_cache_dtype,
    )
    lp = torch.log_softmax(ref.prefill(p).double(), -1)
    want = [float(lp[i, p[i + 1]]) for i in range(len(p) - 1)]
    assert out.prompt_logprobs[0] is None  # vLLM's shape: nothing precedes the first token
    assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-6)
    assert runner is not off


def test_prompt_logprobs_under_decoder_replay(runners):
    # A scoring request runs every row through every layer even when the engine replays the
    # decoder: its prompt log-probabilities equal the dense reference's, next to a replayed
    # request in the same batches.
    from v41plan.model.reference import ReferenceModel
    from v41plan.serving.runner import load_weights

    llm = engine(runners[True], long_prefill_token_threshold=P)
    assert llm.options.decoder_swa_bounded_replay
    p = prompt(70, 5)
    outs = llm.generate(
        [p, prompt(60, 2)],
        [SamplingParams(max_tokens=1, prompt_logprobs=True), SamplingParams(max_tokens=2)],
    )
    ref = ReferenceModel.from_checkpoint(
        load_weights(TINY, None, llm.options),
        torch.float64,
        index_cache_dtype=llm.options.index_cache_dtype,
    )
    lp = torch.log_softmax(ref.prefill(p).double(), -1)
    want = [float(lp[i, p[i + 1]]) for i in range(len(p) - 1)]
    assert outs[0].prompt_logprobs == pytest.approx([None, *want], abs=1e-6)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2


def test_bad_requests_fail_alone_on_real_engine(runners):
    llm = engine(runners[True])
    outs = llm.generate(
        [prompt(40), [5, 300], prompt(30, 1)],
        [SamplingParams(max_tokens=3), SamplingParams(), SamplingParams(top_p=0.0)],
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 3
    assert "300" in outs[1].error and "top_p" in outs[2].error


def test_seeded_sampling_independent_of_batch(runners):
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    alone = engine(runners[True]).generate([prompt(50)], sp)[0].outputs[0].token_ids
    mixed = engine(runners[True], long_prefill_token_threshold=16).generate(
        [prompt(45, 2), prompt(50)], sp
    )
    assert mixed[1].outputs[0].token_ids == alone


def test_cli_run_prints_text(capsys):
    from v41plan.cli.main import main

    rc = main(["run", "--prompt", "Hello", "--max-tokens", "4", "--json", "--dtype", "float32"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    rec = json.loads(line)
    assert (
        rc == 0 and rec["prompt"] == "Hello" and len(rec["token_ids"]) == 4 and rec["error"] is None
    )


def test_cli_run_refuses_before_load(capsys):
    from v41plan.cli.main import main

    with pytest.raises(SystemExit) as exc:  # an unknown format is refused by the parser
        main(["run", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-cache-dtype: invalid choice: 'fp8'" in err
    rc = main(["run", "--max-num-seqs", "0"])  # and a bad engine option by admission
    err = capsys.readouterr().err
    assert rc == 2 and err == (
        "v41plan run: --max-num-seqs: max_num_seqs=0 is refused: accepted: an integer >= 1\n"
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_validate_runtime_gloo_world_size_2(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "v41plan.validation.validate_runtime",
            "--spec",
            CUT_SPEC,
            "--output",
            str(out),
            "--transfer",
            "replay",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RUNTIME_ACCEPTANCE_PASSED" in proc.stdout
    report = json.loads(out.read_text())
    assert (
        report["world_size"] == 2
        and report["transfers"]["replay"]["cases"]["ranks_agree"]["passed"]
    )
    _ = sys  # the subprocess uses the same interpreter's torchrun
