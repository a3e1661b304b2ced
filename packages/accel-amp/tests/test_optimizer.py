"""AcceleratedOptimizer: a view of the inner optimizer that steps only at a window's end.

Covers the shared ``param_groups``/``state``/``defaults``, gating of ``step``/``zero_grad``
on ``GradientState.sync_gradients``, fp16 overflow handling with a CPU ``GradScaler``
(skipped step, backoff, the inner ``step`` left as it was found), state-dict round trips,
device placement, pickling and the small helpers.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch

from accel_amp import AcceleratedOptimizer, GradientAccumulationPlugin
from accel_state import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def _cpu_state() -> None:
    """Pin the run to the CPU so device placement is predictable on any machine."""
    AcceleratorState(cpu=True)


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _inputs() -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10


def _backward(model: torch.nn.Module, scaler: Any = None) -> None:
    loss = model(_inputs()).sum()
    if scaler is not None:
        loss = scaler.scale(loss)
    loss.backward()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


class _NoSetToNone(torch.optim.SGD):
    """An optimizer whose ``zero_grad`` takes no ``set_to_none`` argument."""

    def zero_grad(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None


class _ScheduleFree(torch.optim.SGD):
    """An optimizer with ``train()``/``eval()`` modes, like schedule-free optimizers."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.mode = "none"

    def train(self) -> None:
        self.mode = "train"

    def eval(self) -> None:
        self.mode = "eval"


class _FailingStep(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("boom")


# --- construction and views -------------------------------------------------------------------


def test_is_a_torch_optimizer_accepted_by_lr_schedulers() -> None:
    opt = AcceleratedOptimizer(torch.optim.SGD(_model().parameters(), lr=1.0))
    assert isinstance(opt, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5)
    assert scheduler.get_last_lr() == [0.5]
    assert opt.param_groups[0]["lr"] == 0.5


def test_param_groups_state_and_defaults_are_the_inner_objects() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = AcceleratedOptimizer(inner)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state
    assert opt.defaults is inner.defaults
    _backward(model)
    opt.step()
    assert set(opt.state) == set(model.parameters())
    assert "momentum_buffer" in opt.state[model.weight]
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5


def test_add_param_group_reaches_the_inner_optimizer() -> None:
    first, second = _model(0), _model(1)
    inner = torch.optim.SGD(first.parameters(), lr=0.1)
    opt = AcceleratedOptimizer(inner)
    opt.add_param_group({"params": list(second.parameters()), "lr": 0.2})
    assert len(inner.param_groups) == 2
    assert inner.param_groups[1]["lr"] == 0.2


@pytest.mark.parametrize("not_an_optimizer", [object(), torch.nn.Linear(2, 2), None])
def test_rejects_what_is_not_an_optimizer(not_an_optimizer: Any) -> None:
    with pytest.raises(TypeError, match=r"not a torch\.optim\.Optimizer"):
        AcceleratedOptimizer(not_an_optimizer)


# --- gating on sync_gradients -----------------------------------------------------------------


def test_step_and_zero_grad_do_nothing_while_gradients_accumulate() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model)
    grad = model.weight.grad.clone()
    before = _weights(model)

    GradientState()._set_sync_gradients(False)
    assert opt.step() is None
    opt.zero_grad()
    assert _unchanged(model, before)
    assert torch.equal(model.weight.grad, grad)

    GradientState()._set_sync_gradients(True)
    opt.step()
    assert not _unchanged(model, before)
    opt.zero_grad()
    assert model.weight.grad is None


def test_step_follows_the_accumulation_windows_of_advance() -> None:
    state = GradientState(GradientAccumulationPlugin(num_steps=3))
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    stepped = []
    for _ in range(6):
        state.advance()
        _backward(model)
        before = _weights(model)
        opt.step()
        opt.zero_grad()
        stepped.append(not _unchanged(model, before))
    assert stepped == [False, False, True, False, False, True]


def test_accumulated_gradient_is_applied_once_per_window() -> None:
    state = GradientState(GradientAccumulationPlugin(num_steps=2))
    model = _model()
    start = model.weight.detach().clone()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model)
    single = model.weight.grad.clone()
    model.weight.grad = None
    model.bias.grad = None
    for _ in range(2):
        state.advance()
        _backward(model)
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(model.weight.detach(), start - 0.1 * 2 * single)
    assert model.weight.grad is None


