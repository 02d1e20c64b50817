"""The registry of generated files: each target names a file and renders it from a ``CacheSpec``.

Adding an output is two lines: a render function and an entry in ``TARGETS``. A render function
returns the whole file (start it with ``emit.header(cache_spec)``) and must be deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from v41plan.codegen.emit import (
    GENERATOR_VERSION,
    MANIFEST,
    GeneratedFile,
    header,
    render_template,
    sha256_text,
)
from v41plan.codegen.literal import py_literal
from v41plan.codegen.planner_targets import render_checkpoint, render_stages
from v41plan.geometry.runtime import CacheSpec

RUNTIME_TYPES = (
    "CacheSpec",
    "CaptureBuckets",
    "LayerInfo",
    "ModelDims",
    "PlaneInfo",
    "PoolGeometry",
    "ReplayRules",
    "StateField",
)


@dataclass(frozen=True)
class Target:
    """One generated file of every spec."""

    file_name: str
    """File name inside ``v41plan/generated/<spec>/``."""
    render: Callable[[CacheSpec], str]
    """Returns the file's full content (header included)."""


def render_geometry(cs: CacheSpec) -> str:
    """``geometry.py``: ``CACHE_SPEC`` as literal runtime dataclasses, plus lookup tables."""
    assignments = [
        ("SPEC_NAME", "str", cs.name, "Spec name."),
        ("SPEC_SHA256", "str", cs.spec_sha256, "sha256 of the spec file compiled."),
        (
            "LAYER_ROLES",
            "tuple[str, ...]",
            tuple(layer.role for layer in cs.layers),
            "Role of each backbone layer, by layer id.",
        ),
        ("CACHE_SPEC", "CacheSpec", cs, "The whole compiled spec."),
    ]
    return render_template(
        "geometry.py.j2",
        header=header(cs),
        spec_name=cs.name,
        spec_path=cs.spec_path,
        imports=RUNTIME_TYPES,
        assignments=[
            {"name": n, "annotation": a, "value": py_literal(v, "", f"{n}: {a} = "), "doc": d}
            for n, a, v, d in assignments
        ],
    )


def render_init(cs: CacheSpec) -> str:
    """``__init__.py``: the package docstring."""
    return render_template(
        "init.py.j2",
        header=header(cs),
        spec_name=cs.name,
        spec_path=cs.spec_path,
        modules=", ".join(t.file_name for t in TARGETS if t.file_name != "__init__.py"),
    )


TARGETS: list[Target] = [
    Target("__init__.py", render_init),
    Target("geometry.py", render_geometry),
    Target("stages.py", render_stages),
    Target("checkpoint.py", render_checkpoint),
]


def render_spec(cs: CacheSpec) -> list[GeneratedFile]:
    """Every file of one spec's package, manifest last."""
    files = [GeneratedFile(f"{cs.name}/{t.file_name}", t.render(cs)) for t in TARGETS]
    manifest = {
        "generator": "v41plan",
        "generator_version": GENERATOR_VERSION,
        "spec": cs.spec_path,
        "spec_sha256": cs.spec_sha256,
        "files": {f.relpath.split("/", 1)[1]: sha256_text(f.content) for f in files},
    }
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return [*files, GeneratedFile(f"{cs.name}/{MANIFEST}", text)]
