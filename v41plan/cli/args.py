"""What every subcommand shares: its parser, the one-line refusal and the spec argument.

Exit codes (the README's "Exit codes and errors"): 0 success; 1 a run or a check that failed
(``compile`` finding a broken or stale spec, a generation whose request failed while running,
an internal error); 2 an option or input refused before any work, with one line on stderr
``v41plan COMMAND: INPUT: what is wrong``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from v41plan.geometry.errors import SpecError
from v41plan.geometry.resolve import SpecArgumentError, resolve_spec
from v41plan.geometry.runtime import CacheSpec

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


class Refused(Exception):
    """An option or input a command refuses before any work (one line, exit 2)."""

    def __str__(self) -> str:
        return one_line(super().__str__())


def one_line(text: str) -> str:
    """``text`` on one line (line breaks become ``; ``)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


class HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to every option's help that does not state its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower():
            return text
        unset = action.default is None or action.default is False  # 0 is a default to show
        if unset or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: MESSAGE (see PROG --help)`` and exit 2."""
        self.exit(EXIT_REFUSED, f"{self.prog}: {message} (see {self.prog} --help)\n")


def path_exists(path: str | Path) -> bool:
    """``Path.exists``, False for names the OS cannot even look up (too long, a NUL byte)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def spec_arg(value: str, option: str | None = None) -> CacheSpec:
    """The spec a command's argument names; ``Refused`` with one line otherwise.

    ``option`` (``--spec``) prefixes argument problems; a broken spec file is reported at its
    ``file:line:col``.
    """
    try:
        return resolve_spec(value)
    except SpecArgumentError as exc:
        raise Refused(f"{option} {exc}" if option else str(exc)) from None
    except SpecError as exc:
        raise Refused(str(exc)) from None


def refuse(command: str, message: str) -> int:
    """Print the one-line refusal of ``command`` and return exit code 2."""
    print(f"v41plan {command}: {one_line(message)}", file=sys.stderr)
    return EXIT_REFUSED
