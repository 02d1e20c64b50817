"""Which tree ran: a content hash of the source files, recorded by every report and log.

``tree_sha256(root)`` hashes the files a run depends on, as they are on disk where it runs: every
file under ``v41plan/``, ``specs/``, ``benchmarks/``, ``scripts/`` and ``tests/`` plus
``pyproject.toml``, except what ``is_hashed`` leaves out (caches and build outputs:
``__pycache__``, ``.pytest_cache``, ``.hypothesis``, ``*.egg-info``, ``*.pyc``). The digest is the
sha256 of the lines ``<path>\\0<sha256 of the file's bytes>\\n`` in path order (POSIX paths
relative to the root). It needs no git: a machine given a copy of the working tree computes it
from the files alone (its ``.git`` may be missing or stale), and ``commit``/``dirty`` are added
only when git answers there.

``python -m v41plan.validation.provenance --check FILE`` (a JSON report with a ``provenance``
object, or a log with a ``provenance: {...}`` line) looks for the commit whose tree has that hash
among the recent history of this checkout, computing each commit's hash from its git objects with
the same rule, and exits 1 when none has it. ``python -m v41plan.validation.provenance`` prints
this tree's provenance as one JSON line. No torch at import.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

HASHED_DIRS = ("v41plan", "specs", "benchmarks", "scripts", "tests")
"""Top-level folders whose files are hashed."""
HASHED_FILES = ("pyproject.toml",)
"""Top-level files that are hashed."""
_SKIP_PARTS = frozenset({"__pycache__", ".pytest_cache", ".hypothesis"})
ROOT = Path(__file__).resolve().parents[2]
LOG_PREFIX = "provenance: "
"""How a log line carrying the provenance starts (``scripts/gpu_validate.sh``)."""


def is_hashed(path: str) -> bool:
    """True when the POSIX relative ``path`` is one of the hashed source files."""
    parts = path.split("/")
    if len(parts) == 1:
        return path in HASHED_FILES
    if parts[0] not in HASHED_DIRS:
        return False
    if any(p in _SKIP_PARTS or p.endswith(".egg-info") for p in parts):
        return False
    return not path.endswith(".pyc")


def digest_lines(items: Iterable[tuple[str, str]]) -> str:
    """The tree digest of ``(path, file sha256 hex)`` pairs (any order)."""
    h = hashlib.sha256()
    for path, file_hash in sorted(items):
        h.update(f"{path}\0{file_hash}\n".encode())
    return h.hexdigest()


def hashed_files(root: str | Path = ROOT) -> list[str]:
    """The hashed files present under ``root`` (POSIX relative paths, sorted; symbolic links are
    neither followed nor hashed, as the commit check skips them)."""
    root = Path(root)
    out = [name for name in HASHED_FILES if (root / name).is_file()]
    for top in HASHED_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_PARTS]
            rel = Path(dirpath).relative_to(root).as_posix()
            out += [
                f"{rel}/{f}"
                for f in filenames
                if is_hashed(f"{rel}/{f}") and not Path(dirpath, f).is_symlink()
            ]
    return sorted(out)


def tree_sha256(root: str | Path = ROOT) -> str:
    """The content hash of the hashed files as they are on disk under ``root``."""
    root = Path(root)
    return digest_lines(
        (p, hashlib.sha256((root / p).read_bytes()).hexdigest()) for p in hashed_files(root)
    )


def _git(root: Path, *args: str, input: bytes | None = None) -> bytes | None:
    """Output of ``git -C root args``, or None when git is missing or fails."""
    try:
        r = subprocess.run(
            ["git", "-C", str(root), *args],
            input=input,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def provenance(root: str | Path = ROOT) -> dict:
    """What a report records: ``tree_sha256``, ``files``, and where git answers ``commit``
    (HEAD) and ``dirty`` (a hashed file differs from HEAD or is untracked); else both None.
    ``V41PLAN_COMMIT`` in the environment names the commit instead (``commit_from``; ``dirty``
    stays None): a copy of the tree on another machine may carry a stale ``.git``."""
    root = Path(root)
    files = hashed_files(root)
    out = {
        "tree_sha256": tree_sha256(root),
        "files": len(files),
        "commit": None,
        "dirty": None,
        "host": platform.node(),
        "time_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    named = os.environ.get("V41PLAN_COMMIT")
    head = _git(root, "rev-parse", "HEAD")
    if named:
        # the caller names the commit it sent (a device machine's copy can carry a stale .git);
        # ``--check`` still verifies it against the tree hash
        out["commit"], out["commit_from"] = named, "V41PLAN_COMMIT"
    elif head is not None:
        out["commit"] = head.decode().strip()
    if head is not None and not named:
        status = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *HASHED_DIRS)
        files_status = _git(root, "status", "--porcelain", "--", *HASHED_FILES)
        if status is not None and files_status is not None:
            lines = (status + files_status).decode().splitlines()
            out["dirty"] = any(is_hashed(line[3:].strip().strip('"')) for line in lines)
    return out


# --- the checker -------------------------------------------------------------------------------
class _Blobs:
    """sha256 of git blobs by object id, read once through ``git cat-file --batch``."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, str] = {}

    def sha256(self, oids: list[str]) -> None:
        todo = sorted({o for o in oids if o not in self.cache})
        if not todo:
            return
        raw = _git(self.root, "cat-file", "--batch", input=("\n".join(todo) + "\n").encode())
        if raw is None:
            raise RuntimeError("git cat-file failed")
        pos = 0
        for oid in todo:
            nl = raw.index(b"\n", pos)
            size = int(raw[pos:nl].split()[2])
            body = raw[nl + 1 : nl + 1 + size]
            self.cache[oid] = hashlib.sha256(body).hexdigest()
            pos = nl + 1 + size + 1


