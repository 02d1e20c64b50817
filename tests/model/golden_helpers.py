"""The golden tiny40 values (``../shared/golden/tiny40``, beside every checkout and in CI).

The folder holds a tiny40 checkpoint in the published layout and what an independent float64
implementation of the published forward computes on it (see its README). It is part of the
project's environment: a missing folder fails the tests that need it, with this message, rather
than skipping them.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT.parent / "shared" / "golden"
TINY40 = GOLDEN / "tiny40"
REL_TOL = 1e-12


def golden_dir() -> Path:
    """``../shared/golden/tiny40``, or a test failure naming what is missing."""
    need = [TINY40 / "golden.safetensors", TINY40 / "checkpoint" / "config.json"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        pytest.fail(
            f"golden values missing: {', '.join(missing)}. The folder {GOLDEN} (the shared "
            "golden values, beside every checkout) is part of the test environment.",
            pytrace=False,
        )
    return TINY40


@cache
def golden() -> dict[str, torch.Tensor]:
    """Every tensor of ``golden.safetensors`` (token ids, logits, top-k, experts, Engram ids)."""
    from safetensors.torch import load_file

    return load_file(str(golden_dir() / "golden.safetensors"))


@cache
def golden_checkpoint():
    """``(cache spec, LoadedCheckpoint)`` of the golden checkpoint, processed in float64."""
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.checkpoint import load_checkpoint

    spec = load_cache_spec("tiny40")
    ckpt = load_checkpoint(golden_dir() / "checkpoint", spec, dtype=torch.float64)
    return spec, ckpt


def golden_decisions(kind: str) -> dict[int, torch.Tensor]:
    """``topk`` (index sources) or ``experts`` (every layer): layer -> ``[160, k]`` ids."""
    g = golden()
    prefix = f"{kind}.layer"
    return {int(k[len(prefix) :]): v for k, v in g.items() if k.startswith(prefix)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (the golden README's measure)."""
    return ((got - want).abs().max() / want.abs().max()).item()