# --- zero_grad ----------------------------------------------------------------------------------


def test_zero_grad_sets_gradients_to_none_by_default() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_without_set_to_none_zeroes_gradients() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model)
    opt.zero_grad(set_to_none=False)
    for param in model.parameters():
        assert param.grad is not None
        assert torch.equal(param.grad, torch.zeros_like(param))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_set_to_none_on_an_optimizer_that_does_not_take_it_is_an_error(
    set_to_none: bool,
) -> None:
    model = _model()
    opt = AcceleratedOptimizer(_NoSetToNone(model.parameters(), lr=0.1))
    _backward(model)
    with pytest.raises(ValueError, match="_NoSetToNone") as info:
        opt.zero_grad(set_to_none=set_to_none)
    assert "set_to_none" in str(info.value)
    assert model.weight.grad is not None


def test_zero_grad_without_argument_works_on_an_optimizer_without_set_to_none() -> None:
    model = _model()
    opt = AcceleratedOptimizer(_NoSetToNone(model.parameters(), lr=0.1))
    _backward(model)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# --- stepping -----------------------------------------------------------------------------------


def test_step_without_scaler_returns_the_closure_loss() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = _weights(model)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(_inputs()).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert not _unchanged(model, before)
    assert opt.step_was_skipped is False


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    scale = scaler.get_scale()
    _backward(model, scaler)
    model.weight.grad[0, 0] = float("inf")
    before = _weights(model)
    opt.step()
    assert _unchanged(model, before)
    assert opt.step_was_skipped is True
    assert scaler.get_scale() == scale / 2


def test_clean_fp16_step_updates_the_weights() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    _backward(model)
    expected = model.weight.detach() - 0.1 * model.weight.grad
    opt.zero_grad()
    scale = scaler.get_scale()
    _backward(model, scaler)
    opt.step()
    assert opt.step_was_skipped is False
    torch.testing.assert_close(model.weight.detach(), expected)
    assert scaler.get_scale() == scale


def test_step_was_skipped_resets_on_the_next_clean_step() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    _backward(model, scaler)
    model.bias.grad[0] = float("nan")
    opt.step()
    assert opt.step_was_skipped is True
    opt.zero_grad()
    _backward(model, scaler)
    before = _weights(model)
    opt.step()
    assert opt.step_was_skipped is False
    assert not _unchanged(model, before)


@pytest.mark.parametrize("overflow", [False, True])
def test_scaled_step_leaves_the_class_step_method_in_place(overflow: bool) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = AcceleratedOptimizer(inner, scaler=torch.amp.GradScaler("cpu"))
    _backward(model, opt.scaler)
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.step_was_skipped is overflow
    assert "step" not in inner.__dict__
    assert inner.step.__func__ is torch.optim.SGD.step


@pytest.mark.parametrize("overflow", [False, True])
def test_scaled_step_keeps_the_lr_scheduler_step_wrapper(overflow: bool) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda n: 1 - n / 10)
    wrapper = inner.__dict__["step"]
    opt = AcceleratedOptimizer(inner, scaler=torch.amp.GradScaler("cpu"))
    _backward(model, opt.scaler)
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert inner.__dict__["step"] is wrapper
    if not overflow:
        # The wrapper ran, so torch sees optimizer.step() before lr_scheduler.step().
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scheduler.step()
        assert scheduler.get_last_lr() == pytest.approx([0.9])


def test_scaled_step_restores_the_inner_step_when_it_raises() -> None:
    model = _model()
    inner = _FailingStep(model.parameters(), lr=0.1)
    opt = AcceleratedOptimizer(inner, scaler=torch.amp.GradScaler("cpu"))
    _backward(model, opt.scaler)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert "step" not in inner.__dict__


def test_is_overflow_is_a_deprecated_alias_of_step_was_skipped() -> None:
    model = _model()
    opt = AcceleratedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu")
    )
    _backward(model, opt.scaler)
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    with pytest.warns(FutureWarning, match="step_was_skipped"):
        assert opt.is_overflow is True


# --- state dict and device placement -------------------------------------------------------------


def _trained_adam(model: torch.nn.Module) -> AcceleratedOptimizer:
    opt = AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for _ in range(3):
        _backward(model)
        opt.step()
        opt.zero_grad()
    return opt


