"""The quality model (``checkpoints/quality40w``, spec quality40w): it loads through the engine
and is held, on each shipped task as lm-eval runs it, to what it has learned
(``checkpoints/quality40w/README.md``): recall of a value 290-410 rows back on the task's
48-pair lists, copying a code from 446 rows back, both past the 32-row window through the
compressed rows and the index top-k, and sums. Each threshold is stated beside the measured
figure and far below it."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from v41plan.validation.lm_eval_model import V41PlanLM
from v41plan.validation.quality_tasks import GENERATION, copy_doc, documents

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "quality40w"
SPEC = "quality40w"
SKIP = pytest.mark.skipif(
    not CKPT.is_dir(), reason="checkpoints/quality40w is not in this checkout"
)


@cache
def _lm(trained: bool) -> V41PlanLM:
    ck = str(CKPT) if trained else None
    return V41PlanLM(SPEC, ck, progress=False, device="cpu", max_num_seqs=16)


def _answer_logprob_per_token(lm: V41PlanLM, name: str, n: int) -> float:
    docs = documents(name, n)
    if name == "kv_recall_mc":
        pairs = [(d["context"], d["choices"][d["label"]]) for d in docs]
    else:
        pairs = [(d["prompt"], d["answer"]) for d in docs]
    scores = lm.loglikelihood(pairs)
    return sum(ll for ll, _ in scores) / sum(len(a) for _, a in pairs)


@SKIP
def test_trained_checkpoint_scores_held_out_answers_far_above_random_weights():
    """Held-out arithmetic answers: measured -0.26 nats a token (trained) against -6.48 (the
    spec's random weights); the test asks for 4 nats a token."""
    trained = _answer_logprob_per_token(_lm(True), "arith_gen", 6)
    random_weights = _answer_logprob_per_token(_lm(False), "arith_gen", 6)
    assert trained > random_weights + 4.0, (trained, random_weights)


@SKIP
def test_trained_checkpoint_recalls_values_from_past_the_window_above_chance():
    """``kv_recall_mc`` as lm-eval scores it (the choice of largest log-likelihood), on the
    first 12 held-out 48-pair lists, the value 290-410 rows back: measured 7 of 12 (the
    quality table's 20 documents: 11, 0.55), where guessing among four choices expects 3. The
    test asks for 6, which guessing reaches with probability 0.054; 12 lists are what the
    suite's time affords (about a minute), so this threshold is near the measured figure,
    not far below it, and the table's 20 documents carry the significance (p = 0.004)."""
    docs = documents("kv_recall_mc", 12)
    reqs = [(d["context"], c) for d in docs for c in d["choices"]]
    lls = [ll for ll, _ in _lm(True).loglikelihood(reqs)]
    picks = [max(range(4), key=lambda i, j=j: lls[4 * j + i]) for j in range(len(docs))]
    right = sum(p == d["label"] for p, d in zip(picks, docs, strict=True))
    assert right >= 6, (right, picks, [d["label"] for d in docs])


@SKIP
def test_trained_checkpoint_generates_the_shipped_copy_task_code_exactly():
    """The shipped copy task (the code 446 rows behind its repeat) as lm-eval runs it, greedy
    ``generate_until`` on 8 held-out documents: measured 8 of 8 exact (the quality table's 20
    documents: 19), where a uniform guess of 8 letters of 24 is right once in 1.1e11. The
    test asks for 5."""
    until, max_gen_toks = GENERATION["copy_gen"]
    docs = documents("copy_gen", 8)
    requests = [(d["prompt"], {"until": until, "max_gen_toks": max_gen_toks}) for d in docs]
    texts = _lm(True).generate_until(requests)
    right = sum(t == d["answer"] for t, d in zip(texts, docs, strict=True))
    assert right >= 5, list(zip(texts, [d["answer"] for d in docs], strict=True))


@SKIP
def test_trained_checkpoint_generates_the_held_out_sums_exactly():
    """``arith_gen`` as lm-eval runs it (greedy ``generate_until``, its until strings and
    ``max_gen_toks``) on the first 20 held-out sums: measured 13 of 20 (the misses are off
    by one to a hundred in one digit); random weights get none. The test asks for 6."""
    until, max_gen_toks = GENERATION["arith_gen"]
    docs = documents("arith_gen", 20)
    requests = [(d["prompt"], {"until": until, "max_gen_toks": max_gen_toks}) for d in docs]
    texts = _lm(True).generate_until(requests)
    right = sum(t == d["answer"] for t, d in zip(texts, docs, strict=True))
    assert right >= 6, list(zip(texts, [d["answer"] for d in docs], strict=True))


def _copy_places_greedy(lm: V41PlanLM, docs: list[dict]) -> tuple[float, float]:
    """Letter by letter (the code's earlier letters given): the log-likelihood a letter and
    the mean number of the code's 8 places whose letter is the greedy choice."""
    n = len(docs[0]["answer"])
    reqs = [(d["prompt"] + d["answer"][:j], d["answer"][j]) for d in docs for j in range(n)]
    scores = lm.loglikelihood(reqs)
    return sum(ll for ll, _ in scores) / len(scores), sum(g for _, g in scores) / len(docs)


@SKIP
def test_trained_checkpoint_copies_a_code_inside_the_window_and_just_past_it():
    """Copies whose code lies 26 to 58 rows behind its repeat (filler of 0 to 32 characters;
    the window is 32 rows, so most of them are past it and only the compressed rows and the
    index top-k reach the code), letter by letter: measured -0.0004 nats a letter and all 8
    places greedy on every document. A uniform guess is -3.18 a letter and a third of a
    place. The test asks for -0.5 and 7 places."""
    rng = random.Random("copies within 58 rows")
    docs = [copy_doc(rng, rng.randint(0, 32)) for _ in range(6)]
    ll, places = _copy_places_greedy(_lm(True), docs)
    assert ll > -0.5 and places >= 7.0, (ll, places)
