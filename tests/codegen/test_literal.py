"""Formatter-stable literals: the layout ``ruff format`` leaves unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from v41plan.codegen.literal import py_literal, py_string


@dataclass(frozen=True)
class Point:
    """A small dataclass to emit."""

    name: str
    shape: tuple[int, ...]
    extra: dict


def test_dataclass_and_dict_are_exploded():
    """Dataclass calls and dicts: one item per line with a trailing comma; one-tuples flat."""
    text = py_literal(Point("a'b", (4,), {"k": None, ("x", "y"): 1.5}))
    assert text == (
        "Point(\n"
        '    name="a\'b",\n'
        "    shape=(4,),\n"
        "    extra={\n"
        '        "k": None,\n'
        '        ("x", "y"): 1.5,\n'
        "    },\n"
        ")"
    )


def test_scalar_tuples_flat_when_they_fit():
    """A scalar tuple stays on one line only if the whole line fits in 100 columns."""
    assert py_literal((1, 2, 3), "    ", "x=", ",") == "(1, 2, 3)"
    long = tuple(range(40))
    text = py_literal(long, "    ", "compress_ratios=", ",")
    assert text.startswith("(\n        0,\n        1,\n") and text.endswith("        39,\n    )")
    assert py_literal((), "", "") == "()" and py_literal([], "", "") == "[]"


def test_strings_prefer_double_quotes():
    """Double quotes unless the string holds one."""
    assert py_string("plain") == '"plain"'
    assert py_string('say "hi"') == "'say \"hi\"'"
    assert py_string("tab\there") == '"tab\\there"'


def test_one_element_tuples_follow_the_formatter():
    """``(x,)`` stays on one line only when ``x`` is flat and the line fits; otherwise the
    element goes on its own line (as ``ruff format`` leaves it)."""
    assert py_literal((3,), "", "Y = ") == "(3,)"
    assert py_literal((("backbone", 0, 13),), "", "W = ") == '(("backbone", 0, 13),)'
    assert py_literal((Point("p", (), {}),), "", "X = ") == (
        '(\n    Point(\n        name="p",\n        shape=(),\n        extra={},\n    ),\n)'
    )
    long = "a" * 95
    assert py_literal((long,), "", "Z = ") == f'(\n    "{long}",\n)'
