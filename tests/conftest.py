"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# The tests run tiny tensors: one thread per process avoids oversubscribing small CI machines
# (two threads on two busy cores made tiny forwards many times slower). Set before torch loads,
# so subprocesses (torchrun launches) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

# CI draws the same hypothesis examples on every run (a red CI is then reproducible); local
# runs keep drawing fresh ones.
# no deadline: two xdist workers share two cores, and a timed example would flake there
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


@pytest.fixture(scope="session")
def specs_dir() -> Path:
    """The shipped specs folder."""
    return SPECS
