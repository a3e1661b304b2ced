"""Tests for tools/docs/check_examples.py: what each marker does, and what a failure reports."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "docs" / "check_examples.py"
FENCE = "```"


@pytest.fixture(scope="module")
def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_examples", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_examples"] = module
    spec.loader.exec_module(module)
    return module


def page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("~~~", FENCE), encoding="utf-8")
    return path


def run(checker: ModuleType, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = checker.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ---------------------------------------------------------------------------------------------
# Reading pages
# ---------------------------------------------------------------------------------------------


def test_an_unlabeled_fence_is_an_error_with_file_and_line(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(tmp_path, "# Title\n\n~~~\nprint(1)\n~~~\n")
    code, out = run(checker, capsys, str(path))
    assert code == 1
    assert f"{path}:3: code block without a language" in out


def test_an_unknown_language_is_an_error(checker: ModuleType, tmp_path: Path) -> None:
    parsed = checker.parse_page(page(tmp_path, "~~~console\n$ ls\n~~~\n"))
    assert len(parsed.errors) == 1
    assert "language 'console' is not checked" in parsed.errors[0]


def test_markers_choose_the_action(checker: ModuleType, tmp_path: Path) -> None:
    path = page(
        tmp_path,
        """
        <!-- check: syntax, needs a GPU -->
        ~~~python
        import torch
        ~~~

        <!-- check: file train.py -->

        ~~~python
        print("hi")
        ~~~

        <!-- an unrelated comment -->
        ~~~bash
        echo hi
        ~~~

        ~~~yaml
        a: 1
        ~~~

        ~~~text
        output
        ~~~
        """,
    )
    parsed = checker.parse_page(path)
    assert parsed.errors == []
    actions = [(b.language, b.action, b.detail) for b in parsed.blocks]
    assert actions == [
        ("python", "syntax", "needs a GPU"),
        ("python", "file", "train.py"),  # blank lines between marker and fence are fine
        ("bash", "run", ""),
        ("yaml", "parse", ""),
        ("text", "skip", ""),
    ]
    assert [b.line for b in parsed.blocks] == [3, 9, 14, 18, 22]


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("<!-- check: syntax -->", "bad marker"),
        ("<!-- check: syntax,   -->", "bad marker"),
        ("<!-- check: run -->", "bad marker"),
        ("<!-- check: file ../x.py -->", "give a relative path"),
    ],
)
def test_a_bad_marker_is_an_error(
    checker: ModuleType, tmp_path: Path, marker: str, message: str
) -> None:
    parsed = checker.parse_page(page(tmp_path, f"{marker}\n~~~python\nx = 1\n~~~\n"))
    assert len(parsed.errors) == 1
    assert message in parsed.errors[0] and ":2:" in parsed.errors[0]


def test_a_marker_on_a_text_block_is_an_error(checker: ModuleType, tmp_path: Path) -> None:
    parsed = checker.parse_page(page(tmp_path, "<!-- check: file a.txt -->\n~~~text\nx\n~~~\n"))
    assert parsed.errors and "text block" in parsed.errors[0]


def test_indented_and_nested_fences(checker: ModuleType, tmp_path: Path) -> None:
    path = page(
        tmp_path,
        """
        - a list item:

          ~~~python
          x = 1
          if x:
              y = 2
          ~~~

        ````text
        ~~~python
        not a block of its own
        ~~~
        ````
        """,
    )
    parsed = checker.parse_page(path)
    assert parsed.errors == []
    assert [b.language for b in parsed.blocks] == ["python", "text"]
    assert parsed.blocks[0].code == "x = 1\nif x:\n    y = 2\n"


def test_snippets_are_read_with_their_own_file_and_line(
    checker: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    page(tmp_path, "# Included\n\n~~~\nunlabeled\n~~~\n", name="INCLUDED.md")
    path = page(tmp_path, 'intro\n--8<-- "INCLUDED.md"\n', name="docs.md")
    parsed = checker.parse_page(path)
    assert parsed.errors == ["INCLUDED.md:3: code block without a language: " + _NAME_ONE]


_NAME_ONE = "name one (text for output and diagrams)"


def test_list_prints_the_plan_and_runs_nothing(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(tmp_path, "~~~python\nraise SystemExit(3)\n~~~\n")
    code, out = run(checker, capsys, str(path), "--list")
    assert code == 0
    assert f"{path}:1" in out and "python  run" in out


def test_k_selects_pages(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page(tmp_path, "~~~python\nx = 1\n~~~\n", name="one.md")
    page(tmp_path, "~~~python\nraise SystemExit(1)\n~~~\n", name="two.md")
    code, out = run(checker, capsys, str(tmp_path), "-k", "one")
    assert code == 0
    assert "one.md" in out and "two.md" not in out
    assert run(checker, capsys, str(tmp_path), "-k", "nothing-matches")[0] == 1


# ---------------------------------------------------------------------------------------------
# Running pages
# ---------------------------------------------------------------------------------------------


def test_python_blocks_share_a_namespace_and_bash_sees_their_files(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(
        tmp_path,
        """
        ~~~python
        import dataclasses
        import pickle

        @dataclasses.dataclass
        class Point:
            x: int

        value = Point(2)
        ~~~

        ~~~python
        assert pickle.loads(pickle.dumps(value)) == Point(2)  # classes live in __main__
        assert "os" not in globals() and "json" not in globals()  # the driver left nothing
        with open("made.txt", "w") as f:
            f.write("from python")
        ~~~

        ~~~bash
        grep -q "from python" made.txt
        test "$(pwd)" != "$HOME"
        python -c "import sys; print(sys.executable)"
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 0, out
    assert "3 run" in out


