"""``compile --check``: compare rendered files with a generated root without writing.

Reports every missing, stale and extra file; a stale file comes with a unified diff from what
is on disk to what the compiler renders now.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from v41plan.codegen.emit import GeneratedFile, existing_files


@dataclass(frozen=True)
class Problem:
    """One file that differs from what the compiler renders."""

    kind: str
    """``missing``, ``stale`` or ``extra``."""
    relpath: str
    """Path relative to the generated root."""
    diff: str
    """Unified diff (stale files) or an empty string."""


def check_tree(root: Path, files: list[GeneratedFile], packages: list[str]) -> list[Problem]:
    """Problems of ``root`` against the rendered ``files``, sorted by path; packages named in
    ``packages`` must hold exactly the rendered files."""
    problems = []
    expected = {f.relpath for f in files}
    for f in files:
        path = root / f.relpath
        if not path.is_file():
            problems.append(Problem("missing", f.relpath, ""))
            continue
        current = path.read_bytes().decode("utf-8", errors="replace")
        if current != f.content:
            diff = "".join(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    f.content.splitlines(keepends=True),
                    fromfile=f"a/{f.relpath}",
                    tofile=f"b/{f.relpath}",
                )
            )
            problems.append(Problem("stale", f.relpath, diff))
    for package in packages:
        for rel in existing_files(root, package):
            if rel not in expected:
                problems.append(Problem("extra", rel, ""))
    return sorted(problems, key=lambda p: (p.relpath, p.kind))
