"""Python source for plain values, laid out the way ``ruff format`` leaves it.

The generated modules must pass ``ruff format --check`` without running ruff at compile time
(CI machines need not have it). The layout is the formatter's fixed point: dataclass calls and
dicts are always exploded one item per line with a trailing comma (a "magic trailing comma"
keeps them exploded); tuples and lists of scalars stay on one line when the whole line fits in
``LINE_LENGTH``, else they are exploded the same way; one-element tuples are always ``(x,)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LINE_LENGTH = 100
INDENT = "    "


def py_literal(value: Any, indent: str = "", prefix: str = "", suffix: str = "") -> str:
    """Source of ``value`` placed after ``prefix`` on a line indented by ``indent``.

    The returned text does not include ``indent``/``prefix``/``suffix``; they only decide
    whether a flat layout fits.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"{f.name}=", getattr(value, f.name)) for f in dataclasses.fields(value)]
        return _exploded(f"{type(value).__name__}(", ")", items, indent)
    if isinstance(value, dict):
        items = [(py_literal(k) + ": ", v) for k, v in value.items()]
        return _exploded("{", "}", items, indent)
    if isinstance(value, tuple | list):
        open_, close = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        if isinstance(value, tuple) and len(value) == 1:
            # ruff keeps ``(x,)`` on one line only when ``x`` itself is flat and the whole fits;
            # otherwise the single element goes on its own line
            inner = py_literal(value[0], indent, prefix + "(", ",)" + suffix)
            flat = f"({inner},)"
            if (
                "\n" not in inner
                and len(indent) + len(prefix) + len(flat) + len(suffix) <= LINE_LENGTH
            ):
                return flat
            return _exploded(open_, close, [("", value[0])], indent)
        if not value:
            return open_ + close
        if all(_is_scalar(v) for v in value):
            flat = open_ + ", ".join(_scalar(v) for v in value) + close
            if len(indent) + len(prefix) + len(flat) + len(suffix) <= LINE_LENGTH:
                return flat
        return _exploded(open_, close, [("", v) for v in value], indent)
    return _scalar(value)


def _exploded(open_: str, close: str, items: list[tuple[str, Any]], indent: str) -> str:
    if not items:
        return open_ + close
    inner = indent + INDENT
    lines = [open_]
    for prefix, v in items:
        lines.append(f"{inner}{prefix}{py_literal(v, inner, prefix, ',')},")
    lines.append(indent + close)
    return "\n".join(lines)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def _scalar(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return py_string(v)
    raise TypeError(f"cannot emit a {type(v).__name__} literal")


def py_string(s: str) -> str:
    """A string literal in double quotes, as the formatter prefers."""
    r = repr(s)
    if r.startswith("'") and '"' not in s:
        r = '"' + r[1:-1].replace("\\'", "'") + '"'
    return r
