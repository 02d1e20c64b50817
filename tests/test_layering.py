"""The package's import direction: cli -> serving -> runtime -> model -> geometry, planner ->
geometry, codegen reading both; no import circles; the runtime side free of pydantic and
ruamel.yaml, the planner free of torch.

Every ``import`` in every module counts, the lazy ones inside functions too: a lazy import is
still an edge a module depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "v41plan"

# package -> the v41plan packages its modules may import (besides itself and ``v41plan``)
ALLOWED: dict[str, set[str]] = {
    "geometry": set(),
    "planner": {"geometry"},
    "model": {"geometry"},
    "runtime": {"geometry", "planner", "model"},
    "serving": {"geometry", "planner", "model", "runtime"},
    "validation": {"geometry", "planner", "model", "runtime", "serving"},
    "codegen": {"geometry", "planner"},
    "cli": {"geometry", "planner", "model", "runtime", "serving", "validation", "codegen"},
    "generated": {"geometry", "planner"},
    "__main__": {"cli"},
}
# third-party packages a layer must never import
FORBIDDEN: dict[str, set[str]] = {
    "planner": {"torch", "pydantic", "ruamel", "triton"},
    "model": {"pydantic", "ruamel"},
    "runtime": {"pydantic", "ruamel"},
    "serving": {"pydantic", "ruamel"},
    "validation": {"pydantic", "ruamel"},
    "generated": {"pydantic", "ruamel", "torch"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved), with lines."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path).split(".")
    if path.name != "__init__.py":
        me = me[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me[: len(me) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            # ``from v41plan.model import quant`` imports the submodule v41plan.model.quant
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if (PKG.parent / (sub.replace(".", "/") + ".py")).exists():
                    out.append((sub, node.lineno))
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "v41plan" else None


def test_every_package_has_a_rule():
    """A new top-level package must be placed in the layering before it can be imported."""
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))


def test_import_direction():
    """No module imports a package its layer may not depend on (lazy imports included)."""
    bad = []
    for path in _modules():
        layer = _layer(_module_name(path))
        if layer is None:
            continue
        for mod, line in _imports(path):
            top = mod.split(".")[0]
            if top in FORBIDDEN.get(layer, ()):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {top}")
            target = _layer(mod)
            if target is None or target == layer or mod.split(".")[0] != "v41plan":
                continue
            if target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {mod}")
    assert not bad, "\n".join(bad)


def test_generated_imports_only_their_types():
    """Generated modules import the dataclasses they are literals of and nothing else:
    ``geometry.py`` the runtime geometry types, ``stages.py`` / ``checkpoint.py`` the planner's
    table types."""
    allowed = {
        "geometry.py": {"v41plan.geometry.runtime"},
        "stages.py": {"v41plan.planner.stages"},
        "checkpoint.py": {"v41plan.planner.checkpoint"},
        "__init__.py": set(),
    }
    for path in sorted((PKG / "generated").rglob("*.py")):
        if path.parent == PKG / "generated":
            continue
        mods = {m for m, _ in _imports(path) if m.startswith("v41plan")}
        assert mods <= allowed[path.name], (path, mods)


def test_no_import_circles():
    """The module graph (every import, lazy ones too) has no cycle."""
    g = nx.DiGraph()
    names = {_module_name(p) for p in _modules()}
    for path in _modules():
        me = _module_name(path)
        for mod, _ in _imports(path):
            if mod in names and mod != me and not me.startswith(mod + "."):
                g.add_edge(me, mod)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


@pytest.mark.parametrize("layer", ["model", "runtime", "serving", "validation"])
def test_runtime_side_packages_import_without_pydantic(layer):
    """Importing every module of a runtime-side package loads neither pydantic nor ruamel.yaml
    (the GPU image has neither)."""
    import subprocess
    import sys

    mods = [_module_name(p) for p in _modules() if _layer(_module_name(p)) == layer]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in mods)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'ruamel'))\n"
        + "print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n", proc.stdout


def _is_triton_jit(dec: ast.expr) -> bool:
    """``@triton.jit`` / ``@triton.jit(...)`` (or ``@jit``)."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "jit"


def test_no_import_inside_a_triton_kernel():
    """A compiled Triton kernel cannot import (``unsupported AST node type: ImportFrom``), while
    the interpreter the CPU suite runs accepts it: such a kernel passes here and fails on the
    GPU only. Helpers a kernel calls are imported at its module's top."""
    bad = []
    for path in sorted((*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"))):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
                bad += [
                    f"{path.relative_to(ROOT)}:{sub.lineno} in {node.name}"
                    for sub in ast.walk(node)
                    if isinstance(sub, (ast.Import, ast.ImportFrom))
                ]
    assert not bad, bad
