"""``v41plan compile``: rendering, write-if-changed, manifests and ``--check``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from v41plan.cli.main import main
from v41plan.codegen import targets
from v41plan.codegen.emit import GENERATED_ROOT, header, render_template, sha256_text
from v41plan.codegen.targets import Target, render_spec
from v41plan.geometry.runtime import file_sha256
from v41plan.geometry.spec import compile_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
SHIPPED = (
    "deepseek_v41_flash", "flash_slice", "medium", "quality40", "quality40w", "tiny", "tiny40",
    "tiny40_dspark",
)  # fmt: skip


@pytest.fixture
def tree(tmp_path):
    """A copy of the shipped specs and their committed generated code."""
    shutil.copytree(SPECS, tmp_path / "specs")
    shutil.copytree(
        GENERATED_ROOT, tmp_path / "generated", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def compile_cli(tree: Path, *extra: str, capsys) -> tuple[int, str]:
    rc = main(["compile", str(tree / "specs"), "--out", str(tree / "generated"), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_shipped_generated_code_is_up_to_date(capsys):
    """The committed ``v41plan/generated/`` matches the shipped specs (the CI gate)."""
    rc = main(["compile", str(SPECS), "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    files = (len(targets.TARGETS) + 1) * len(SHIPPED)  # every target plus the manifest
    assert out == f"generated code is up to date ({len(SHIPPED)} specs, {files} files)\n"


def test_check_reports_stale_file_with_diff_and_fix(tree, capsys):
    """A hand-edited generated file: exit 1, named as stale, a unified diff, the fix command."""
    geo = tree / "generated" / "tiny" / "geometry.py"
    geo.write_text(geo.read_text().replace('SPEC_NAME: str = "tiny"', 'SPEC_NAME: str = "tony"'))
    rc, out = compile_cli(tree, "--check", capsys=capsys)
    assert rc == 1
    lines = out.splitlines()
    shown = f"{(tree / 'generated').as_posix()}/tiny/geometry.py"
    assert lines[0] == f"stale: {shown}"
    assert "--- a/tiny/geometry.py" in lines and "+++ b/tiny/geometry.py" in lines
    assert '-SPEC_NAME: str = "tony"' in lines and '+SPEC_NAME: str = "tiny"' in lines
    assert lines[-1] == (
        "generated code is out of date; run "
        f"`v41plan compile {tree / 'specs'} --out {tree / 'generated'}`"
    )
    assert "tony" in geo.read_text()  # --check wrote nothing


def test_check_reports_missing_and_extra(tree, capsys):
    """A deleted file is missing; a stray file in a spec package and an orphaned package are
    extra."""
    (tree / "generated" / "tiny40" / "__init__.py").unlink()
    (tree / "generated" / "tiny" / "notes.py").write_text("x = 1\n")
    orphan = tree / "generated" / "gone"
    orphan.mkdir()
    (orphan / "MANIFEST.json").write_text('{"spec": "specs/gone.yaml"}\n')
    # A package compiled from another folder is not this folder's to report or remove.
    foreign = tree / "generated" / "mine"
    foreign.mkdir()
    (foreign / "MANIFEST.json").write_text('{"spec": "myspecs/mine.yaml"}\n')
    rc, out = compile_cli(tree, "--check", capsys=capsys)
    gen = (tree / "generated").as_posix()
    assert rc == 1
    assert out.splitlines()[:3] == [
        f"extra: {gen}/gone/MANIFEST.json",
        f"extra: {gen}/tiny/notes.py",
        f"missing: {gen}/tiny40/__init__.py",
    ]
    # The fix command repairs all three, then --check is clean.
    rc, out = compile_cli(tree, capsys=capsys)
    assert rc == 0
    assert not orphan.exists() and not (tree / "generated" / "tiny" / "notes.py").exists()
    assert (foreign / "MANIFEST.json").exists()
    assert compile_cli(tree, "--check", capsys=capsys)[0] == 0


def test_stale_after_spec_edit(tree, capsys):
    """Editing a spec makes its package stale (hash in header, manifest and values)."""
    spec = tree / "specs" / "tiny.yaml"
    spec.write_text(spec.read_text().replace("batch_sizes: [1, 2, 4, 8]", "batch_sizes: [1, 2, 4]"))
    rc, out = compile_cli(tree, "--check", capsys=capsys)
    gen = (tree / "generated").as_posix()
    assert rc == 1
    names = sorted(["MANIFEST.json"] + [t.file_name for t in targets.TARGETS])
    assert [x for x in out.splitlines() if x.startswith("stale:")] == [
        f"stale: {gen}/tiny/{name}" for name in names
    ]


def test_writes_only_when_changed(tree, capsys):
    """A second compile touches nothing; a spec edit rewrites only that spec's files."""
    gen = tree / "generated"
    before = {p: p.stat().st_mtime_ns for p in gen.rglob("*") if p.is_file()}
    rc, out = compile_cli(tree, capsys=capsys)
    assert rc == 0 and out.startswith("generated code is up to date")
    assert {p: p.stat().st_mtime_ns for p in before} == before
    spec = tree / "specs" / "medium.yaml"
    spec.write_text(spec.read_text().replace("query_buckets: [1]", "query_buckets: [1, 2]"))
    rc, out = compile_cli(tree, capsys=capsys)
    assert [line.split("/generated/")[1] for line in out.splitlines()] == [
        f"medium/{t.file_name}" for t in targets.TARGETS
    ] + ["medium/MANIFEST.json"]


