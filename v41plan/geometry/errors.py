"""Located spec errors: every problem in a spec is one ``SpecError`` printed
``file:line:col: message (hint)``.

Plain Python: the topology checks in ``v41plan.geometry.topology`` raise these too, and they run
on machines without pydantic or ruamel.yaml. A ``Locator`` turns a path into the loaded YAML
(``("model", "compress_ratios", 3)``) into a 1-based line and column by reading the
``.lc`` position records ruamel.yaml's round-trip loader attaches to mappings and sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Location:
    """A place in a spec file (1-based line and column)."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class SpecError(Exception):
    """One problem in a spec, with where it is and what to change."""

    def __init__(self, location: Location, message: str, hint: str) -> None:
        self.location = location
        self.message = message
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.location}: {self.message} ({self.hint})"


class Locator:
    """Maps paths into a loaded spec to source locations.

    ``root`` is the ruamel round-trip tree; without one (a spec built from generated code or
    from Python values) every path maps to line 1, column 1 of ``file``. A path that leaves the
    tree (a missing key) stops at the deepest node it reached, which is the mapping the key
    belongs in.
    """

    def __init__(self, file: str, root: Any = None) -> None:
        self.file = file
        self.root = root

    def at(self, *path: str | int) -> Location:
        """Location of the node at ``path``: a mapping key's value, a sequence item, or the
        deepest existing container on the way."""
        line, col = 0, 0
        node = self.root
        for step in path:
            lc = getattr(node, "lc", None)
            if lc is None:
                break
            if isinstance(node, dict) and step in node:
                # An empty value has no position of its own: point at its key.
                scalar = _is_scalar(node[step]) and node[step] is not None
                line, col = lc.value(step) if scalar else lc.key(step)
            elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
                line, col = lc.item(step)
            else:
                break
            node = node[step]
        return Location(self.file, line + 1, col + 1)

    def key(self, *path: str | int) -> Location:
        """Location of the key (not the value) at the end of ``path`` in its mapping."""
        parent = self.root
        for step in path[:-1]:
            try:
                parent = parent[step]
            except (KeyError, IndexError, TypeError):
                return self.at(*path)
        lc = getattr(parent, "lc", None)
        if lc is None or not isinstance(parent, dict) or path[-1] not in parent:
            return self.at(*path)
        line, col = lc.key(path[-1])
        return Location(self.file, line + 1, col + 1)

    def error(self, path: Path, message: str, hint: str) -> SpecError:
        """A ``SpecError`` located at ``path``."""
        return SpecError(self.at(*path), message, hint)


def _is_scalar(v: Any) -> bool:
    return not isinstance(v, dict | list)
