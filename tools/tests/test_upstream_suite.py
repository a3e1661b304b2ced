"""Tests for tools/upstream_suite.py: the rename, the comparison rules and the report check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "upstream_suite.py"


@pytest.fixture(scope="module")
def suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("upstream_suite", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["upstream_suite"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("from accelerate.utils import gather", "from accel.utils import gather"),
        ('patch("accelerate.commands.estimate.x")', 'patch("accel.commands.estimate.x")'),
        ("os.environ['ACCELERATE_USE_CPU']", "os.environ['ACCEL_USE_CPU']"),
        ("patch_environment(accelerate_debug_mode=1)", "patch_environment(accel_debug_mode=1)"),
        ("cmd = ['accelerate', 'launch']", "cmd = ['accel', 'launch']"),
        # Accelerate's public names that merely contain the word stay.
        ("path_in_accelerate_package('x')", "path_in_accelerate_package('x')"),
        ("class T(AccelerateTestCase):", "class T(AccelerateTestCase):"),
        ("model._is_accelerate_prepared", "model._is_accelerate_prepared"),
    ],
)
def test_rename_is_the_users_mechanical_rename(suite: ModuleType, before: str, after: str) -> None:
    assert suite.rename(before) == after


def _results(**outcomes: str) -> dict[str, dict[str, str]]:
    return {test: {"outcome": outcome, "message": "m"} for test, outcome in outcomes.items()}


EXPECTED = {"tests/a.py::t": {"compat": "row text", "why": "because"}}


def test_a_listed_failure_with_its_compat_row_is_accepted(suite: ModuleType) -> None:
    results = _results(**{"tests/a.py::t": "failed", "tests/b.py::u": "passed"})
    assert suite.compare("accel", results, EXPECTED, "... row text ...") == []


def test_an_unlisted_failure_fails_the_run(suite: ModuleType) -> None:
    results = _results(**{"tests/a.py::t": "failed", "tests/b.py::u": "failed"})
    (problem,) = suite.compare("accel", results, EXPECTED, "row text")
    assert problem.startswith("unexpected failure: tests/b.py::u")


@pytest.mark.parametrize("outcome", ["passed", "skipped", None])
def test_a_listed_test_that_no_longer_fails_is_stale(
    suite: ModuleType, outcome: str | None
) -> None:
    results = _results(**({"tests/a.py::t": outcome} if outcome else {}))
    (problem,) = suite.compare("accel", results, EXPECTED, "row text")
    assert problem.startswith("stale entry: tests/a.py::t")


def test_a_selection_does_not_call_the_listed_tests_it_left_out_stale(suite: ModuleType) -> None:
    results = _results(**{"tests/b.py::u": "passed"})  # a --gpu run: tests/a.py::t not selected
    assert suite.compare("accel", results, EXPECTED, "row text", partial=True) == []
    results = _results(**{"tests/a.py::t": "passed"})  # selected, and no longer failing
    (problem,) = suite.compare("accel", results, EXPECTED, "row text", partial=True)
    assert problem.startswith("stale entry: tests/a.py::t now passed")


GATED_SOURCE = """
@require_cuda
class Gated(TestCase):
    def test_a(self): ...

class Mixed(TestCase):
    @require_non_cpu
    def test_b(self): ...

    @parameterized.expand([1, 2])
    @require_cuda
    def test_c(self, x): ...

    @require_fp16
    def test_d(self): ...

@require_single_device
def test_e(): ...

