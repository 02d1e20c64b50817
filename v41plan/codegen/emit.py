"""Rendering and writing generated code: headers, templates, manifests, write-if-changed.

``v41plan.codegen.targets.render_spec`` turns one compiled spec into its files (every target
plus ``MANIFEST.json``); ``write_tree`` writes a set of rendered
specs under a generated root, touching only files whose bytes change and removing files of a
spec package (one holding a ``MANIFEST.json``) that no target produces any more.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from v41plan import __version__
from v41plan.geometry.runtime import CacheSpec

GENERATOR_VERSION = __version__
GENERATED_ROOT = Path(__file__).resolve().parent.parent / "generated"
MANIFEST = "MANIFEST.json"
# Assembled so that this source file is not itself marked as generated.
GENERATED_MARK = "@" + "generated"


@dataclass(frozen=True)
class GeneratedFile:
    """One rendered file, relative to the generated root (``tiny/geometry.py``)."""

    relpath: str
    content: str


def header(cs: CacheSpec) -> str:
    """The first line of every generated Python file."""
    return (
        f"# {GENERATED_MARK} by v41plan from {cs.spec_path} "
        f"(spec sha256 {cs.spec_sha256}); DO NOT EDIT."
    )


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(  # the output is Python source, not HTML: no autoescape
        loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_template(name: str, **context: object) -> str:
    """Render a template; a missing variable is an error, never an empty string."""
    return _env().get_template(name).render(**context)


def sha256_text(text: str) -> str:
    """sha256 of a file's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def spec_packages(root: Path, folder: str | None = None) -> list[str]:
    """Names of the spec packages under a generated root (folders holding a manifest); with
    ``folder``, only those compiled from a spec in a folder of that name (``specs``)."""
    if not root.is_dir():
        return []
    names = []
    for manifest in sorted(root.glob(f"*/{MANIFEST}")):
        if folder is not None:
            try:
                spec = json.loads(manifest.read_text()).get("spec", "")
            except (ValueError, AttributeError):
                spec = ""
            if not isinstance(spec, str) or spec.split("/")[0] != folder:
                continue
        names.append(manifest.parent.name)
    return names


def existing_files(root: Path, package: str) -> list[str]:
    """Files of a spec package, relative to the root (caches left out)."""
    base = root / package
    return sorted(
        p.relative_to(root).as_posix()
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def write_tree(root: Path, files: list[GeneratedFile], packages: list[str]) -> list[str]:
    """Write ``files`` under ``root`` where their bytes changed; delete the other files of
    ``packages`` (the spec packages this compile owns). Returns the paths it changed."""
    changed = []
    expected = {f.relpath for f in files}
    for f in files:
        path = root / f.relpath
        data = f.content.encode("utf-8")
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        changed.append(f.relpath)
    for package in packages:
        for rel in existing_files(root, package):
            if rel not in expected:
                (root / rel).unlink()
                changed.append(f"{rel} (removed)")
        base = root / package
        if not any(rel.startswith(package + "/") for rel in expected) and base.is_dir():
            shutil.rmtree(base)
    return changed
