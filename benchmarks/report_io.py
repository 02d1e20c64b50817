"""Where a benchmark's JSON report goes: ``--out``, else ``$OUT/<name>`` when ``$OUT`` is set
(the GPU script's output folder), else nowhere."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _versions(report: dict) -> None:
    """Fill in ``torch``, ``triton`` and ``commit`` (from the recorded provenance) where a
    benchmark did not record them."""
    import torch

    report.setdefault("torch", torch.__version__)
    try:
        import triton

        report.setdefault("triton", triton.__version__)
    except ImportError:
        report.setdefault("triton", None)
    prov = report.get("provenance")
    if isinstance(prov, dict) and "commit" in prov:
        report.setdefault("commit", prov["commit"])


def write_report(report: dict, out: str | None, name: str) -> str | None:
    """Write ``report`` to ``out`` (or ``$OUT/name``), with the torch and triton versions and the
    commit filled in where missing; returns the path written, or None."""
    path = out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        _versions(report)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return path
