"""One rule for a spec argument (``--spec``, ``SPEC``): a compiled spec name or a spec file.

Every command and the engine resolve their spec through ``resolve_spec``:

- a name (``tiny``) is the compiled package ``v41plan/generated/<name>/``; when the checkout's
  ``specs/<name>.yaml`` exists and changed since it was compiled, that file is compiled instead;
- a path (``specs/tiny.yaml``, ``/tmp/my/tiny.yaml``) is the compiled package of its file name
  only when the file's bytes are the ones that package was compiled from; any other file (not
  compiled, edited since, or a different file that shares a shipped spec's name) is read by the
  compiler, so its problems come back located (``file:line:col: message (hint)``).

A compiled spec loads from generated Python alone (no pydantic, no ruamel.yaml). The compiler is
imported only when a file must be read; where it is not installed, that is said in one line.
Problems with the argument itself raise ``SpecArgumentError``; problems inside a spec file
raise the compiler's ``SpecError``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from v41plan.geometry.runtime import CacheSpec, file_sha256, generated_package

__all__ = ["SpecArgumentError", "compiled_spec_names", "resolve_spec"]

GENERATED_DIR = Path(__file__).resolve().parents[1] / "generated"
CHECKOUT_SPECS = Path(__file__).resolve().parents[2] / "specs"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class SpecArgumentError(ValueError):
    """A spec argument that names no spec (message: the argument, then what is wrong)."""


def compiled_spec_names() -> list[str]:
    """Names of the specs compiled into ``v41plan/generated/``."""
    if not GENERATED_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in GENERATED_DIR.glob("*/geometry.py"))


def _compiled(name: str) -> CacheSpec | None:
    """The compiled spec called ``name``, or None when there is none."""
    if not _NAME.fullmatch(name) or name not in compiled_spec_names():
        return None
    return importlib.import_module(generated_package(name) + ".geometry").CACHE_SPEC


def _exists(p: Path) -> bool:
    """``p.exists()``, False for names the OS cannot even look up (too long, NUL bytes)."""
    try:
        return p.exists()
    except (OSError, ValueError):
        return False


def _is_path(arg: str) -> bool:
    p = Path(arg)
    return p.suffix in (".yaml", ".yml") or "/" in arg or "\\" in arg or _exists(p)


def resolve_spec(spec: str | Path | CacheSpec) -> CacheSpec:
    """The ``CacheSpec`` a spec argument names (see the module docstring for the rule).

    Raises ``SpecArgumentError`` for an argument naming nothing, the compiler's ``SpecError``
    for a broken spec file.
    """
    if isinstance(spec, CacheSpec):
        return spec
    arg = str(spec)
    if not arg.strip():
        raise SpecArgumentError(f"{arg!r}: empty spec argument (give a spec name or file)")
    if not _is_path(arg):
        compiled = _compiled(arg)
        shipped = CHECKOUT_SPECS / f"{arg}.yaml"
        if compiled is not None:
            if shipped.is_file() and file_sha256(shipped) != compiled.spec_sha256:
                return _compile(shipped, compiled)
            return compiled
        if _NAME.fullmatch(arg) and shipped.is_file():
            return _compile(shipped, None)
        names = ", ".join(compiled_spec_names()) or "none"
        raise SpecArgumentError(
            f"{arg}: no compiled spec of that name and no such file (compiled specs: {names}; "
            f"or give a path to a .yaml spec)"
        )
    p = Path(arg)
    if not _exists(p):
        raise SpecArgumentError(f"{arg}: no such file")
    if p.is_dir():
        raise SpecArgumentError(f"{arg}: is a folder, not a spec file")
    try:
        digest = file_sha256(p)
    except OSError as exc:
        raise SpecArgumentError(f"{arg}: cannot be read ({exc.strerror or exc})") from None
    compiled = _compiled(p.stem)
    if compiled is not None and digest == compiled.spec_sha256:
        return compiled
    return _compile(p, compiled)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _compile(path: Path, compiled: CacheSpec | None) -> CacheSpec:
    """Read ``path`` with the compiler (located ``SpecError``s), or say why it cannot be."""
    try:
        from v41plan.geometry.spec import compile_spec
    except ImportError as exc:
        missing = exc.name or "pydantic/ruamel.yaml"
        if compiled is None:
            why = "is not compiled"
        elif _same_file(path, CHECKOUT_SPECS / path.name):
            why = f"changed since v41plan/generated/{path.stem}/ was compiled from it"
        else:
            why = (
                f"is not the file v41plan/generated/{path.stem}/ was compiled from "
                f"({compiled.spec_path}, sha256 {compiled.spec_sha256[:12]})"
            )
        raise SpecArgumentError(
            f"{path}: {why}, and reading a spec file needs the compiler, whose {missing} is "
            f"not installed here (install pydantic and ruamel.yaml, or pass a compiled spec)"
        ) from None
    return compile_spec(path)
