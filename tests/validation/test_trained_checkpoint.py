"""The committed trained checkpoint (``checkpoints/quality40``): it loads through the engine
and is held to what it has learned (``checkpoints/quality40/README.md``): sums, as the
``arith_gen`` task asks them, and copying a code that lies inside the attention window. It
has not learned to reach past the window (the shipped copy and recall tasks): its answers
there score like a uniform guess over the answer's alphabet, which is the bar those tests
hold it to, not the tasks' chance level."""

from __future__ import annotations

import math
import random
from functools import cache
from pathlib import Path

import pytest

from v41plan.validation.lm_eval_model import V41PlanLM
from v41plan.validation.quality_tasks import GENERATION, copy_doc, documents

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
    """Held-out arithmetic answers: measured -0.0002 nats a token (trained) against -7.13 (the
    spec's random weights); the test asks for 5 nats a token."""
    trained = _answer_logprob_per_token(_lm(True), "arith_gen", 6)
    random_weights = _answer_logprob_per_token(_lm(False), "arith_gen", 6)
    assert trained > random_weights + 5.0, (trained, random_weights)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_answers_the_copy_task_in_its_alphabet():
    """The shipped copy task (the code about 440 rows behind its repeat): 24 capital letters.
    The trained model's per-letter log-probability is that of a uniform guess over them
    (measured -3.18 against log(1/24) = -3.18): the format is learned, the lookup past the
    window is not. The test asks for at least log(1/24) - 0.5."""
    trained = _answer_logprob_per_token(_lm(True), "copy_gen", 2)
    assert trained > math.log(1 / 24) - 0.5, trained


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_generates_the_held_out_sums_exactly():
    """``arith_gen`` as lm-eval runs it (greedy ``generate_until``, its until strings and
    ``max_gen_toks``) on 10 held-out sums: measured 20 of 20 (the quality table's default row,
    ``--limit 20``); random weights get none. The test asks for 7."""
    until, max_gen_toks = GENERATION["arith_gen"]
    docs = documents("arith_gen", 10)
    requests = [(d["prompt"], {"until": until, "max_gen_toks": max_gen_toks}) for d in docs]
    texts = _lm(True).generate_until(requests)
    right = sum(t == d["answer"] for t, d in zip(texts, docs, strict=True))
    assert right >= 7, list(zip(texts, [d["answer"] for d in docs], strict=True))


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_copies_a_code_inside_the_window():
    """A copy document whose code sits inside the 32-row window of its repeat (filler of at
    most 4 characters): every letter the greedy choice on 8 documents (measured 20 of 20 and
    -0.002 nats a letter). Past the window (filler of 8 characters or more) it is a uniform
    guess (-3.18), which ``checkpoints/quality40/README.md`` reports."""
    rng = random.Random("in-window copies")
    docs = [copy_doc(rng, rng.randint(0, 4)) for _ in range(8)]
    scores = _lm(True).loglikelihood([(d["prompt"], d["answer"]) for d in docs])
    assert sum(greedy for _, greedy in scores) >= 6, scores
    assert sum(ll for ll, _ in scores) / (8 * len(docs)) > -0.5, scores
