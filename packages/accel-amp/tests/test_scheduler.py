"""AcceleratedScheduler on one process: it advances only when the optimizer really stepped.

Golden values follow Accelerate's scheduler tests: a ``LambdaLR`` of ``1 - n/10`` at lr 1.0
reads 0.9 after one optimizer step, and a linear schedule sized for the number of optimizer
steps ends at 0 on the last iteration whatever the accumulation.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from accel_amp import AcceleratedOptimizer, AcceleratedScheduler, GradientAccumulationPlugin
from accel_state import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def _cpu_state() -> None:
    """One CPU process."""
    AcceleratorState(cpu=True)


def _linear(step: int) -> float:
    return 1 - step / 10


def _setup(
    lr_lambda: Any = _linear,
    scaler: Any = None,
    **kwargs: Any,
) -> tuple[torch.nn.Linear, AcceleratedOptimizer, AcceleratedScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda)
    opt = AcceleratedOptimizer(inner, scaler=scaler)
    return model, opt, AcceleratedScheduler(scheduler, opt, **kwargs)


def _backward(model: torch.nn.Module, scaler: Any = None) -> None:
    loss = model(torch.ones(4, 3)).sum()
    if scaler is not None:
        loss = scaler.scale(loss)
    loss.backward()


class _CountingScheduler:
    """A custom scheduler: only ``step()``, no ``optimizer`` attribute."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self) -> None:
        self.calls += 1


# --- stepping -----------------------------------------------------------------------------------


def test_one_optimizer_step_advances_the_schedule_once() -> None:
    _, opt, scheduler = _setup()
    assert scheduler.get_last_lr() == [1.0]
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.9)


def test_split_batches_steps_once_per_call() -> None:
    _, opt, scheduler = _setup(split_batches=True)
    for expected in (0.9, 0.8):
        opt.step()
        scheduler.step()
        assert scheduler.get_last_lr() == pytest.approx([expected])


def test_no_step_while_gradients_accumulate() -> None:
    _, opt, scheduler = _setup()
    GradientState()._set_sync_gradients(False)
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]
    assert scheduler.last_epoch == 0
    GradientState()._set_sync_gradients(True)
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_step_with_optimizer_false_steps_on_every_call() -> None:
    _, opt, scheduler = _setup(step_with_optimizer=False)
    GradientState()._set_sync_gradients(False)
    for _ in range(3):
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.7])


def test_step_with_optimizer_false_accepts_an_unprepared_optimizer() -> None:
    inner = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    scheduler = AcceleratedScheduler(
        torch.optim.lr_scheduler.LambdaLR(inner, _linear), None, step_with_optimizer=False
    )
    inner.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize(
    ("adjust_scheduler", "expected"),
    [
        (False, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]),
        (True, [1.0, 0.9, 0.9, 0.8, 0.8, 0.7]),
    ],
)
def test_adjust_scheduler_chooses_micro_batches_or_optimizer_steps(
    adjust_scheduler: bool, expected: list[float]
) -> None:
    state = GradientState(
        GradientAccumulationPlugin(num_steps=2, adjust_scheduler=adjust_scheduler)
    )
    _, opt, scheduler = _setup()
    seen = []
    for _ in range(6):
        state.advance()
        opt.step()
        scheduler.step()
        seen.append(scheduler.get_last_lr()[0])
    assert seen == pytest.approx(expected)


def test_no_step_after_an_fp16_overflow() -> None:
    scaler = torch.amp.GradScaler("cpu")
    model, opt, scheduler = _setup(scaler=scaler)
    _backward(model, scaler)
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0]

    opt.zero_grad()
    _backward(model, scaler)
    opt.step()
    assert not opt.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])


def test_one_cycle_lr_is_capped_at_its_total_steps() -> None:
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(inner, max_lr=1.0, total_steps=5)
    opt = AcceleratedOptimizer(inner)
    scheduler = AcceleratedScheduler(one_cycle, opt)
    lrs = []
    for _ in range(8):
        opt.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert scheduler.last_epoch == 5
    assert lrs[5:] == [lrs[4]] * 3
    with pytest.raises(ValueError):  # what the cap protects from
        one_cycle.step()


# --- the prepared-optimizer check -----------------------------------------------------------------


def test_scheduler_of_an_unprepared_optimizer_is_rejected() -> None:
    model = torch.nn.Linear(3, 2)
    other = torch.optim.Adam(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(other, _linear)
    prepared = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="not prepared") as info:
        AcceleratedScheduler(scheduler, prepared)
    assert "Adam" in str(info.value)


