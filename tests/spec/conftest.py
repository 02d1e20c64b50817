"""Fixtures for spec tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_text import write_spec

from v41plan.geometry.errors import SpecError
from v41plan.geometry.spec import compile_spec


@pytest.fixture
def spec_error(tmp_path: Path):
    """``spec_error(text)`` -> the located message compiling ``text`` raises."""

    def run(text: str, name: str = "spec") -> str:
        with pytest.raises(SpecError) as info:
            compile_spec(write_spec(tmp_path, text, name))
        return str(info.value)

    return run
