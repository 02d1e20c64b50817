"""The quality table's scoring: the same numbers lm-eval gives over the shipped task files."""

from __future__ import annotations

import pytest

from v41plan.validation.lm_eval_model import TASKS_DIR, V41PlanLM
from v41plan.validation.quality_table import METRICS, TASKS, copy_places_docs, markdown, score_tasks


def test_direct_scores_equal_lm_evals_over_the_shipped_tasks(monkeypatch):
    """Two documents of each task through one engine: ``score_tasks`` and
    ``lm_eval.simple_evaluate`` agree on every metric (random tiny weights; about 30 s)."""
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    lm = V41PlanLM("tiny", progress=False, device="cpu", max_num_seqs=16)
    direct = score_tasks(lm, 2)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=list(TASKS), limit=2, task_manager=TaskManager(include_path=str(TASKS_DIR))
    )
    for task in TASKS:
        assert direct[task]["docs"] == 2
        assert direct[task]["value"] == pytest.approx(res["results"][task][f"{METRICS[task]},none"])


def test_markdown_lists_every_row_and_the_chance_line():
    row = {"row": "default", "scores": {t: {"value": 0.5, "stderr": 0.1} for t in TASKS}}
    text = markdown({"rows": [row], "chance": dict.fromkeys(TASKS, 0.0)})
    assert "| default | 0.500 ± 0.100 | 0.500 ± 0.100 | 0.500 ± 0.100 |" in text
    assert text.splitlines()[-1].startswith("| chance |")


def test_prefix_hit_generations_resume_from_the_cache_under_both_transfers():
    """``prefix_hit``: the scored generations hit the prefix cache and resume through the
    encoder replay (replayed rows) or the copy transfer (restored images); the copy transfer is
    exact, so its generations equal those of a run without the hit."""
    from v41plan.validation.quality_tasks import documents

    docs = documents("copy_gen", 2)
    reqs = [(d["prompt"], {"until": ["\n"], "max_gen_toks": 6}) for d in docs]
    plain = V41PlanLM("tiny", progress=False, device="cpu", encoder_swa_bounded_replay=False)
    want = plain.generate_until(reqs)
    for replay in (True, False):
        lm = V41PlanLM(
            "tiny", progress=False, device="cpu", prefix_hit=True, encoder_swa_bounded_replay=replay
        )
        got = lm.generate_until(reqs)
        r = lm.resumed
        assert r["requests"] == 2 and r["hits"] > 0
        assert r["replay_rows"] > 0 if replay else r["restores"] > 0
        if not replay:
            assert got == want


def test_copy_places_scores_each_place_of_codes_past_the_window():
    """``copy_places``: documents whose code lies past the 32-row window (26 + filler rows
    back), generated with ``copy_gen``'s settings and scored place by place."""
    from v41plan.validation.quality_table import score_copy_places

    docs = copy_places_docs(12)
    assert docs == copy_places_docs(12)  # seeded
    for d in docs:
        p = d["prompt"]
        rows_back = len(p) - 1 - (p.index("code: ") + len("code: "))
        assert 34 <= rows_back <= 146 and len(d["answer"]) == 8

    class TwoPlacesWrong:
        def generate_until(self, requests):
            assert all(kw["until"] == ["\n"] and not kw["do_sample"] for _, kw in requests)
            return [("ab" + d["answer"][2:]) for d in docs[: len(requests)]]

    got = score_copy_places(TwoPlacesWrong(), 12)
    assert got["value"] == pytest.approx(0.75) and got["docs"] == 12 and got["stderr"] == 0.0


def test_a_row_scored_in_a_worker_process_equals_the_row_scored_in_this_one(tmp_path):
    """``--jobs 2`` scores each row in its own spawned process (spec tiny's random weights,
    one document a column): the same scores as the row scored in this process."""
    import json

    from v41plan.validation.quality_table import main

    reports = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}.json"
        args = ["--checkpoint", "unused", "--spec", "tiny", "--limit", "1"]
        assert (
            main([*args, "--rows", "random weights", "--jobs", str(jobs), "--out", str(out)]) == 0
        )
        reports[jobs] = json.loads(out.read_text())
    one, two = (reports[j]["rows"] for j in (1, 2))
    assert [r["row"] for r in two] == ["random weights"]
    assert one[0]["scores"] == two[0]["scores"]


def test_an_unknown_row_is_refused_with_the_row_names(capsys):
    from v41plan.validation.quality_table import main

    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", "unused", "--rows", "defualt"])
    assert exc.value.code == 2
    assert "unknown rows ['defualt']" in capsys.readouterr().err