@pytest.mark.parametrize("optimizers", ["raw", "empty"])
def test_raw_or_missing_optimizer_is_not_prepared(optimizers: str) -> None:
    inner = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, _linear)
    passed: Any = inner if optimizers == "raw" else []
    with pytest.raises(ValueError, match="not prepared") as info:
        AcceleratedScheduler(scheduler, passed)
    assert "SGD" in str(info.value)


def test_scheduler_built_on_the_prepared_optimizer_is_accepted() -> None:
    opt = AcceleratedOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0))
    scheduler = AcceleratedScheduler(torch.optim.lr_scheduler.LambdaLR(opt, _linear), [opt])
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])


def test_scheduler_found_among_several_prepared_optimizers() -> None:
    model = torch.nn.Linear(3, 2)
    first = AcceleratedOptimizer(torch.optim.SGD([model.weight], lr=1.0))
    second = AcceleratedOptimizer(torch.optim.SGD([model.bias], lr=1.0))
    inner_scheduler = torch.optim.lr_scheduler.LambdaLR(second.optimizer, _linear)
    scheduler = AcceleratedScheduler(inner_scheduler, (first, second))
    second.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.9])


def test_custom_scheduler_without_optimizer_is_accepted_and_gated() -> None:
    opt = AcceleratedOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0))
    custom = _CountingScheduler()
    scheduler = AcceleratedScheduler(custom, opt)
    GradientState()._set_sync_gradients(False)
    scheduler.step()
    assert custom.calls == 0
    GradientState()._set_sync_gradients(True)
    scheduler.step()
    assert custom.calls == 1


# --- passthrough and persistence ----------------------------------------------------------------


def test_state_dict_round_trip() -> None:
    _, opt, scheduler = _setup()
    for _ in range(3):
        opt.step()
        scheduler.step()
    saved = scheduler.state_dict()
    assert saved["last_epoch"] == 3

    _, fresh_opt, fresh = _setup()
    fresh.load_state_dict(saved)
    assert fresh.last_epoch == 3
    assert fresh.get_last_lr() == pytest.approx([0.7])
    for optimizer, sched in ((opt, scheduler), (fresh_opt, fresh)):
        optimizer.step()
        sched.step()
    assert fresh.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    assert fresh.get_last_lr() == pytest.approx([0.6])


def test_attributes_pass_through_to_the_inner_scheduler() -> None:
    _, opt, scheduler = _setup()
    assert isinstance(scheduler.get_last_lr(), list)
    assert scheduler.base_lrs == [1.0]
    assert scheduler.last_epoch == 0
    opt.step()
    scheduler.step()
    assert scheduler.last_epoch == 1
    assert scheduler.last_epoch == scheduler.scheduler.last_epoch
    with pytest.raises(AttributeError):
        _ = scheduler.no_such_attribute


def test_pickle_round_trip() -> None:
    _, opt, scheduler = _setup()
    opt.step()
    scheduler.step()
    opt_copy, copy = pickle.loads(pickle.dumps((opt, scheduler)))
    assert isinstance(copy, AcceleratedScheduler)
    assert copy.get_last_lr() == pytest.approx([0.9])
    assert copy.optimizers[0] is opt_copy
    assert copy.scheduler.optimizer is opt_copy.optimizer

    GradientState()._set_sync_gradients(False)
    copy.step()
    assert copy.get_last_lr() == pytest.approx([0.9])
    GradientState()._set_sync_gradients(True)
    opt_copy.step()
    copy.step()
    assert copy.get_last_lr() == pytest.approx([0.8])
    assert opt_copy.param_groups[0]["lr"] == pytest.approx(0.8)
    assert scheduler.get_last_lr() == pytest.approx([0.9])  # the original is untouched


# --- Accelerate's accumulation golden ------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_linear_schedule_ends_at_zero_on_the_last_iteration(num_steps: int) -> None:
    GradientState._reset_state()
    plugin = GradientAccumulationPlugin(num_steps=num_steps, adjust_scheduler=num_steps > 1)
    state = GradientState(plugin)
    _, opt, scheduler = _setup(lambda n: max(0.0, 1 - n / 10))
    lrs = []
    for _ in range(10 * num_steps):
        state.advance()
        opt.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[-1] == 0.0
    assert lrs[-2] > 0.0
