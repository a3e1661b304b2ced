"""AcceleratedScheduler on 2 gloo CPU ranks: one call advances the schedule once per process.

Golden values from Accelerate: a ``LambdaLR`` of ``1 - n/10`` at lr 1.0 reads 0.8 after one
optimizer step on 2 processes (each step consumed one batch per process), 0.9 when batches
are split; a linear schedule sized for 20 single-process steps ends at 0 after 10 steps.
"""

from __future__ import annotations

import pytest
import torch

from accel_amp import AcceleratedOptimizer, AcceleratedScheduler, GradientAccumulationPlugin
from accel_state import AcceleratorState, GradientState
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess


def _linear(step: int) -> float:
    return 1 - step / 10


def _linear_20(step: int) -> float:
    return max(0.0, 1 - step / 20)


def _one_step(split_batches: bool) -> tuple[int, list[float], float]:
    state = AcceleratorState(cpu=True)
    inner = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    opt = AcceleratedOptimizer(inner)
    scheduler = AcceleratedScheduler(
        torch.optim.lr_scheduler.LambdaLR(inner, _linear), opt, split_batches=split_batches
    )
    opt.step()
    scheduler.step()
    return state.num_processes, scheduler.get_last_lr(), inner.param_groups[0]["lr"]


def _accumulation() -> dict[int, list[float]]:
    AcceleratorState(cpu=True)
    runs = {}
    for num_steps in (1, 2, 4):
        GradientState._reset_state()
        plugin = GradientAccumulationPlugin(num_steps=num_steps, adjust_scheduler=num_steps > 1)
        gradient_state = GradientState(plugin)
        inner = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
        opt = AcceleratedOptimizer(inner)
        scheduler = AcceleratedScheduler(torch.optim.lr_scheduler.LambdaLR(inner, _linear_20), opt)
        lrs = []
        for _ in range(10 * num_steps):
            gradient_state.advance()
            opt.step()
            scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
        runs[num_steps] = lrs
    return runs


@pytest.mark.parametrize(("split_batches", "expected"), [(False, 0.8), (True, 0.9)])
def test_one_optimizer_step_advances_once_per_process(split_batches: bool, expected: float) -> None:
    results = run_on_cpu(_one_step, split_batches)
    for num_processes, last_lr, group_lr in results:
        assert num_processes == 2
        assert last_lr == pytest.approx([expected])
        assert group_lr == pytest.approx(expected)


def test_linear_schedule_sized_for_one_process_ends_at_zero() -> None:
    for runs in run_on_cpu(_accumulation):
        assert sorted(runs) == [1, 2, 4]
        for num_steps, lrs in runs.items():
            assert len(lrs) == 10 * num_steps
            assert lrs[-1] == 0.0, num_steps
            assert lrs[-2] > 0.0, num_steps
            # Two schedule steps per optimizer step: 1 - 2/20 once the first window closes.
            assert lrs[num_steps - 1] == pytest.approx(0.9), num_steps