def test_broken_spec_writes_nothing(tree, capsys):
    """One invalid spec: its located error, exit 1, no file written for any spec."""
    spec = tree / "specs" / "tiny.yaml"
    text = spec.read_text().replace("page_tokens: 32", "page_tokens: 31")
    spec.write_text(text)
    line = text.splitlines().index("  page_tokens: 31") + 1
    shutil.rmtree(tree / "generated" / "medium")
    rc, out = compile_cli(tree, capsys=capsys)
    assert rc == 1
    assert out == (
        f"specs/tiny.yaml:{line}:16: page_tokens 31 is not a multiple of ratio 2 (a compressed "
        f"group "
        "must not straddle a PAGE; use a multiple of every ratio)\n"
    )
    assert not (tree / "generated" / "medium").exists()


def test_manifest_and_header():
    """Header line, manifest hashes, spec hash and generator version."""
    cs = compile_spec(SPECS / "tiny.yaml")
    files = {f.relpath: f.content for f in render_spec(cs)}
    assert list(files) == [f"tiny/{t.file_name}" for t in targets.TARGETS] + ["tiny/MANIFEST.json"]
    digest = file_sha256(SPECS / "tiny.yaml")
    line = f"# @generated by v41plan from specs/tiny.yaml (spec sha256 {digest}); DO NOT EDIT."
    assert header(cs) == line
    assert files["tiny/geometry.py"].splitlines()[0] == line
    assert files["tiny/__init__.py"].splitlines()[0] == line
    manifest = json.loads(files["tiny/MANIFEST.json"])
    assert manifest["spec"] == "specs/tiny.yaml" and manifest["spec_sha256"] == digest
    assert manifest["generator_version"]
    assert manifest["files"] == {
        t.file_name: sha256_text(files[f"tiny/{t.file_name}"]) for t in targets.TARGETS
    }


def test_render_is_deterministic():
    """Two renders of a spec are byte-identical."""
    a = render_spec(compile_spec(SPECS / "deepseek_v41_flash.yaml"))
    b = render_spec(compile_spec(SPECS / "deepseek_v41_flash.yaml"))
    assert a == b


def test_templates_are_strict():
    """A missing template variable is an error, never an empty string."""
    with pytest.raises(jinja2.UndefinedError):
        render_template("init.py.j2", header="# h", spec_name="x", spec_path="specs/x.yaml")


def test_targets_registry_adds_a_file(monkeypatch):
    """A new target is one registry entry: it is rendered and listed in the manifest."""
    extra = Target("extra.py", lambda cs: header(cs) + f"\nLAYERS = {cs.dims.num_hidden_layers}\n")
    monkeypatch.setattr(targets, "TARGETS", [*targets.TARGETS, extra])
    files = {f.relpath: f.content for f in render_spec(compile_spec(SPECS / "tiny.yaml"))}
    assert files["tiny/extra.py"].endswith("\nLAYERS = 14\n")
    assert "extra.py" in json.loads(files["tiny/MANIFEST.json"])["files"]


def test_generated_code_is_ruff_formatted():
    """The committed generated modules are what ``ruff format`` would write."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    proc = subprocess.run(
        [ruff, "format", "--check", "--diff", str(GENERATED_ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compile_is_fast():
    """Compiling and rendering every shipped spec takes well under 30 s (here: in a subprocess,
    including interpreter start-up)."""
    proc = subprocess.run(
        [sys.executable, "-m", "v41plan", "compile", str(SPECS), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