def commit_tree_sha256(root: str | Path, commit: str, blobs: _Blobs | None = None) -> str:
    """``tree_sha256`` of ``commit``'s files, from the git objects (no checkout)."""
    root = Path(root)
    blobs = blobs or _Blobs(root)
    raw = _git(root, "ls-tree", "-r", "-z", commit)
    if raw is None:
        raise RuntimeError(f"git ls-tree {commit} failed")
    entries = []
    for rec in raw.split(b"\0"):
        if not rec:
            continue
        meta, path = rec.split(b"\t", 1)
        mode, kind, oid = meta.decode().split()
        p = path.decode()
        if kind == "blob" and mode != "120000" and is_hashed(p):
            entries.append((p, oid))
    blobs.sha256([oid for _, oid in entries])
    return digest_lines((p, blobs.cache[oid]) for p, oid in entries)


def find_commit(root: str | Path, tree_hash: str, depth: int = 200) -> str | None:
    """The most recent of the last ``depth`` commits (all branches) whose tree hash is
    ``tree_hash``, or None."""
    root = Path(root)
    raw = _git(root, "rev-list", f"--max-count={depth}", "--all")
    if raw is None:
        raise RuntimeError(f"git is not usable in {root}")
    blobs = _Blobs(root)
    for commit in raw.decode().split():
        if commit_tree_sha256(root, commit, blobs) == tree_hash:
            return commit
    return None


def read_recorded(path: str | Path) -> dict:
    """The provenance a report (JSON ``provenance`` key) or a log (``provenance: {...}`` line)
    recorded; the last one of a log."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        if "provenance" not in data:
            raise ValueError(f"{path}: no provenance recorded")
        return data["provenance"]
    found = [line for line in text.splitlines() if line.startswith(LOG_PREFIX)]
    if not found:
        raise ValueError(f"{path}: no '{LOG_PREFIX}' line")
    return json.loads(found[-1][len(LOG_PREFIX) :])


def check(path: str | Path, root: str | Path = ROOT, depth: int = 200) -> tuple[bool, str]:
    """(ok, message): whether the tree hash ``path`` recorded is a commit of this history."""
    rec = read_recorded(path)
    want = rec.get("tree_sha256")
    if not want:
        return False, f"{path}: the provenance has no tree_sha256"
    commit = find_commit(root, want, depth)
    if commit is None:
        return False, (
            f"{path}: tree {want[:16]} is no commit among the last {depth} "
            f"(recorded commit {rec.get('commit')}, dirty {rec.get('dirty')})"
        )
    note = ""
    if rec.get("commit") and not commit.startswith(rec["commit"]):
        note = f"; it recorded commit {rec['commit'][:12]} (a stale .git where it ran)"
    return True, f"{path}: ran the tree of commit {commit}{note}"


def main(argv: list[str] | None = None) -> int:
    """Print this tree's provenance, or check the files given with ``--check``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs="+", metavar="FILE", help="reports or logs to verify")
    ap.add_argument("--depth", type=int, default=200, help="commits searched (default 200)")
    ap.add_argument("--root", default=str(ROOT), help="checkout root (default: this one)")
    args = ap.parse_args(argv)
    if not args.check:
        print(json.dumps(provenance(args.root)))
        return 0
    ok_all = True
    for path in args.check:
        try:
            ok, msg = check(path, args.root, args.depth)
        except (OSError, ValueError, RuntimeError) as exc:
            ok, msg = False, f"{path}: {exc}"
        print(("ok   " if ok else "FAIL ") + msg)
        ok_all &= ok
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