def _assert_same_state(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert first["param_groups"] == second["param_groups"]
    assert first["state"].keys() == second["state"].keys()
    for key, values in first["state"].items():
        assert values.keys() == second["state"][key].keys()
        for name, value in values.items():
            torch.testing.assert_close(second["state"][key][name], value, rtol=0, atol=0)


def test_state_dict_round_trip_into_a_fresh_optimizer() -> None:
    model = _model()
    opt = _trained_adam(model)
    saved = opt.state_dict()
    assert saved["state"]  # Adam has per-parameter state after stepping

    twin = _model()
    twin.load_state_dict(model.state_dict())
    fresh = AcceleratedOptimizer(torch.optim.Adam(twin.parameters(), lr=0.5))
    fresh.load_state_dict(saved)
    _assert_same_state(saved, fresh.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.01

    for mod, optimizer in ((model, opt), (twin, fresh)):
        _backward(mod)
        optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device_placement", [True, False])
def test_wrapping_keeps_existing_state_on_cpu(device_placement: bool) -> None:
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    _backward(model)
    inner.step()
    expected = pickle.loads(pickle.dumps(inner.state_dict()))
    opt = AcceleratedOptimizer(inner, device_placement=device_placement)
    _assert_same_state(expected, opt.state_dict())
    assert opt.state[model.weight]["exp_avg"].device.type == "cpu"


# --- pickling -----------------------------------------------------------------------------------


def test_pickled_optimizer_steps_its_own_parameters() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _backward(model)
    opt.step()
    opt.zero_grad()

    model_copy, opt_copy = pickle.loads(pickle.dumps((model, opt)))
    assert isinstance(opt_copy, AcceleratedOptimizer)
    assert opt_copy.param_groups[0]["params"][0] is model_copy.weight
    _assert_same_state(opt.state_dict(), opt_copy.state_dict())

    for mod, optimizer in ((model, opt), (model_copy, opt_copy)):
        _backward(mod)
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(model.parameters(), model_copy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pickled_optimizer_follows_the_live_gradient_state() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model_copy, opt_copy = pickle.loads(pickle.dumps((model, opt)))
    _backward(model_copy)
    before = _weights(model_copy)
    GradientState()._set_sync_gradients(False)
    opt_copy.step()
    assert _unchanged(model_copy, before)
    GradientState()._set_sync_gradients(True)
    opt_copy.step()
    assert not _unchanged(model_copy, before)


def test_pickled_optimizer_with_scaler_keeps_the_scale_and_handles_overflow() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    _backward(model, scaler)
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert scaler.get_scale() == 32768.0

    model_copy, opt_copy = pickle.loads(pickle.dumps((model, opt)))
    assert opt_copy.scaler is not None
    assert opt_copy.scaler.get_scale() == 32768.0

    _backward(model_copy, opt_copy.scaler)
    model_copy.bias.grad[1] = float("inf")
    before = _weights(model_copy)
    opt_copy.step()
    opt_copy.zero_grad()
    assert opt_copy.step_was_skipped is True
    assert _unchanged(model_copy, before)
    assert opt_copy.scaler.get_scale() == 16384.0

    _backward(model_copy, opt_copy.scaler)
    opt_copy.step()
    assert opt_copy.step_was_skipped is False
    assert not _unchanged(model_copy, before)
    assert "step" not in opt_copy.optimizer.__dict__


# --- helpers ------------------------------------------------------------------------------------


def test_switch_parameters_replaces_mapped_parameters_only() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    replacement = torch.nn.Parameter(torch.zeros_like(model.weight))
    opt._switch_parameters({model.weight: replacement})
    params = opt.param_groups[0]["params"]
    assert params[0] is replacement
    assert params[1] is model.bias

    replacement.grad = torch.ones_like(replacement)
    opt.step()
    torch.testing.assert_close(replacement.detach(), torch.full_like(replacement, -0.1))


def test_train_and_eval_reach_an_optimizer_that_has_modes() -> None:
    inner = _ScheduleFree(_model().parameters(), lr=0.1)
    opt = AcceleratedOptimizer(inner)
    opt.train()
    assert inner.mode == "train"
    opt.eval()
    assert inner.mode == "eval"


def test_train_and_eval_are_harmless_on_an_optimizer_without_modes() -> None:
    model = _model()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.train()
    opt.eval()
    _backward(model)
    opt.step()  # still a working optimizer
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.1
