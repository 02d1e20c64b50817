"""The committed trained checkpoint (``checkpoints/quality40``): it loads through the engine
and is held to what it has learned (``checkpoints/quality40/README.md``): sums, as the
``arith_gen`` task asks them, and copying a code from past the 32-row window, up to the
shipped copy task's 446 rows, through the compressed rows and the index top-k: 7 of the
code's 8 places, every one but the 2nd. It has not learned recall."""

from __future__ import annotations

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
    """Held-out arithmetic answers: measured -0.0001 nats a token (trained) against -7.13 (the
    spec's random weights); the test asks for 5 nats a token."""
    trained = _answer_logprob_per_token(_lm(True), "arith_gen", 6)
    random_weights = _answer_logprob_per_token(_lm(False), "arith_gen", 6)
    assert trained > random_weights + 5.0, (trained, random_weights)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_generates_most_of_the_shipped_copy_task_code():
    """The shipped copy task (the code 446 rows behind its repeat) as lm-eval runs it, greedy
    ``generate_until`` on 4 held-out documents: the answers are 8 capital letters, and 6.75 of
    the code's 8 places are right on average (every place but the 2nd, and on one document
    the 8th too: generated, the letters after a wrong 2nd follow the model's own guess),
    where a uniform guess gets a third of a place. The test asks for 5 places. Exact match
    needs the 2nd too, so ``copy_gen`` scores about the share of documents whose 2nd letter
    is guessed."""
    until, max_gen_toks = GENERATION["copy_gen"]
    docs = documents("copy_gen", 4)
    requests = [(d["prompt"], {"until": until, "max_gen_toks": max_gen_toks}) for d in docs]
    texts = _lm(True).generate_until(requests)
    assert all(len(t) == 8 and t.isalpha() and t.isupper() for t in texts), texts
    places = sum(a == b for t, d in zip(texts, docs, strict=True) for a, b in zip(t, d["answer"]))
    assert places / len(docs) >= 5.0, list(zip(texts, [d["answer"] for d in docs], strict=True))


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_generates_the_held_out_sums_exactly():
    """``arith_gen`` as lm-eval runs it (greedy ``generate_until``, its until strings and
    ``max_gen_toks``) on 10 held-out sums: measured 19 of 20 (the quality table's default row,
    ``--limit 20``); random weights get none. The test asks for 7."""
    until, max_gen_toks = GENERATION["arith_gen"]
    docs = documents("arith_gen", 10)
    requests = [(d["prompt"], {"until": until, "max_gen_toks": max_gen_toks}) for d in docs]
    texts = _lm(True).generate_until(requests)
    right = sum(t == d["answer"] for t, d in zip(texts, docs, strict=True))
    assert right >= 7, list(zip(texts, [d["answer"] for d in docs], strict=True))


def _copy_places_greedy(lm: V41PlanLM, docs: list[dict]) -> tuple[float, float]:
    """Letter by letter (the code's earlier letters given): the log-likelihood a letter and
    the mean number of the code's 8 places whose letter is the greedy choice."""
    n = len(docs[0]["answer"])
    reqs = [(d["prompt"] + d["answer"][:j], d["answer"][j]) for d in docs for j in range(n)]
    scores = lm.loglikelihood(reqs)
    return sum(ll for ll, _ in scores) / len(scores), sum(g for _, g in scores) / len(docs)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_copies_a_code_inside_the_window_and_just_past_it():
    """Copies whose code lies 26 to 58 rows behind its repeat (filler of 0 to 32 characters;
    the window is 32 rows, so most of them are past it and only the compressed rows and the
    index top-k reach the code): measured -0.33 nats a letter and 7.17 of the 8 places greedy
    (inside the window all 8; past it every place but the 2nd). A uniform guess is -3.18 a
    letter and a third of a place. The test asks for -1.0 and 6 places."""
    rng = random.Random("copies within 58 rows")
    docs = [copy_doc(rng, rng.randint(0, 32)) for _ in range(6)]
    ll, places = _copy_places_greedy(_lm(True), docs)
    assert ll > -1.0 and places >= 6.0, (ll, places)


@pytest.mark.skipif(not CKPT.is_dir(), reason="checkpoints/quality40 is not in this checkout")
def test_trained_checkpoint_copies_most_of_a_code_from_four_windows_back():
    """Copies whose code lies 90 to 146 rows behind its repeat (filler of 64 to 120
    characters), letter by letter: measured -0.40 nats a letter and 7 of the 8 places greedy
    (the 2nd is missed), against -3.18 and a third of a place for a uniform guess and -7.4 a
    letter for random weights. The test asks for -1.0 and 6 places."""
    rng = random.Random("copies from 90 to 146 rows back")
    docs = [copy_doc(rng, rng.randint(64, 120)) for _ in range(4)]
    ll, places = _copy_places_greedy(_lm(True), docs)
    assert ll > -1.0 and places >= 6.0, (ll, places)
