"""``accel.test_utils``: what users' own test suites import from ``accelerate.test_utils``.

The decorators skip by what the machine has, the helpers do what they say (and fail when the
subprocess or the block does not), the test-case class leaves no state behind, and importing
the module needs nothing beyond accel (checked in test_surface.py's fresh interpreter).
"""

from __future__ import annotations

import sys
import unittest

import pytest
import torch
from torch.utils.data import DataLoader

from accel.test_utils import (
    RegressionDataset,
    RegressionModel,
    assert_exception,
    execute_subprocess_async,
    get_launch_command,
    require_cpu,
    require_cuda,
    require_non_cpu,
    slow,
)
from accel.test_utils.testing import AccelerateTestCase
from accel_state import AcceleratorState, PartialState


def _outcome(decorated: type) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(decorated).run(result)
    return result


def _case(decorator: object) -> type:
    class Case(unittest.TestCase):
        @decorator  # type: ignore[misc]
        def test_it(self) -> None:
            pass

    return Case


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_decorators_skip_by_what_the_machine_has() -> None:
    assert len(_outcome(_case(require_cuda)).skipped) == 1
    assert len(_outcome(_case(require_non_cpu)).skipped) == 1
    ran = _outcome(_case(require_cpu))
    assert ran.testsRun == 1 and not ran.skipped


def test_slow_runs_only_with_run_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUN_SLOW", raising=False)
    assert len(_outcome(_case(slow)).skipped) == 1
    monkeypatch.setenv("RUN_SLOW", "yes")
    assert not _outcome(_case(slow)).skipped


def test_regression_data_and_model_train() -> None:
    data = RegressionDataset(length=32, seed=0)
    assert len(data) == 32 and data[3]["x"] == RegressionDataset(length=32, seed=0)[3]["x"]
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        for batch in DataLoader(data, batch_size=8):
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert abs(model.a.item() - 2) < 0.2 and abs(model.b.item() - 3) < 0.2


def test_launch_command_spells_accels_flags() -> None:
    command = get_launch_command(num_processes=2, cpu=True, mixed_precision=None)
    assert command == ["accel", "launch", "--num_processes=2", "--cpu"]


def test_execute_subprocess_async_returns_the_output_and_fails_loudly() -> None:
    done = execute_subprocess_async(
        [sys.executable, "-c", "print('out'); import sys; print('err', file=sys.stderr)"],
        quiet=True,
    )
    assert done.returncode == 0 and done.stdout == ["out"] and done.stderr == ["err"]
    with pytest.raises(RuntimeError, match="err"):
        execute_subprocess_async([sys.executable, "-c", "raise SystemExit('err')"], quiet=True)


def test_assert_exception_checks_the_class_and_the_message() -> None:
    with assert_exception(ValueError, "bad"):
        raise ValueError("a bad value")
    with pytest.raises(AssertionError, match="ran without issue"), assert_exception(ValueError):
        pass
    with pytest.raises(AssertionError, match="Expected message"):
        with assert_exception(ValueError, "other"):
            raise ValueError("a bad value")


def test_accelerate_test_case_leaves_no_state_behind() -> None:
    class Case(AccelerateTestCase):
        def test_builds_state(self) -> None:
            AcceleratorState(cpu=True)

    assert not _outcome(Case).errors
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}
