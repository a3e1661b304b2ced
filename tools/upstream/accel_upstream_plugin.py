"""The pytest plugin of the upstream-suite harness (``tools/upstream_suite.py``).

Loaded with ``-p accel_upstream_plugin`` in both runs (accel and the Accelerate calibration),
it does four things and nothing else:

- deselects the tests of ``adaptations.toml`` (tests Accelerate itself cannot pass on a 2-core
  CPU machine without network), and fails the run if an entry matches no test;
- with ``ACCEL_UPSTREAM_SELECT=gpu`` (``upstream_suite.py --gpu``), keeps only the tests that
  carry one of the decorators named in ``ACCEL_UPSTREAM_GPU_GATES`` (Accelerate's
  ``require_cuda``, ``require_non_cpu``, ...), on the test function or on its class, read from
  the test file's source: on a GPU machine the decorators have already let the tests through,
  so only the source still says which ones they gate;
- for accel only, serves Accelerate's test programs (the extracted, renamed
  ``test_utils/scripts``) as ``accel.test_utils.scripts``, binds ``test_script``,
  ``test_sync`` and ``test_ops`` on ``accel.test_utils`` as Accelerate's ``__init__`` does,
  and resolves ``path_in_accelerate_package("test_utils", "scripts", ...)`` there: the
  programs belong to Accelerate's test suite, not to accel;
- records every test's outcome by node id into ``<run dir>/pytest-results.json`` (with
  ``--gpu``, after every test, so that a run cut by its timeout keeps what it did).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

LIB = os.environ.get("ACCEL_UPSTREAM_LIB", "")
RUN_DIR = Path(os.environ.get("ACCEL_UPSTREAM_DIR", "."))
ADAPTATIONS = Path(os.environ.get("ACCEL_UPSTREAM_ADAPTATIONS", "adaptations.toml"))
SELECT = os.environ.get("ACCEL_UPSTREAM_SELECT", "")
GATES = frozenset(filter(None, os.environ.get("ACCEL_UPSTREAM_GPU_GATES", "").split(",")))
_RESULTS: dict[str, dict[str, str]] = {}
_GATED: dict[Path, tuple[set[str], set[str]]] = {}


def _serve_scripts() -> None:
    try:
        import accel.test_utils as test_utils
        from accel.test_utils import testing
    except ImportError as error:  # every test importing it then fails to collect, as it should
        print(f"accel_upstream_plugin: cannot serve the test programs: {error}")
        return

    overlay = RUN_DIR / "overlay"
    test_utils.__path__.append(str(overlay))
    for name in ("test_script", "test_sync", "test_ops"):
        setattr(test_utils, name, importlib.import_module(f"accel.test_utils.scripts.{name}"))
    original = testing.path_in_accelerate_package

    def path_in_accelerate_package(*components: str) -> Path:
        if components[:2] == ("test_utils", "scripts"):
            return overlay.joinpath(*components[1:])
        return original(*components)

    testing.path_in_accelerate_package = path_in_accelerate_package
    test_utils.path_in_accelerate_package = path_in_accelerate_package


def pytest_configure(config: pytest.Config) -> None:
    if LIB == "accel":
        _serve_scripts()


def _deselections() -> list[tuple[str, str]]:
    data = tomllib.loads(ADAPTATIONS.read_text(encoding="utf-8"))
    return [(test, entry["why"]) for entry in data.get("deselect", []) for test in entry["tests"]]


def _matches(nodeid: str, prefix: str) -> bool:
    return nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "["))


def _decorator_names(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def gated_names(source: str, gates: frozenset[str]) -> tuple[set[str], set[str]]:
    """(gated names, defined names) of a test file's classes and functions.

    Names are ``Class`` (a gated class), ``Class.test`` and ``test`` (module level).
    """
    gated: set[str] = set()
    defined: set[str] = set()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            if _decorator_names(node) & gates:
                gated.add(node.name)
            for item in node.body:
                if isinstance(item, functions):
                    defined.add(f"{node.name}.{item.name}")
                    if _decorator_names(item) & gates:
                        gated.add(f"{node.name}.{item.name}")
        elif isinstance(node, functions):
            defined.add(node.name)
            if _decorator_names(node) & gates:
                gated.add(node.name)
    return gated, defined


def is_gated(item: pytest.Item) -> bool:
    """Whether the test (or its class, or a base class in the file) carries a gate."""
    path = Path(str(item.path))
    if path not in _GATED:
        _GATED[path] = gated_names(path.read_text(encoding="utf-8"), GATES)
    gated, defined = _GATED[path]
    name = getattr(item, "originalname", item.name)
    cls = getattr(item, "cls", None)
    owners = [klass.__name__ for klass in cls.__mro__] if cls is not None else [""]
    for owner in owners:
        if owner and owner in gated:
            return True
        qualified = f"{owner}.{name}" if owner else name
        if qualified in gated:
            return True
        if qualified in defined:
            return False
        # parameterized.expand's generated tests: ``<gated test>_<suffix>``
        prefix = f"{owner}." if owner else ""
        for entry in gated:
            base = entry[len(prefix) :] if entry.startswith(prefix) else None
            if base and "." not in base and name.startswith(base + "_"):
                return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselections = _deselections()
    used = set()
    kept, removed = [], []
    for item in items:
        hit = next((prefix for prefix, _ in deselections if _matches(item.nodeid, prefix)), None)
        if hit is None:
            kept.append(item)
        else:
            used.add(hit)
            removed.append(item)
    # Entries of a file that failed to collect cannot match: that failure is reported instead.
    collected = {item.nodeid.split("::", 1)[0] for item in items}
    unused = [
        prefix
        for prefix, _ in deselections
        if prefix not in used and prefix.split("::", 1)[0] in collected
    ]
    if unused:
        raise pytest.UsageError(
            f"{ADAPTATIONS.name}: these entries match no collected test (stale): {unused}"
        )
    if SELECT == "gpu":
        removed += [item for item in kept if not is_gated(item)]
        kept = [item for item in kept if is_gated(item)]
    if removed:
        config.hook.pytest_deselected(items=removed)
        items[:] = kept


def _message(report: Any) -> str:
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _RESULTS[report.nodeid] = {"outcome": "failed", "message": _message(report)}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _RESULTS.get(report.nodeid)
    if report.when == "setup" or entry is None:
        entry = {"outcome": "passed", "message": ""}
        _RESULTS[report.nodeid] = entry
    if entry["outcome"] == "failed":
        return
    if report.failed:
        entry.update(outcome="failed", message=_message(report))
    elif report.skipped and report.when != "teardown":
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else ""
        entry.update(outcome="skipped", message=str(reason)[:300])
    if SELECT == "gpu" and report.when == "teardown":  # a short run: keep what a timeout cuts
        _write_results()


def _write_results() -> None:
    out = RUN_DIR / "pytest-results.json"
    out.write_text(json.dumps(_RESULTS, indent=1, sort_keys=True), encoding="utf-8")


def pytest_sessionfinish(session: pytest.Session) -> None:
    _write_results()