def test_accel_variables_are_removed_and_the_cpu_is_used(
    checker: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    path = page(
        tmp_path,
        """
        ~~~bash
        test -z "${ACCEL_MIXED_PRECISION:-}"
        test -z "${ACCELERATE_USE_CPU:-}"
        test -z "$CUDA_VISIBLE_DEVICES"
        ~~~
        ~~~python
        import os
        assert not [k for k in os.environ if k.startswith(("ACCEL_", "ACCELERATE_"))]
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 0, out


def test_a_failing_python_block_reports_page_line_block_and_output(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(
        tmp_path,
        """
        # Title

        ~~~python
        print("before the error")
        x = {}["missing"]
        ~~~

        ~~~python
        print("never runs")
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 1
    assert f"at {path}:4: python block, run" in out
    assert '      6 | x = {}["missing"]' in out
    assert "KeyError: 'missing'" in out
    assert f'File "{path}", line 6' in out  # the traceback points into the Markdown file
    assert "before the error" in out
    assert "never runs" not in out.split("output:")[-1]


def test_a_failing_bash_block_fails_on_the_first_error(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(tmp_path, "~~~bash\necho before\nfalse | true\necho after\n~~~\n")
    code, out = run(checker, capsys, str(path))
    assert code == 1
    output = out.split("output:")[-1]
    assert "bash exited with code 1" in out and "before" in output and "after" not in output


def test_syntax_blocks_compile_and_run_only_their_imports(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(
        tmp_path,
        """
        <!-- check: syntax, needs a cluster -->
        ~~~python
        import json
        from pathlib import Path
        try:
            import not_installed_on_purpose
        except ImportError:
            pass
        raise SystemExit("the body is not run")
        ~~~

        <!-- check: syntax, needs a cluster -->
        ~~~bash
        srun --nodes 64 this-command-does-not-exist
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 0, out


def test_a_failing_import_of_a_syntax_block_is_reported(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(
        tmp_path,
        """
        <!-- check: syntax, needs a GPU -->
        ~~~python
        import json

        from accel_docs_no_such_module import thing
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 1
    assert "an import of this block (marked syntax) fails" in out
    assert "ModuleNotFoundError" in out and f'File "{path}", line 6' in out


@pytest.mark.parametrize(
    ("language", "code", "message"),
    [
        ("python", "def f(:\n    pass\n", "syntax error"),
        ("bash", "if then fi\n", "bash -n"),
        ("yaml", "a: [1, 2\n", "does not parse as yaml"),
        ("toml", "a = \n", "does not parse as toml"),
        ("json", "{'a': 1}\n", "does not parse as json"),
    ],
)
def test_static_errors_are_found_before_anything_runs(
    checker: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    language: str,
    code: str,
    message: str,
) -> None:
    path = page(tmp_path, f"<!-- check: syntax, a reason -->\n~~~{language}\n{code}~~~\n")
    status, out = run(checker, capsys, str(path))
    assert status == 1
    assert message in out and f"{path}:2" in out


def test_file_blocks_are_written_not_run_and_later_blocks_use_them(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(
        tmp_path,
        """
        <!-- check: file pkg/train.py -->
        ~~~python
        import sys
        print("trained", sys.argv[1:])
        raise SystemExit(0)
        ~~~

        <!-- check: file config.yaml -->
        ~~~yaml
        num_processes: 2
        ~~~

        ~~~bash
        python pkg/train.py --epochs 1 | grep -q "trained \\['--epochs', '1'\\]"
        grep -q "num_processes: 2" config.yaml
        ~~~
        """,
    )
    code, out = run(checker, capsys, str(path))
    assert code == 0, out


def test_the_time_limit_names_the_block(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = page(tmp_path, "~~~python\nx = 1\n~~~\n\n~~~python\nimport time\ntime.sleep(60)\n~~~\n")
    code, out = run(checker, capsys, str(path), "--timeout", "3")
    assert code == 1
    assert "time limit of 3 s" in out and f"{path}:5" in out


def test_each_page_gets_a_fresh_folder_and_interpreter(
    checker: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page(tmp_path, "~~~python\nshared = 1\nopen('left.txt', 'w').close()\n~~~\n", name="a.md")
    page(
        tmp_path,
        "~~~python\nimport os\nassert 'shared' not in globals()\n"
        "assert not os.path.exists('left.txt')\n~~~\n",
        name="b.md",
    )
    code, out = run(checker, capsys, str(tmp_path), "-j", "2")
    assert code == 0, out
