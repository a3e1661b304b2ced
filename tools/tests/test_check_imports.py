"""Tests for tools/check_imports.py's forked imports: each module in a child of a zygote that
has imported torch must be judged as a fresh interpreter judges it (tools/tests run where
torch is installed: the lint session)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "check_imports.py"
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    return module


# json: imports; no_such_module_ab12: missing; xmlrpc.server: brings the forbidden xmlrpc
# along; this: prints the Zen of Python on import (into the reports' channel, were it not
# redirected); wave: imports (nothing forbidden)
STDLIB = ["json", "no_such_module_ab12", "xmlrpc.server", "this", "wave"]
FORBID = ["xmlrpc", "deepspeed"]


def _judged(outcomes: list) -> list[tuple[str, bool, tuple[str, ...], bool]]:
    return [(o.module, o.ok, o.leaked, "ModuleNotFoundError" in o.error) for o in outcomes]


def test_forked_imports_judge_each_module_as_a_fresh_interpreter_does(
    checker: ModuleType,
) -> None:
    forked = checker.import_all_forked(STDLIB, FORBID, 60.0, 2)
    assert forked is not None
    fresh = [checker.import_one(module, FORBID, 60.0) for module in STDLIB]
    assert _judged(forked) == _judged(fresh)
    assert _judged(forked) == [
        ("json", True, (), False),
        ("no_such_module_ab12", False, (), True),
        ("xmlrpc.server", True, ("xmlrpc",), False),
        ("this", True, (), False),
        ("wave", True, (), False),
    ]
    assert forked[0].file is not None and forked[0].file.endswith("json/__init__.py")


MODULES = {
    "hangs": "import time\ntime.sleep(60)\n",
    "dies": "import os\nos._exit(3)\n",
    "raises": "raise RuntimeError('broken at import')\n",
    "reads_stdin": "import sys\nDATA = sys.stdin.read()\n",
    "prints_a_report": 'print(\'{"module": "fake", "ok": true}\')\n',
    "fine": "VALUE = 1\n",
}


def test_hangs_deaths_and_errors_are_reported_and_the_rest_still_run(
    checker: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, body in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body), encoding="utf-8")
    monkeypatch.setenv("CHECK_IMPORTS_TEST_PATH", str(tmp_path))
    names = list(MODULES)
    outcomes = checker.import_all_forked(names, FORBID, 5.0, 2)
    assert outcomes is not None
    by_name = {o.module: o for o in outcomes}
    assert [o.module for o in outcomes] == names
    assert not by_name["hangs"].ok and "timed out after 5s" in by_name["hangs"].error
    assert not by_name["dies"].ok and "status" in by_name["dies"].error
    assert not by_name["raises"].ok and "broken at import" in by_name["raises"].error
    for name in ("reads_stdin", "prints_a_report", "fine"):
        assert by_name[name].ok, by_name[name]
        assert by_name[name].file == str(tmp_path / f"{name}.py")


def test_where_torch_is_or_brings_a_forbidden_module_fresh_interpreters_are_used(
    checker: ModuleType,
) -> None:
    assert checker.import_all_forked(["json"], ["torch"], 60.0, 1) is None
    # torch's import loads email (importlib.metadata): a zygote could not tell who did
    assert checker.import_all_forked(["json"], ["email"], 60.0, 1) is None
