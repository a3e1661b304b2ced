"""Tests for tools/check_sizes.py: what counts as a line of code, and the report."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "check_sizes.py"


@pytest.fixture(scope="module")
def sizes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_sizes", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_sizes"] = module
    spec.loader.exec_module(module)
    return module


def _function(body_lines: int, *, docstring_lines: int = 0, comments: int = 0) -> str:
    doc = ['    """Doc.'] + ["    more"] * docstring_lines + ['    """'] if docstring_lines else []
    body = [f"    x{i} = {i}" for i in range(body_lines)]
    return "\n".join(["def f():", *doc, *(["    # why"] * comments), "", *body]) + "\n"


def test_docstrings_comments_and_blanks_do_not_count(sizes: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(_function(79, docstring_lines=40, comments=30))
    assert sizes.check_file(path, 800, 80) == []  # def line + 79 statements = 80


def test_a_function_one_line_over_is_reported(sizes: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(_function(80))
    [finding] = sizes.check_file(path, 800, 80)
    assert (finding.line, finding.what, finding.size, finding.limit) == (1, "function f()", 81, 80)


def test_methods_and_nested_functions_are_named(sizes: ModuleType, tmp_path: Path) -> None:
    inner = textwrap.indent(_function(5).replace("def f", "def inner"), "        ")
    path = tmp_path / "m.py"
    path.write_text(f"class C:\n    def method(self):\n{inner}        return inner\n")
    names = {finding.what for finding in sizes.check_file(path, 800, 3)}
    assert names == {"function C.method()", "function C.method.inner()"}


def test_module_length_counts_every_line(sizes: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("# c\n" * 801)
    [finding] = sizes.check_file(path, 800, 80)
    assert (finding.what, finding.size) == ("module", 801)


def test_main_exit_code_and_message(
    sizes: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(_function(3))
    bad.write_text(_function(10))
    assert sizes.main([str(good)]) == 0
    assert sizes.main(["--max-function-lines", "5", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "bad.py:1: function f() has 11 lines (limit 5)" in captured.out
    assert "good.py" not in captured.out
    assert "split the module" in captured.err


def test_the_repository_is_within_the_limits(sizes: ModuleType) -> None:
    assert sizes.main([]) == 0
