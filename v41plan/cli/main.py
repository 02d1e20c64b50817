"""Command line: ``v41plan compile|explain|plan|init-checkpoint|run|serve|bench``.

Each subcommand lives in the module that owns its work and exposes ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported lazily so ``compile`` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compile": ("v41plan.cli.compile", "validate specs and regenerate v41plan/generated/"),
    "explain": ("v41plan.cli.explain", "print a spec's layers and bytes"),
    "plan": ("v41plan.cli.plan", "print the step plan of a described batch"),
    "init-checkpoint": ("v41plan.cli.checkpoint", "write a random checkpoint for a spec"),
    "run": ("v41plan.cli.run", "generate text with the engine"),
    "serve": ("v41plan.cli.serve", "serve the OpenAI API over the asynchronous engine"),
    "bench": ("v41plan.cli.bench", "run a benchmark"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="v41plan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``v41plan`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
