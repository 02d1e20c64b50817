"""The committed trained checkpoint (``checkpoints/quality40``): it loads through the engine
and has learned the tasks' formats. It has not learned their content yet (``checkpoints/
quality40/README.md``): its answers score like a uniform guess over the answer's alphabet, so
this is the bar it is held to, not the tasks' chance level."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest

from v41plan.validation.lm_eval_model import V41PlanLM
from v41plan.validation.quality_tasks import documents

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "quality40"


@cache
def _lm(trained: bool) -> V41PlanLM:
    ck = str(CKPT) if trained else None
    return V41PlanLM("quality40", ck, progress=False, device="cpu", max_num_seqs=16)


def _answer_logprob_per_token(lm: V41PlanLM, name: str, n: int) -> float:
    docs = documents(name, n)
    if name == "kv_recall_mc":
        pairs = [(d["context"], d["choices"][d["label"]]) for d in docs]
    else:
        pairs = [(d["prompt"], d["answer"]) for d in docs]
    scores = lm.loglikelihood(pairs)
    return sum(ll for ll, _ in scores) / sum(len(a) for _, a in pairs)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_scores_held_out_answers_far_above_random_weights():
    """Held-out arithmetic answers: measured -3.7 nats a token (trained) against -7.4 (the
    spec's random weights); the test asks for 2 nats a token of the 3.7 gap. About 60 s."""
    trained = _answer_logprob_per_token(_lm(True), "arith_gen", 6)
    random_weights = _answer_logprob_per_token(_lm(False), "arith_gen", 6)
    assert trained > random_weights + 2.0, (trained, random_weights)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_answers_the_copy_task_in_its_alphabet():
    """The repeated code: 24 capital letters. The trained model's per-letter log-probability
    is that of a uniform guess over them (measured -3.16 against log(1/24) = -3.18): the
    format is learned, the lookup is not. The test asks for at least log(1/24) - 0.5."""
    trained = _answer_logprob_per_token(_lm(True), "copy_gen", 2)
    assert trained > math.log(1 / 24) - 0.5, trained
