"""``resolve_spec``: the one rule every command applies to its spec argument."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from v41plan.geometry.errors import SpecError
from v41plan.geometry.resolve import SpecArgumentError, compiled_spec_names, resolve_spec
from v41plan.geometry.runtime import file_sha256, load_cache_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "specs" / "tiny.yaml"


def test_a_name_or_the_shipped_file_is_the_compiled_spec():
    compiled = load_cache_spec("tiny")
    assert resolve_spec("tiny") is compiled
    assert resolve_spec(TINY) is compiled
    assert resolve_spec(compiled) is compiled
    assert {"tiny", "tiny40", "medium", "deepseek_v41_flash"} <= set(compiled_spec_names())


def test_an_edited_copy_elsewhere_is_compiled_not_called_stale(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY.read_text().replace("description: Every", "description: Mine, every"))
    cs = resolve_spec(p)
    assert cs.spec_sha256 == file_sha256(p) != load_cache_spec("tiny").spec_sha256


def test_a_broken_file_is_a_located_spec_error(tmp_path):
    p = tmp_path / "specs" / "tiny.yaml"
    p.parent.mkdir()
    p.write_text(TINY.read_text().replace("  hidden_size:", "  hiden_size:"))
    with pytest.raises(SpecError, match=r"^specs/tiny.yaml:28:3: unknown key 'hiden_size'"):
        resolve_spec(p)


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("nope", "nope: no compiled spec of that name and no such file (compiled specs: "),
        ("specs/nope.yaml", "specs/nope.yaml: no such file"),
        (str(ROOT / "specs"), "specs: is a folder, not a spec file"),
        ("", "'': empty spec argument"),
        ("a\x00b.yaml", "no such file"),
    ],
)
def test_arguments_that_name_nothing(arg, message):
    with pytest.raises(SpecArgumentError) as exc:
        resolve_spec(arg)
    assert message in str(exc.value)


def test_without_the_compiler_a_file_to_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """A compiled spec still loads; a file needing the compiler says so (the GPU image)."""
    monkeypatch.setitem(sys.modules, "pydantic", None)
    monkeypatch.delitem(sys.modules, "v41plan.geometry.spec", raising=False)
    assert resolve_spec(TINY) is load_cache_spec("tiny")
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY.read_text() + "\n# edited\n")
    with pytest.raises(SpecArgumentError) as exc:
        resolve_spec(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: is not the file v41plan/generated/tiny/ was compiled from")
    assert "pydantic is not installed here" in msg and "\n" not in msg
    q = tmp_path / "fresh.yaml"
    q.write_text("spec_version: 1\n")
    with pytest.raises(SpecArgumentError, match="fresh.yaml: is not compiled, and reading"):
        resolve_spec(q)
