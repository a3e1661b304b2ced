"""A griffe extension for accel's docstrings, loaded by mkdocstrings and by tools/docs/hooks.py.

Two things the sources do that griffe does not read by itself:

* ``#:`` comments above an attribute document it (the Sphinx convention, used for module
  constants and dataclass fields): they become the attribute's docstring unless it already has
  one (a string literal after the assignment).
* A public module-level function or class built by a call at import time
  (``is_timm_available = _package_probe(...)``) is an attribute to griffe; when it has no
  comment, the ``__doc__`` that the call gave it is its docstring (the module is imported).
* Sphinx roles in docstrings (``:class:`PrecisionPolicy```, ``:func:`~accel.utils.gather```)
  become plain code spans (the ``~`` form keeps the last dotted part), instead of showing the
  role markup on the site.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`]+)`")


def convert_roles(text: str) -> str:
    """Return ``text`` with every Sphinx role turned into a Markdown code span."""

    def replace(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    return ROLE.sub(replace, text)


def comment_docstring(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment block right above line ``lineno`` (1-based), or None."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0:
        stripped = lines[index].strip()
        if not stripped.startswith("#:"):
            break
        found.append(stripped[2:].removeprefix(" "))
        index -= 1
    return "\n".join(reversed(found)) if found else None


def built_docstring(attr: griffe.Object) -> str | None:
    """The own ``__doc__`` of a public function or class that a module builds by a call."""
    if not (attr.parent and attr.parent.is_module) or attr.name.startswith("_"):
        return None
    if not isinstance(getattr(attr, "value", None), griffe.ExprCall):
        return None
    try:
        value = griffe.dynamic_import(attr.path)
    except ImportError:
        return None
    if inspect.isroutine(value) or inspect.isclass(value):
        doc = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
        return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None
    return None


class AccelDocstrings(griffe.Extension):
    """Read ``#:`` attribute comments and turn Sphinx roles into code spans."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg)

    def _walk(self, obj: griffe.Object) -> None:
        if obj.is_attribute and obj.docstring is None and obj.lineno is not None:
            filepath = obj.filepath
            lines = obj.lines_collection[filepath] if isinstance(filepath, Path) else []
            text = comment_docstring(lines, obj.lineno) or built_docstring(obj)
            if text:
                obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = convert_roles(obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member)  # type: ignore[arg-type,unused-ignore]
