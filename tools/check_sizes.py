"""Fail when shipped source grows past the size limits of docs/conventions.md.

Usage (the lint session runs it with no arguments)::

    python tools/check_sizes.py [--max-module-lines 800] [--max-function-lines 80] [PATH ...]

It reads every ``*.py`` file under ``packages/*/src`` (or the given files and folders) and
reports, one line each:

* a module longer than ``--max-module-lines`` lines (every line counts);
* a function or method whose *code* is longer than ``--max-function-lines`` lines. Code lines
  are the lines of the ``def`` through its last statement, less its docstring, comment-only
  lines and blank lines: a long explanation never pushes a function over the limit, only logic
  does. A nested function counts inside its parent as well as on its own.

ruff's complexity rules (C901, PLR0912/0913/0915 in pyproject.toml) bound the branches,
arguments and statements; this check bounds what they cannot, the length. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Finding:
    """One limit exceeded: where, what, and by how much."""

    path: Path
    line: int
    what: str
    size: int
    limit: int

    def __str__(self) -> str:
        try:
            shown = self.path.relative_to(REPO_ROOT)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.what} has {self.size} lines (limit {self.limit})"


def _docstring_lines(node: ast.AST) -> range:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return range(first.lineno, (first.end_lineno or first.lineno) + 1)
    return range(0)


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """The lines of ``node`` that hold code: not its docstring, a comment or a blank line."""
    docstring = _docstring_lines(node)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    count = 0
    for number in range(start, (node.end_lineno or node.lineno) + 1):
        text = lines[number - 1].strip()
        if number in docstring or not text or text.startswith("#"):
            continue
        count += 1
    return count


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""

    def visit(
        node: ast.AST, prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def check_file(path: Path, max_module: int, max_function: int) -> list[Finding]:
    """The limits ``path`` exceeds (none when it is within all of them)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    findings = []
    if len(lines) > max_module:
        findings.append(Finding(path, 1, "module", len(lines), max_module))
    for name, node in _functions(ast.parse(text, filename=str(path))):
        size = code_lines(node, lines)
        if size > max_function:
            findings.append(Finding(path, node.lineno, f"function {name}()", size, max_function))
    return findings


def _python_files(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(path.rglob("*.py")))
        elif path.suffix == ".py":
            found.append(path)
        else:
            raise SystemExit(f"check_sizes: {path} is neither a folder nor a .py file")
    return found


def main(argv: list[str] | None = None) -> int:
    """Check the files and print one line per limit exceeded; 1 when there is any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="files or folders (default: src)")
    parser.add_argument("--max-module-lines", type=int, default=MAX_MODULE_LINES)
    parser.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES)
    args = parser.parse_args(argv)
    roots = args.paths or sorted(REPO_ROOT.glob("packages/*/src"))
    if not roots:
        raise SystemExit("check_sizes: no packages/*/src folder found")
    findings = [
        finding
        for path in _python_files(roots)
        for finding in check_file(path, args.max_module_lines, args.max_function_lines)
    ]
    for finding in findings:
        print(finding)
    if findings:
        print(
            f"check_sizes: {len(findings)} over the limits; split the module along its concepts "
            "or the function into named steps (docs/conventions.md)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
