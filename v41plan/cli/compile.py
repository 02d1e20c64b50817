"""``v41plan compile SPECS [--check] [--out DIR]``: validate specs and regenerate their code.

``SPECS`` is a folder (every ``*.yaml`` in it; packages under the generated root compiled from a
folder of that name whose spec is gone are removed) or one spec file. ``--check`` writes nothing
and exits 1 naming every
missing, stale or extra file, with a unified diff and the command that fixes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from v41plan.cli.args import path_exists, refuse
from v41plan.codegen.check import check_tree
from v41plan.codegen.emit import GENERATED_ROOT, GeneratedFile, spec_packages, write_tree
from v41plan.codegen.targets import render_spec
from v41plan.geometry.errors import SpecError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``v41plan compile``."""
    p.add_argument("specs", help="spec folder (every *.yaml in it) or one spec file")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming every missing, stale or extra file (default: write)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="generated root (default: the package's v41plan/generated/)",
    )


def spec_files(specs: Path) -> list[Path]:
    """The spec files named by a folder or a file argument."""
    if specs.is_dir():
        return sorted(p for p in specs.iterdir() if p.suffix in (".yaml", ".yml"))
    return [specs]


def render_specs(specs: Path) -> tuple[list[GeneratedFile], list[str], list[SpecError]]:
    """Render every spec; returns the files, the spec names and the errors found."""
    from v41plan.geometry.spec import compile_spec

    files: list[GeneratedFile] = []
    names: list[str] = []
    errors: list[SpecError] = []
    for path in spec_files(specs):
        try:
            cs = compile_spec(path)
        except SpecError as exc:
            errors.append(exc)
            continue
        names.append(cs.name)
        files.extend(render_spec(cs))
    return files, names, errors


def run(args: argparse.Namespace) -> int:
    """Validate, then regenerate (or check) the generated code."""
    specs = Path(args.specs)
    root = Path(args.out) if args.out is not None else GENERATED_ROOT
    if not path_exists(specs):
        return refuse("compile", f"{specs}: no such file or folder")
    files, names, errors = render_specs(specs)
    for err in errors:
        print(err, file=sys.stderr)
    if errors:
        return 1
    if not names:
        return refuse("compile", f"{specs}: no *.yaml spec in this folder")
    # A folder owns the packages compiled from it (so orphans are found); a file only its own.
    if specs.is_dir():
        packages = sorted(set(names) | set(spec_packages(root, specs.resolve().name)))
    else:
        packages = names
    fix = "v41plan compile " + str(args.specs) + (f" --out {args.out}" if args.out else "")
    shown = _shown_root(root)
    if args.check:
        problems = check_tree(root, files, packages)
        for p in problems:
            print(f"{p.kind}: {shown}/{p.relpath}")
        for p in problems:
            if p.diff:
                print(p.diff, end="" if p.diff.endswith("\n") else "\n")
        if problems:
            print(f"generated code is out of date; run `{fix}`")
            return 1
        print(f"generated code is up to date ({len(names)} specs, {len(files)} files)")
        return 0
    try:
        changed = write_tree(root, files, packages)
    except OSError as exc:
        print(
            f"v41plan compile: {exc.filename or root}: cannot write ({exc.strerror})",
            file=sys.stderr,
        )
        return 1
    for rel in changed:
        print(f"wrote {shown}/{rel}")
    if not changed:
        print(f"generated code is up to date ({len(names)} specs, {len(files)} files)")
    return 0


def _shown_root(root: Path) -> str:
    try:
        return root.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return root.as_posix()