def test_f(): ...
"""


def test_the_gpu_selection_reads_the_gates_from_the_source(suite: ModuleType) -> None:
    path = Path(__file__).resolve().parents[1] / "upstream" / "accel_upstream_plugin.py"
    spec = importlib.util.spec_from_file_location("accel_upstream_plugin_under_test", path)
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    gated, defined = plugin.gated_names(GATED_SOURCE, frozenset(suite.GPU_GATES))
    assert gated == {"Gated", "Mixed.test_b", "Mixed.test_c", "test_e"}
    assert {"Gated.test_a", "Mixed.test_d", "test_f"} <= defined


def _sdist(path: Path, files: dict[str, str]) -> Path:
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_given_sdist_is_extracted_and_its_gpu_files_found(
    suite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suite, "WORK", tmp_path / "work")
    prefix = f"accelerate-{suite.VERSION}/tests/"
    sdist = _sdist(
        tmp_path / "s.tar.gz",
        {
            prefix + "test_hooks.py": "from accelerate import x\n@require_cuda\ndef test(): ...\n",
            prefix + "test_cpu.py": "def test(): ...\n",
        },
    )
    dest = suite.extract(sdist, "accel", "accel-gpu")
    assert dest == tmp_path / "work" / "accel-gpu"
    assert (dest / "tests" / "test_hooks.py").read_text().startswith("from accel import x")
    assert suite.gpu_files(dest) == ("test_hooks.py",)


def test_an_archive_that_is_not_the_sdist_is_refused(
    suite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suite, "WORK", tmp_path / "work")
    other = _sdist(tmp_path / "other.tar.gz", {"accelerate-0.1.0/tests/test_a.py": ""})
    with pytest.raises(SystemExit, match="holds no accelerate-1.15.0/tests/"):
        suite.extract(other, "accel")
    (tmp_path / "plain.txt").write_text("not an archive")
    with pytest.raises(SystemExit, match="cannot read the sdist"):
        suite.extract(tmp_path / "plain.txt", "accel")


def test_a_listed_test_needs_its_row_in_compat_md(suite: ModuleType) -> None:
    results = _results(**{"tests/a.py::t": "failed"})
    (problem,) = suite.compare("accel", results, EXPECTED, "another text")
    assert "is not in docs/compat.md" in problem


def test_any_failure_of_accelerate_itself_means_the_harness_is_unfair(suite: ModuleType) -> None:
    results = _results(**{"tests/a.py::t": "failed", "tests/b.py::u": "passed"})
    (problem,) = suite.compare("accelerate", results, EXPECTED, "row text")
    assert problem.startswith("unfair harness: Accelerate itself fails tests/a.py::t")


def test_summary_counts_per_file_and_the_scripts_together(suite: ModuleType) -> None:
    results = _results(
        **{
            "tests/a.py::t1": "passed",
            "tests/a.py::t2": "skipped",
            "tests/b.py": "failed",
            "scripts/test_ops.py": "passed",
            "scripts/test_sync.py": "passed",
        }
    )
    assert suite.summarise(results) == {
        "scripts (2 processes)": {"passed": 2, "failed": 0, "skipped": 0},
        "tests/a.py": {"passed": 1, "failed": 0, "skipped": 1},
        "tests/b.py": {"passed": 0, "failed": 1, "skipped": 0},
    }


def test_the_expectation_file_lists_each_test_once_with_a_reason(suite: ModuleType) -> None:
    expected = suite.load_expected()
    assert expected, "tools/upstream/expected.toml lists no test"
    compat = suite.COMPAT.read_text(encoding="utf-8")
    for test, entry in expected.items():
        assert test.startswith("tests/") and entry["why"]
        assert entry["compat"] in compat, test


def test_a_program_past_its_timeout_is_stopped_with_its_children(
    suite: ModuleType, tmp_path: Path
) -> None:
    import os
    import time

    pid_file = tmp_path / "child.pid"
    program = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "run.log"
    code = suite._run_logged([sys.executable, "-c", program], tmp_path, os.environ, log, 3.0)
    assert code is None
    child = int(pid_file.read_text())
    status = Path(f"/proc/{child}/status")
    for _ in range(50):  # killed: gone, or a zombie until its new parent reaps it
        try:
            if "\tZ" in status.read_text().split("State:")[1].splitlines()[0]:
                break
        except (FileNotFoundError, ProcessLookupError, IndexError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the program's child {child} outlived the timeout")
    assert suite._run_logged([sys.executable, "-c", "pass"], tmp_path, os.environ, log, 30) == 0
