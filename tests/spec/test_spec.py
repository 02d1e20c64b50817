"""Spec loading beyond single rules: the valid base, optional sections, strictness, the
shipped specs, docstrings and the CLI's handling of broken specs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel
from spec_text import BASE, edit, write_spec

import v41plan.geometry.spec as spec_module
from v41plan.geometry.derive import load_cache_spec_unchecked, resolve_layers
from v41plan.geometry.errors import Locator, SpecError
from v41plan.geometry.spec import SECTION_MODELS, compile_spec, load_spec

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("deepseek_v41_flash", "tiny", "tiny40", "medium", "flash_slice", "tiny40_dspark")


def test_base_spec_compiles(tmp_path):
    """The inline base every rule test edits is valid and resolves TINY's roles."""
    cs = compile_spec(write_spec(tmp_path, BASE))
    assert cs.name == "spec" and cs.spec_path == "specs/spec.yaml"
    assert [layer.role for layer in cs.layers] == (
        ["window"] * 2 + ["full", "reuse"] * 4 + ["reindex", "reuse"] * 2
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_compile_like_derive(name):
    """The located front end accepts the shipped specs and builds what derive builds."""
    path = ROOT / "specs" / f"{name}.yaml"
    cs = compile_spec(path)
    plain = dataclasses.replace(load_cache_spec_unchecked(str(path)), spec_path=cs.spec_path)
    assert cs == plain
    assert cs.geometries == plain.geometries
    assert cs.model_config == plain.model_config
    assert cs.spec_path == f"specs/{name}.yaml"


@pytest.mark.parametrize("name", SHIPPED)
def test_unchecked_loader_without_ruamel_builds_the_same_spec(name, monkeypatch):
    """Where ruamel.yaml is missing (the GPU image), the unchecked loader reads a shipped spec
    with PyYAML's safe loader and builds the same ``CacheSpec``."""
    pytest.importorskip("yaml")
    path = str(ROOT / "specs" / f"{name}.yaml")
    with_ruamel = load_cache_spec_unchecked(path)
    monkeypatch.setitem(sys.modules, "ruamel", None)
    monkeypatch.setitem(sys.modules, "ruamel.yaml", None)
    with pytest.raises(ImportError):
        import ruamel.yaml  # noqa: F401
    assert load_cache_spec_unchecked(path) == with_ruamel


def test_optional_sections(tmp_path):
    """``roles:`` and ``checkpoint:`` may be left out; ``reuse``/``decoder_start`` may be given."""
    no_roles = edit("roles:\n  full: [2, 4, 6, 8]\n  reindex: [10, 12]\n  window: [0, 1]\n", "")
    no_ckpt = edit("checkpoint:\n  image_fields: [swa_rings, cursor]\n", "", text=no_roles)
    cs = compile_spec(write_spec(tmp_path, no_ckpt))
    assert cs.checkpoint_image_fields == ("swa_rings", "cursor")
    full_roles = edit(
        "  window: [0, 1]", "  window: [0, 1]\n  reuse: [3, 5, 7, 9, 11, 13]\n  decoder_start: 8"
    )
    assert compile_spec(write_spec(tmp_path, full_roles)).layers == cs.layers


def test_no_candidates(tmp_path):
    """Candidate source -1: no layer uses candidates."""
    cs = compile_spec(
        write_spec(
            tmp_path, edit("  candidate_source_layer_id: 8", "  candidate_source_layer_id: -1")
        )
    )
    assert not any(layer.uses_candidates for layer in cs.layers)


def test_engram_in_decoder_without_decoder_replay(tmp_path):
    """The Engram placement rule only binds under decoder replay."""
    text = edit(
        "  engram_layer_ids: [1, 6]",
        "  engram_layer_ids: [1, 8]",
        "  decoder_swa_bounded_replay: true",
        "  decoder_swa_bounded_replay: false",
    )
    assert compile_spec(write_spec(tmp_path, text)).layers[8].engram


def test_tails_may_be_declared_in_images(tmp_path):
    """Tails are allowed in an image (not shipped); the image then grows by their bytes."""
    text = edit(
        "  image_fields: [swa_rings, cursor]",
        "  image_fields: [swa_rings, tail_values, tail_scores, cursor]",
    )
    g = compile_spec(write_spec(tmp_path, text)).geometry()
    assert g.image_bytes == sum(f.field_bytes for f in g.state_fields)


def test_float_is_not_an_integer(spec_error):
    """Strict types: no silent coercion of 32.0 to 32."""
    assert spec_error(edit("  page_tokens: 32", "  page_tokens: 32.0")) == (
        "specs/spec.yaml:53:16: pool.page_tokens must be an integer, not 32.0 (write an integer)"
    )


def test_not_a_mapping(spec_error):
    """A spec whose top level is not a mapping."""
    assert spec_error("- 1\n- 2\n") == (
        "specs/spec.yaml:1:1: a spec must be a mapping of sections (start with `spec_version: 1`)"
    )


def test_empty_file(spec_error):
    """An empty file is refused the same way."""
    assert spec_error("") == (
        "specs/spec.yaml:1:1: a spec must be a mapping of sections (start with `spec_version: 1`)"
    )


def test_yaml_tab(spec_error):
    """A scanner error (tab indentation) is located."""
    assert spec_error(edit("  page_tokens: 32", "\tpage_tokens: 32")) == (
        "specs/spec.yaml:53:1: YAML syntax error: found character '\\t' that cannot start any "
        "token (indent with spaces, not tabs)"
    )


def test_not_utf8(tmp_path):
    """Bytes that are not UTF-8 give a SpecError, not a UnicodeDecodeError."""
    path = tmp_path / "specs" / "spec.yaml"
    path.parent.mkdir()
    path.write_bytes(b"name: \xff\n")
    with pytest.raises(SpecError) as info:
        compile_spec(path)
    assert (
        str(info.value)
        == "specs/spec.yaml:1:1: the spec is not UTF-8 (invalid start byte) (save it as UTF-8)"
    )


def test_missing_file(tmp_path):
    """A path that does not exist."""
    with pytest.raises(SpecError) as info:
        compile_spec(tmp_path / "specs" / "nope.yaml")
    assert (
        str(info.value)
        == "specs/nope.yaml:1:1: cannot read the spec: No such file or directory (check the path)"
    )


def test_load_spec_keeps_models_and_locations(tmp_path):
    """``load_spec`` returns the frozen models, plain values and a locator for later passes."""
    loaded = load_spec(write_spec(tmp_path, BASE))
    assert loaded.model.pool.page_tokens == 32
    assert loaded.raw["model"]["compress_ratios"][8] == 1
    assert str(loaded.locator.at("model", "compress_ratios", 8)) == "specs/spec.yaml:15:45"
    assert str(loaded.locator.key("pool", "page_tokens")) == "specs/spec.yaml:53:3"
    with pytest.raises(Exception, match="frozen"):
        loaded.model.pool.page_tokens = 64


def test_locator_without_tree():
    """Without a YAML tree every path maps to the file's first line."""
    assert str(Locator("x.yaml").at("model", "head_dim")) == "x.yaml:1:1"


def test_every_spec_field_has_a_docstring():
    """Each field of every spec model carries an attribute docstring (its description)."""
    models = {
        v
        for v in vars(spec_module).values()
        if isinstance(v, type)
        and issubclass(v, BaseModel)
        and v.__module__ == spec_module.__name__
        and v.__name__ != "_Section"
    }
    assert models == set(SECTION_MODELS)
    missing = [
        f"{m.__name__}.{name}"
        for m in SECTION_MODELS
        for name, field in m.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert missing == []


def test_every_spec_field_is_in_the_readme():
    """specs/README.md documents every spec field."""
    readme = (ROOT / "specs" / "README.md").read_text()
    absent = [
        f"{m.__name__}.{name}"
        for m in SECTION_MODELS
        for name in m.model_fields
        if f"`{name}`" not in readme
    ]
    assert absent == []


def test_resolved_roles_match_derive_for_base(tmp_path):
    """The graph's roles and ``derive.resolve_layers`` agree on the base spec."""
    cs = compile_spec(write_spec(tmp_path, BASE))
    assert resolve_layers(cs.dims) == cs.layers


@pytest.mark.parametrize("command", ["compile", "explain"])
def test_cli_broken_spec_exits_with_located_message(tmp_path, command):
    """A broken spec: the located message on stderr, no traceback; ``compile`` exits 1 (its
    check failed), ``explain`` 2 (an input refused before any work, as every other command)."""
    path = write_spec(tmp_path, edit("  page_tokens: 32", "  page_tokens: 33"))
    target = str(path.parent) if command == "compile" else str(path)
    out = tmp_path / "generated"
    extra = ["--out", str(out)] if command == "compile" else []
    proc = subprocess.run(
        [sys.executable, "-m", "v41plan", command, target, *extra],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == (1 if command == "compile" else 2)
    prefix = "" if command == "compile" else "v41plan explain: "
    assert proc.stderr == prefix + (
        "specs/spec.yaml:53:16: page_tokens 33 is not a multiple of ratio 2 (a compressed group "
        "must not straddle a PAGE; use a multiple of every ratio)\n"
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_empty_value_points_at_its_key(spec_error):
    """``head_dim:`` with no value is null, located at the key."""
    assert spec_error(edit("  head_dim: 64", "  head_dim:")) == (
        "specs/spec.yaml:7:3: model.head_dim must be an integer, not null (write an integer)"
    )


def test_section_of_wrong_kind(spec_error):
    """An optional section given as a list."""
    text = edit(
        "roles:\n  full: [2, 4, 6, 8]\n  reindex: [10, 12]\n  window: [0, 1]\n", "roles: [1]\n"
    )
    assert (
        spec_error(text)
        == "specs/spec.yaml:56:1: roles must be a mapping, not a list (write a mapping)"
    )


def test_display_path_does_not_depend_on_the_working_directory(monkeypatch, specs_dir):
    from v41plan.geometry.spec import display_path

    assert display_path(specs_dir / "tiny.yaml") == "specs/tiny.yaml"
    monkeypatch.chdir(specs_dir)
    assert display_path(Path("tiny.yaml")) == "specs/tiny.yaml"
