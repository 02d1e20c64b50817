"""The generated modules: values equal the compiler's, stale specs are refused, and they load
without pydantic or ruamel.yaml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from v41plan.geometry.runtime import load_cache_spec
from v41plan.geometry.spec import compile_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["deepseek_v41_flash", "tiny", "tiny40", "medium"])
def test_generated_equals_compiled(name):
    """``load_cache_spec`` (no YAML) gives exactly what the compiler builds from the YAML."""
    path = ROOT / "specs" / f"{name}.yaml"
    generated = load_cache_spec(path)
    compiled = compile_spec(path)
    assert generated == compiled
    assert generated.geometries == compiled.geometries
    assert generated.model_config == compiled.model_config
    assert load_cache_spec(name) == generated


def test_stale_spec_is_refused(tmp_path):
    """A spec edited after compiling is refused with the fix command."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text((ROOT / "specs" / "tiny.yaml").read_text().replace("[1, 2, 4, 8]", "[1, 2]"))
    with pytest.raises(
        ValueError, match=r"generated code is stale .* run `v41plan compile specs/`"
    ):
        load_cache_spec(spec)


def test_generated_imports_without_pydantic_or_ruamel():
    """The generated geometry and the executor package load neither pydantic nor ruamel."""
    code = (
        "import sys\n"
        "import v41plan.generated.tiny.geometry as g\n"
        "import v41plan.model, v41plan.runtime, v41plan.serving\n"
        "from v41plan.geometry.runtime import load_cache_spec\n"
        "assert load_cache_spec('specs/tiny.yaml') is g.CACHE_SPEC\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'ruamel'))\n"
        "print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


def test_generated_geometry_imports_only_runtime():
    """``geometry.py`` imports nothing but ``v41plan.geometry.runtime``."""
    import ast

    for path in sorted((ROOT / "v41plan" / "generated").glob("*/geometry.py")):
        tree = ast.parse(path.read_text())
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        assert [getattr(n, "module", None) for n in imports] == ["v41plan.geometry.runtime"], path
