"""Spec builders shared by the planner tests."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

from v41plan.geometry.derive import load_cache_spec_unchecked, resolve_layers

SPECS = Path(__file__).resolve().parents[2] / "specs"


@cache
def spec(name: str):
    """A shipped spec, straight from its YAML."""
    return load_cache_spec_unchecked(str(SPECS / f"{name}.yaml"))


def variant(base, *, name: str | None = None, replay: dict | None = None, **dims):
    """``base`` with some model dims and replay rules replaced (layers re-resolved)."""
    new_dims = dataclasses.replace(base.dims, **dims)
    rules = dataclasses.replace(base.replay, **(replay or {}))
    return dataclasses.replace(
        base,
        name=name or f"{base.name}_variant",
        spec_sha256="variant",
        dims=new_dims,
        layers=resolve_layers(new_dims),
        replay=rules,
    )
