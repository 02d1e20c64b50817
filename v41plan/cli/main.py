"""Command line: ``v41plan compile|explain|plan|init-checkpoint|train|run|serve|bench``.

Each subcommand lives in the module that owns its work and exposes ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported lazily so ``compile`` never loads torch.

Errors: a refused option or input is one line on stderr, ``v41plan COMMAND: INPUT: what is
wrong``, exit 2, before any work; a run or check that failed exits 1; an internal error (a bug)
is one line on stderr and exit 1 (``V41PLAN_TRACEBACK=1`` shows its traceback).
"""

from __future__ import annotations

import importlib
import os
import sys

from v41plan import __version__
from v41plan.cli.args import EXIT_FAILED, EXIT_REFUSED, Parser, Refused, one_line

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compile": ("v41plan.cli.compile", "validate specs and regenerate v41plan/generated/"),
    "explain": ("v41plan.cli.explain", "print a spec's layers and bytes"),
    "plan": ("v41plan.cli.plan", "print the step plan of a described batch"),
    "init-checkpoint": ("v41plan.cli.checkpoint", "write a random checkpoint for a spec"),
    "train": ("v41plan.cli.train", "train a small model on the quality tasks' corpus"),
    "run": ("v41plan.cli.run", "generate text with the engine"),
    "serve": ("v41plan.cli.serve", "serve the OpenAI API over the asynchronous engine"),
    "bench": ("v41plan.cli.bench", "run a benchmark"),
}


def build_parser(argv: list[str]) -> Parser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = Parser(prog="v41plan", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"v41plan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``v41plan`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_REFUSED
    module = importlib.import_module(COMMANDS[args.command][0])
    if args.command in ("run", "serve"):
        _show_start_progress(args.command)
    try:
        return int(module.run(args) or 0)
    except Refused as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank refuses alike
            print(f"v41plan {args.command}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:  # the reader went away (`| head`): nothing to report to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"v41plan {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line, not a traceback, unless asked
        if os.environ.get("V41PLAN_TRACEBACK"):
            raise
        print(
            f"v41plan {args.command}: internal error: {type(exc).__name__}: {one_line(exc)} "
            f"(set V41PLAN_TRACEBACK=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


def _show_start_progress(command: str) -> None:
    """Print the engine start's progress lines (graph warm-up, where level 3 compiles, and
    capture) on stderr, rank 0 only: a cold start takes minutes."""
    import logging

    if os.environ.get("RANK", "0") != "0":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"v41plan {command}: %(message)s"))
    handler.v41plan_start = True
    for name in ("v41plan.runtime.graphs", "v41plan.serving.runner"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        # one handler however often main() runs in a process (the tests call it many times)
        logger.handlers = [h for h in logger.handlers if not getattr(h, "v41plan_start", False)]
        logger.addHandler(handler)


if __name__ == "__main__":
    raise SystemExit(main())
