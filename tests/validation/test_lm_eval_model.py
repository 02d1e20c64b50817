"""The lm-eval model: its scores against the dense reference, greedy flags, stop strings, the
rolling windows, the shipped task files and an lm-eval run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import model
from v41plan.model.reference import ReferenceModel
from v41plan.validation.lm_eval_model import TASKS_DIR, V41PlanLM, cut_at_until
from v41plan.validation.quality_tasks import write_tasks

ROOT = Path(__file__).resolve().parents[2]


@cache
def _lm() -> V41PlanLM:
    return V41PlanLM("tiny", dtype="float64", max_num_batched_tokens=64)


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """Dense-reference log-softmax rows ``[n, V]`` of ``ids`` (the engine's random weights)."""
    _spec, cfg, w, eng = model("tiny")
    ref = ReferenceModel(cfg, w, eng, torch.float64, index_cache_dtype="fp8")
    return torch.log_softmax(ref.prefill(np.asarray(ids)).double(), dim=-1)


def test_loglikelihood_equals_the_dense_reference_in_float64():
    """Summed continuation log-probabilities through the engine (chunked at 64 tokens, so a
    long context spans several forwards) equal the dense reference's log-softmax sums."""
    lm = _lm()
    pairs = [("The sky is", " blue"), ("Water boils at", " one hundred degrees"),
             ("x" * 150 + " and then", " the end")]  # fmt: skip
    got = lm.loglikelihood(pairs)
    for (ctx, cont), (lp, greedy) in zip(pairs, got, strict=True):
        c_ids, k_ids = lm._encode_pair(ctx, cont)
        ids = c_ids + k_ids
        ref = _reference_logprobs(ids)
        want = sum(float(ref[i - 1, ids[i]]) for i in range(len(c_ids), len(ids)))
        assert abs(lp - want) <= 1e-9 * abs(want), (ctx, lp, want)
        want_greedy = all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(c_ids), len(ids)))
        assert greedy == want_greedy


def test_is_greedy_exactly_when_every_continuation_token_is_the_argmax():
    lm = _lm()
    ctx = lm.llm.encode("Facts about clouds:")
    cont = []
    for _ in range(4):  # the reference's greedy continuation, token by token
        cont.append(int(_reference_logprobs(ctx + cont)[-1].argmax()))
    flipped = cont[:2] + [(cont[2] + 1) % 256] + cont[3:]
    (lp_g, greedy), (lp_f, not_greedy) = lm.score_tokens([(ctx, cont), (ctx, flipped)])
    assert greedy and not not_greedy and lp_g > lp_f


def test_generate_until_stops_at_an_until_string_and_excludes_it():
    lm = _lm()
    ctx = "Once upon a time"
    full = lm.generate_until([(ctx, {"max_gen_toks": 12})])[0]
    assert full  # random weights still generate
    stop = full[len(full) // 2]
    at = full.index(stop)
    got = lm.generate_until([(ctx, {"until": [stop], "max_gen_toks": 12})])[0]
    assert got == full[:at] and stop not in got
    assert cut_at_until("abcXdefY", ["Y", "X"]) == "abc" and cut_at_until("abc", ["Z"]) == "abc"


def test_rolling_windows_predict_every_token_once_within_max_length():
    lm = _lm()
    ids = list(range(10, 10 + 2 * lm.max_length + 5))
    windows = list(lm._rolling_windows(ids))
    predicted = [t for _ctx, pred in windows for t in pred]
    assert predicted == ids
    assert all(len(ctx) + len(pred) <= lm.max_length for ctx, pred in windows)
    assert windows[0][0] == [lm.eot_token_id]
    for ctx, pred in windows[1:]:  # each window's context is the text right before it
        start = ids.index(pred[0])
        assert ctx == ids[start - len(ctx) : start]


def test_the_shipped_task_files_are_what_the_generator_writes(tmp_path):
    """The tasks in the repository regenerate byte for byte (seeded, held out)."""
    for f in write_tasks(tmp_path, 100):
        assert f.read_bytes() == (TASKS_DIR / f.name).read_bytes(), f.name
    docs = [json.loads(x) for x in (TASKS_DIR / "kv_recall_mc.jsonl").read_text().splitlines()]
    assert all(len(d["context"]) > 3 * 128 for d in docs)  # past the window
    assert all(0 <= d["label"] < len(d["choices"]) == 4 for d in docs)


def test_lm_eval_runs_the_shipped_tasks_end_to_end(tmp_path):
    """``lm_eval`` (through ``python -m v41plan.validation.lm_eval_model``) on a generation task
    and the multiple-choice recall task, ``--limit 5``, offline (about 40 s on two cores)."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install '.[eval]')")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "v41plan.validation.lm_eval_model", "--model", "v41plan",
           "--model_args", "spec=tiny", "--tasks", "v41plan_arith_gen,v41plan_kv_recall_mc",
           "--limit", "5", "--output_path", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = list(tmp_path.rglob("results_*.json"))
    assert results, proc.stdout[-2000:]
    res = json.loads(results[0].read_text())["results"]
    assert 0.0 <= res["v41plan_kv_recall_mc"]["acc,none"] <= 1.0
    assert 0.0 <= res["v41plan_arith_gen"]["exact_match,none"] <= 1.0


def test_lm_eval_under_torchrun_tp2_scores_as_one_process_and_reports_once(tmp_path):
    """``torchrun`` with two ranks (gloo, tensor parallel 2, float64): every rank runs every
    request in lockstep, one process writes the results, and the log-likelihoods it logged
    equal one process's (about 50 s on two cores, 67 s beside another test worker)."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install '.[eval]')")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = ["torchrun", "--standalone", "--nproc_per_node=2", "-m",
           "v41plan.validation.lm_eval_model", "--model", "v41plan",
           "--model_args", "spec=tiny,tensor_parallel_size=2,dtype=float64",
           "--tasks", "v41plan_kv_recall_mc", "--limit", "2", "--log_samples",
           "--output_path", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(list(tmp_path.rglob("results_*.json"))) == 1  # rank 0 alone reports
    (samples,) = tmp_path.rglob("samples_*.jsonl")
    pairs, logged = [], []
    for line in samples.read_text().splitlines():
        d = json.loads(line)
        for k in sorted(d["arguments"]):
            pairs.append((d["arguments"][k]["arg_0"], d["arguments"][k]["arg_1"]))
        logged += [float(r[0][0]) for r in d["resps"]]
    assert len(pairs) == 8
    one = _lm().loglikelihood(pairs)
    for (lp, _greedy), want in zip(one, logged, strict=True):
        assert abs(lp - want) <= 1e-9 * abs(want), (lp, want)
