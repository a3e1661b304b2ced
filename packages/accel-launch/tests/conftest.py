"""Fixtures shared by accel-launch's tests: every test leaves no state behind."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_launch import settings as settings_module
from accel_state import engine_requests
from accel_state.testing import clean_state, require_reasons


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons and the process group; fail on leaked variables or threads."""
    with clean_state(check_leaks=True):
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``torch_feature(...)`` on a torch without those features."""
    for mark in item.iter_markers("torch_feature"):
        reasons = require_reasons(torch_features=tuple(mark.args))
        if reasons:
            pytest.skip("; ".join(reasons))


@pytest.fixture
def engines_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend every engine of the table is implemented: the paths it takes once it lands."""
    table = {
        key: dataclasses.replace(spec, available=True)
        for key, spec in engine_requests.ENGINES.items()
    }
    monkeypatch.setattr(engine_requests, "ENGINES", table)


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A training script that exists (launches are planned or dry-run, not started)."""
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def launch_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No config file, no engine or SLURM variable from this shell, 8 physical cores."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in list(os.environ):
        if name.startswith(("FSDP_", "ACCEL_DEEPSPEED", "ACCEL_USE_", "ACCELERATE_", "SLURM_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_physical_cores", lambda: 8)
