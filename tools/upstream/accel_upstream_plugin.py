"""The pytest plugin of the upstream-suite harness (``tools/upstream_suite.py``).

Loaded with ``-p accel_upstream_plugin`` in both runs (accel and the Accelerate calibration),
it does three things and nothing else:

- deselects the tests of ``adaptations.toml`` (tests Accelerate itself cannot pass on a 2-core
  CPU machine without network), and fails the run if an entry matches no test;
- for accel only, serves Accelerate's test programs (the extracted, renamed
  ``test_utils/scripts``) as ``accel.test_utils.scripts``, binds ``test_script``,
  ``test_sync`` and ``test_ops`` on ``accel.test_utils`` as Accelerate's ``__init__`` does,
  and resolves ``path_in_accelerate_package("test_utils", "scripts", ...)`` there: the
  programs belong to Accelerate's test suite, not to accel;
- records every test's outcome by node id into ``<run dir>/pytest-results.json``.
"""

from __future__ import annotations

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
_RESULTS: dict[str, dict[str, str]] = {}


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


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = RUN_DIR / "pytest-results.json"
    out.write_text(json.dumps(_RESULTS, indent=1, sort_keys=True), encoding="utf-8")
