"""Provenance: the tree hash of the source files, and the checker that maps it to a commit."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest

from v41plan.validation import provenance as pv

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(root, *args) -> str:
    import os

    env = dict(os.environ, **GIT_ENV)
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    files = {
        "pyproject.toml": "[project]\n",
        "README.md": "not hashed\n",
        "v41plan/__init__.py": "",
        "v41plan/model/quant.py": "X = 1\n",
        "specs/tiny.yaml": "name: tiny\n",
        "tests/test_a.py": "def test_a():\n    pass\n",
        "scripts/run.sh": "echo hi\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "one")
    return root


def test_the_hash_is_the_documented_digest_of_the_hashed_files(repo):
    (repo / "v41plan/__pycache__").mkdir()
    (repo / "v41plan/__pycache__/quant.cpython-311.pyc").write_bytes(b"\0junk")
    (repo / "notes.txt").write_text("outside the hashed folders")
    want_files = [
        "pyproject.toml",
        "scripts/run.sh",
        "specs/tiny.yaml",
        "tests/test_a.py",
        "v41plan/__init__.py",
        "v41plan/model/quant.py",
    ]
    assert pv.hashed_files(repo) == want_files
    lines = "".join(
        f"{p}\0{hashlib.sha256((repo / p).read_bytes()).hexdigest()}\n" for p in want_files
    )
    assert pv.tree_sha256(repo) == hashlib.sha256(lines.encode()).hexdigest()
    # what git holds for the commit hashes alike, from its objects alone
    assert pv.commit_tree_sha256(repo, "HEAD") == pv.tree_sha256(repo)
    before = pv.tree_sha256(repo)
    (repo / "README.md").write_text("changed, still not hashed\n")
    assert pv.tree_sha256(repo) == before
    (repo / "specs/tiny.yaml").write_text("name: tiny2\n")
    assert pv.tree_sha256(repo) != before


def test_provenance_reports_git_where_it_answers_and_the_hash_without_it(repo, tmp_path):
    head = _git(repo, "rev-parse", "HEAD")
    p = pv.provenance(repo)
    assert p["commit"] == head and p["dirty"] is False and p["files"] == 6
    (repo / "v41plan/new.py").write_text("Y = 2\n")  # untracked, hashed: dirty
    assert pv.provenance(repo)["dirty"] is True
    (repo / "v41plan/new.py").unlink()
    copy = tmp_path / "device"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    q = pv.provenance(copy)  # a copy of the tree without its repository
    assert q["commit"] is None and q["dirty"] is None
    assert q["tree_sha256"] == p["tree_sha256"]


def test_a_named_commit_is_recorded_and_checked_against_the_tree(repo, tmp_path, monkeypatch):
    """``V41PLAN_COMMIT`` names the commit a copy runs (its ``.git`` may be stale); the checker
    still maps the tree hash to a commit and says nothing of staleness when the two agree."""
    head = _git(repo, "rev-parse", "HEAD")
    copy = tmp_path / "device"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setenv("V41PLAN_COMMIT", head[:7])
    rec = pv.provenance(copy)
    assert rec["commit"] == head[:7] and rec["commit_from"] == "V41PLAN_COMMIT"
    assert rec["dirty"] is None
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"provenance": rec}))
    ok, msg = pv.check(report, repo)
    assert ok and head in msg and "stale" not in msg
    monkeypatch.setenv("V41PLAN_COMMIT", "0" * 40)  # a wrong name is called out, not trusted
    report.write_text(json.dumps({"provenance": pv.provenance(copy)}))
    ok, msg = pv.check(report, repo)
    assert ok and head in msg and "stale" in msg


def test_the_checker_finds_the_commit_that_ran_and_fails_otherwise(repo, tmp_path, capsys):
    first = _git(repo, "rev-parse", "HEAD")
    copy = tmp_path / "device"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"rows": [], "provenance": pv.provenance(copy)}))
    (repo / "v41plan/model/quant.py").write_text("X = 2\n")
    _git(repo, "commit", "-qam", "two")
    ok, msg = pv.check(report, repo)
    assert ok and first in msg
    # a log line carries it too; a stale commit recorded where it ran is named, not trusted
    rec = dict(pv.provenance(copy), commit=_git(repo, "rev-parse", "HEAD"))
    log = tmp_path / "run.log"
    log.write_text("== tests\n" + pv.LOG_PREFIX + json.dumps(rec) + "\nmore output\n")
    ok, msg = pv.check(log, repo)
    assert ok and first in msg and "stale" in msg
    assert pv.main(["--check", str(report), str(log), "--root", str(repo)]) == 0
    # a tree no commit has (edited after the last commit) fails
    (copy / "specs/tiny.yaml").write_text("name: edited\n")
    report.write_text(json.dumps({"provenance": pv.provenance(copy)}))
    ok, msg = pv.check(report, repo)
    assert not ok and "is no commit" in msg
    assert pv.main(["--check", str(report), "--root", str(repo)]) == 1
    report.write_text(json.dumps({"rows": []}))
    assert pv.main(["--check", str(report), "--root", str(repo)]) == 1
    assert "no provenance recorded" in capsys.readouterr().out


def test_this_checkout_hashes_what_git_tracks():
    """The hashed set of this checkout is the tracked set where nothing is untracked: the rule
    matches the repository's ignore patterns."""
    try:
        tracked = _git(pv.ROOT, "ls-files").splitlines()
        untracked = _git(pv.ROOT, "ls-files", "--others", "--exclude-standard").splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("this checkout has no usable git")
    on_disk = set(pv.hashed_files(pv.ROOT))
    assert {p for p in tracked if pv.is_hashed(p)} | {
        p for p in untracked if pv.is_hashed(p)
    } == on_disk
