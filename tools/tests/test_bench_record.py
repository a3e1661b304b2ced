"""Tests for tools/bench/record.py: the result file a benchmark's --json writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "record.py"


@pytest.fixture(scope="module")
def record() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_record", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_record"] = module
    spec.loader.exec_module(module)
    return module


def test_the_file_holds_command_date_machine_and_results(
    record: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = ROOT / "tools" / "bench" / "train_step.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--pairs", "4", "--json", "out file.json"])
    path = tmp_path / "results" / "x.json"
    record.write_record(path, "train_step", {"rows": [1.5, float("nan")], "n": 2})
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == 1 and data["benchmark"] == "train_step"
    # the script as a path from the repository root, arguments quoted for a shell
    assert data["command"] == "python tools/bench/train_step.py --pairs 4 --json 'out file.json'"
    assert data["date"].endswith("+00:00")
    assert data["machine"]["cpus"] and data["machine"]["cpu"]
    assert data["results"] == {"rows": [1.5, None], "n": 2}  # NaN is not JSON: null


def test_a_script_outside_the_repository_keeps_its_absolute_path(record: ModuleType) -> None:
    assert record.command(["/opt/x.py", "-q"]) == "python /opt/x.py -q"
