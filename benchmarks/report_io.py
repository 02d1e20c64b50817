"""Where a benchmark's JSON report goes: ``--out``, else ``$OUT/<name>`` when ``$OUT`` is set
(the GPU script's output folder), else nowhere."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_report(report: dict, out: str | None, name: str) -> str | None:
    """Write ``report`` to ``out`` (or ``$OUT/name``); returns the path written, or None."""
    path = out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return path
