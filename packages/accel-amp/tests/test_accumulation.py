"""Gradient accumulation: the plugin, the window cadence, ``no_sync``, exact normalisation, fp16.

The central promise is equivalence: accumulating ``N`` micro-batches gives the gradient of one
big batch of the same samples. With the default (mean-loss) scaling that holds only for
equal-sized micro-batches; with ``backward(loss_sum, num_items=n)`` it holds exactly for
uneven micro-batches, short last windows and variable token counts too.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel_amp import (
    AcceleratedOptimizer,
    GradientAccumulationPlugin,
    GradientAccumulator,
    make_gradient_accumulation_plugin,
    no_sync,
)
from accel_state import GradientState

ENV_STEPS = "ACCEL_GRADIENT_ACCUMULATION_STEPS"

# Tolerances per dtype: float64 makes "equal up to summation order" very tight.
TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-14},
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
}


# --- helpers ------------------------------------------------------------------------------


class _FakeLoader:
    """Iterates ``items`` while registered with ``GradientState``, like a prepared loader.

    ``end_of_dataloader`` becomes ``True`` just before the last item is yielded.
    """

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)
        self.end_of_dataloader = False
        self.remainder = -1

    def __iter__(self) -> Iterator[Any]:
        state = GradientState()
        state._add_dataloader(self)
        try:
            for index, item in enumerate(self.items):
                self.end_of_dataloader = index == len(self.items) - 1
                yield item
        finally:
            self.end_of_dataloader = False
            state._remove_dataloader(self)


def _mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _data(
    n: int, dtype: torch.dtype = torch.float64, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator, dtype=dtype)
    y = torch.randn(n, 3, generator=generator, dtype=dtype)
    return x, y


def _split(x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int]) -> list[Any]:
    return list(zip(torch.split(x, list(sizes)), torch.split(y, list(sizes)), strict=True))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_all_close(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], **tol: Any
) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **tol)


def _differs(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    return any(
        not torch.allclose(a, e, rtol=1e-3, atol=1e-6)
        for a, e in zip(actual, expected, strict=True)
    )


def _setup(
    model: nn.Module, num_steps: int | None, scaler: Any = None, lr: float = 0.1, **plugin: Any
) -> tuple[AcceleratedOptimizer, GradientAccumulator]:
    GradientState(GradientAccumulationPlugin(num_steps=num_steps, **plugin))
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), scaler=scaler)
    return optimizer, GradientAccumulator(scaler=scaler, optimizers=[optimizer])


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of the big batch's mean loss."""
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def _run(
    acc: GradientAccumulator,
    optimizer: AcceleratedOptimizer,
    model: nn.Module,
    batches: Any,
    *,
    exact: bool,
) -> list[list[torch.Tensor]]:
    """Train over ``batches``; return the gradients seen just before each optimizer step."""
    captured = []
    for xb, yb in batches:
        with acc.accumulate(model):
            if exact:
                acc.backward(F.mse_loss(model(xb), yb, reduction="sum"), num_items=yb.numel())
            else:
                acc.backward(F.mse_loss(model(xb), yb))
            if acc.sync_gradients:
                captured.append(_grads(model))
            optimizer.step()
            optimizer.zero_grad()
    return captured


# --- the plugin ---------------------------------------------------------------------------


def test_plugin_defaults() -> None:
    plugin = GradientAccumulationPlugin()
    assert plugin.num_steps is None
    assert plugin.adjust_scheduler is True
    assert plugin.sync_with_dataloader is True
    assert plugin.sync_each_batch is False
    assert GradientState(plugin).num_steps == 1


def test_plugin_to_kwargs_keeps_only_non_defaults_and_gradient_state_reads_them() -> None:
    assert GradientAccumulationPlugin().to_kwargs() == {}
    plugin = GradientAccumulationPlugin(num_steps=4, sync_each_batch=True, adjust_scheduler=True)
    assert plugin.to_kwargs() == {"num_steps": 4, "sync_each_batch": True}
    state = GradientState(plugin)
    assert (state.num_steps, state.sync_each_batch, state.sync_with_dataloader) == (4, True, True)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_plugin_rejects_non_positive_integer_num_steps(bad: Any) -> None:
    with pytest.raises(ValueError, match="num_steps"):
        GradientAccumulationPlugin(num_steps=bad)


def test_make_plugin_rejects_steps_and_plugin_together() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps") as info:
        make_gradient_accumulation_plugin(4, GradientAccumulationPlugin(num_steps=2), environ={})
    assert "gradient_accumulation_plugin" in str(info.value)


def test_make_plugin_returns_the_given_plugin_even_with_the_env_var_set() -> None:
    plugin = GradientAccumulationPlugin(num_steps=2)
    assert make_gradient_accumulation_plugin(1, plugin, environ={ENV_STEPS: "8"}) is plugin


@pytest.mark.parametrize(
    ("steps", "environ", "expected"),
    [
        (1, {}, 1),
        (3, {}, 3),
        (1, {ENV_STEPS: "8"}, 8),
        (3, {ENV_STEPS: "8"}, 3),  # an explicit count wins over the launcher's
        (1, {ENV_STEPS: ""}, 1),
        (1, {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, 4),  # Accelerate's name
        (1, {ENV_STEPS: "4", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, 4),
    ],
)
def test_make_plugin_resolves_steps_and_env_var(
    steps: int, environ: dict[str, str], expected: int
) -> None:
    assert make_gradient_accumulation_plugin(steps, environ=environ).num_steps == expected


def test_make_plugin_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STEPS, "5")
    assert make_gradient_accumulation_plugin().num_steps == 5


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "2.5"])
def test_make_plugin_names_the_env_var_when_its_value_is_bad(raw: str) -> None:
    with pytest.raises(ValueError, match=ENV_STEPS):
        make_gradient_accumulation_plugin(environ={ENV_STEPS: raw})


def test_make_plugin_names_both_variables_when_they_disagree() -> None:
    environ = {ENV_STEPS: "2", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    with pytest.raises(ValueError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS='4'"):
        make_gradient_accumulation_plugin(environ=environ)


def test_make_plugin_names_accelerates_variable_when_its_value_is_bad() -> None:
    with pytest.raises(ValueError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS='x'"):
        make_gradient_accumulation_plugin(environ={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "x"})


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_make_plugin_rejects_bad_steps(bad: Any) -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        make_gradient_accumulation_plugin(bad, environ={})


# --- equivalence with one big batch -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("exact", [False, True], ids=["mean", "num_items"])
def test_accumulated_gradient_equals_big_batch_gradient(dtype: torch.dtype, exact: bool) -> None:
    num_steps, batch = 4, 3
    x, y = _data(num_steps * batch, dtype)
    model = _mlp(dtype)
    reference = copy.deepcopy(model)
    optimizer, acc = _setup(model, num_steps)

    captured = _run(acc, optimizer, model, _split(x, y, [batch] * num_steps), exact=exact)

    assert len(captured) == 1
    _assert_all_close(captured[0], _reference_grads(reference, x, y), **TOL[dtype])


@pytest.mark.parametrize("exact", [False, True], ids=["mean", "num_items"])
def test_training_over_several_windows_matches_big_batch_training(exact: bool) -> None:
    num_steps, batch, windows = 4, 3, 3
    x, y = _data(num_steps * batch * windows)
    model = _mlp()
    reference = copy.deepcopy(model)
    GradientState(GradientAccumulationPlugin(num_steps=num_steps))
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    acc = GradientAccumulator(optimizers=[optimizer])
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    captured = _run(acc, optimizer, model, _split(x, y, [batch] * num_steps * windows), exact=exact)
    for xw, yw in _split(x, y, [num_steps * batch] * windows):
        F.mse_loss(reference(xw), yw).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

    assert len(captured) == windows
    assert _differs(_params(model), _params(_mlp()))  # training moved the weights
    _assert_all_close(_params(model), _params(reference), **TOL[torch.float64])


@pytest.mark.parametrize("num_steps", [4, 8])
def test_num_items_is_exact_for_an_uneven_window_closed_by_the_loader(num_steps: int) -> None:
    sizes = [4, 4, 4, 3]
    x, y = _data(sum(sizes))
    exact_model, mean_model = _mlp(), _mlp()
    reference = copy.deepcopy(exact_model)
    expected = _reference_grads(reference, x, y)
    expected_loss = F.mse_loss(reference(x), y).detach()

    optimizer, acc = _setup(exact_model, num_steps)
    (exact,) = _run(acc, optimizer, exact_model, _FakeLoader(_split(x, y, sizes)), exact=True)
    _assert_all_close(exact, expected, **TOL[torch.float64])
    assert acc.last_window_items is not None and acc.last_window_loss is not None
    assert acc.last_window_items.item() == y.numel()
    torch.testing.assert_close(acc.last_window_loss, expected_loss, **TOL[torch.float64])

    GradientState._reset_state()
    optimizer, acc = _setup(mean_model, num_steps)
    (biased,) = _run(acc, optimizer, mean_model, _FakeLoader(_split(x, y, sizes)), exact=False)
    # Mean scaling weights the 3-sample micro-batch like the 4-sample ones (and divides a
    # short window by num_steps): it is not the big batch's gradient.
    assert _differs(biased, expected)


def _token_batches(
    counts: Sequence[int], vocab: int, seq: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for count in counts:
        features = torch.randn(2, seq, 6, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, vocab, (2 * seq,), generator=generator)
        masked = torch.randperm(2 * seq, generator=generator)[count:]
        labels[masked] = -100
        batches.append((features, labels.reshape(2, seq)))
    return batches


def test_num_items_gives_the_per_token_mean_gradient_for_variable_token_counts() -> None:
    vocab, seq, counts = 5, 7, [14, 3, 9, 1]
    batches = _token_batches(counts, vocab, seq)
    torch.manual_seed(0)
    model = nn.Linear(6, vocab).to(torch.float64)
    mean_model = copy.deepcopy(model)
    reference = copy.deepcopy(model)

    def token_loss(net: nn.Module, features: torch.Tensor, labels: torch.Tensor, red: str) -> Any:
        logits = net(features).reshape(-1, vocab)
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction=red)

    all_features = torch.cat([f for f, _ in batches])
    all_labels = torch.cat([lab for _, lab in batches])
    expected_loss = token_loss(reference, all_features, all_labels, "mean")
    expected_loss.backward()
    expected = _grads(reference)

    optimizer, acc = _setup(model, len(counts))
    for features, labels in batches:
        with acc.accumulate(model):
            num_items = (labels != -100).sum()
            acc.backward(token_loss(model, features, labels, "sum"), num_items=num_items)
            if acc.sync_gradients:
                exact = _grads(model)
            optimizer.step()
            optimizer.zero_grad()
    _assert_all_close(exact, expected, **TOL[torch.float64])
    assert acc.last_window_items is not None and acc.last_window_loss is not None
    assert acc.last_window_items.item() == sum(counts)
    torch.testing.assert_close(acc.last_window_loss, expected_loss.detach(), **TOL[torch.float64])

    # The default (per-micro-batch mean / num_steps) over-weights the 1-token micro-batch.
    GradientState._reset_state()
    optimizer, acc = _setup(mean_model, len(counts))
    for features, labels in batches:
        with acc.accumulate(mean_model):
            acc.backward(token_loss(mean_model, features, labels, "mean"))
            if acc.sync_gradients:
                biased = _grads(mean_model)
    assert _differs(biased, expected)


def test_two_num_items_backwards_on_a_non_closing_micro_batch_are_allowed() -> None:
    x, y = _data(8)
    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer, acc = _setup(model, 2)
    halves = _split(x, y, [2, 2, 4])
    with acc.accumulate(model):
        for xb, yb in halves[:2]:
            acc.backward(F.mse_loss(model(xb), yb, reduction="sum"), num_items=yb.numel())
    with acc.accumulate(model):
        xb, yb = halves[2]
        acc.backward(F.mse_loss(model(xb), yb, reduction="sum"), num_items=yb.numel())
        assert acc.sync_gradients
        _assert_all_close(_grads(model), _reference_grads(reference, x, y), **TOL[torch.float64])


def test_a_window_closed_without_backward_does_not_leak_into_the_next() -> None:
    x, y = _data(10)
    model = _mlp()
    optimizer, acc = _setup(model, 2)
    skipped, *window = _split(x, y, [4, 2, 4])
    with acc.accumulate(model):
        acc.backward(F.mse_loss(model(skipped[0]), skipped[1], reduction="sum"), num_items=12)
    with acc.accumulate(model):  # closes the window, e.g. a batch skipped for a NaN loss
        assert acc.sync_gradients
        optimizer.step()
        optimizer.zero_grad()
    reference = copy.deepcopy(model)
    (grads,) = _run(acc, optimizer, model, window, exact=True)
    x_window, y_window = torch.cat([xb for xb, _ in window]), torch.cat([yb for _, yb in window])
    _assert_all_close(grads, _reference_grads(reference, x_window, y_window), **TOL[torch.float64])
    assert acc.last_window_items is not None
    assert acc.last_window_items.item() == y_window.numel()


# --- window cadence -----------------------------------------------------------------------


def _cadence(
    acc: GradientAccumulator, optimizer: AcceleratedOptimizer, model: nn.Module, loader: Any
) -> tuple[list[int], list[int]]:
    """Train one epoch; return the 1-based iterations that synced and the window positions."""
    syncs, positions = [], []
    for iteration, (xb, yb) in enumerate(loader, start=1):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(xb), yb))
            positions.append(acc.gradient_state.micro_batches_in_window)
            if acc.sync_gradients:
                syncs.append(iteration)
            optimizer.step()
            optimizer.zero_grad()
    return syncs, positions


@pytest.mark.parametrize(
    ("sync_with_dataloader", "epoch_syncs"),
    [(True, [[4, 8, 10], [4, 8, 10]]), (False, [[4, 8], [2, 6, 10]])],
)
def test_windows_close_every_num_steps_and_at_the_end_of_the_loader(
    sync_with_dataloader: bool, epoch_syncs: list[list[int]]
) -> None:
    x, y = _data(10)
    model = _mlp()
    GradientState(
        GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=sync_with_dataloader)
    )
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    steps: list[int] = []
    inner.register_step_post_hook(lambda *_: steps.append(1))
    optimizer = AcceleratedOptimizer(inner)
    acc = GradientAccumulator(optimizers=[optimizer])
    loader = _FakeLoader(_split(x, y, [1] * 10))

    for epoch, expected in enumerate(epoch_syncs):
        before = len(steps)
        syncs, positions = _cadence(acc, optimizer, model, loader)
        assert syncs == expected, f"epoch {epoch}"
        assert len(steps) - before == len(expected), f"epoch {epoch}"
        if sync_with_dataloader:  # each epoch starts a fresh window
            assert positions == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def test_optimizer_and_zero_grad_act_only_when_the_window_closes() -> None:
    x, y = _data(6)
    model = _mlp()
    initial = _params(model)
    optimizer, acc = _setup(model, 3)
    for index, (xb, yb) in enumerate(_split(x, y, [2, 2, 2])):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            if index < 2:
                _assert_all_close(_params(model), initial, rtol=0, atol=0)
                assert all(p.grad is not None for p in model.parameters())
    assert _differs(_params(model), initial)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


# --- no_sync ----------------------------------------------------------------------------


class _DdpLike(nn.Linear):
    """A module with DDP's ``no_sync()`` context manager that records its use."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.entries = 0
        self.in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.entries += 1
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


class _Fsdp2Like(nn.Linear):
    """A module with FSDP2's ``set_requires_gradient_sync`` that records its calls."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.calls.append(requires)


def _micro_batch(acc: GradientAccumulator, model: nn.Module) -> None:
    acc.backward(model(torch.ones(1, 2)).sum())


@pytest.mark.parametrize(
    ("sync_each_batch", "expected"),
    [(False, [True, True, False, True, True, False]), (True, [False] * 6)],
)
def test_accumulate_enters_no_sync_only_on_accumulating_micro_batches(
    sync_each_batch: bool, expected: list[bool]
) -> None:
    model = _DdpLike()
    _, acc = _setup(model, 3, sync_each_batch=sync_each_batch)
    seen = []
    for _ in range(6):
        with acc.accumulate(model):
            seen.append(model.in_no_sync)
            _micro_batch(acc, model)
        assert not model.in_no_sync
    assert seen == expected
    assert model.entries == sum(expected)


def test_accumulate_toggles_fsdp2_gradient_sync_off_then_on() -> None:
    model = _Fsdp2Like()
    _, acc = _setup(model, 2)
    with acc.accumulate(model):
        assert model.calls == [False]
        _micro_batch(acc, model)
    assert model.calls == [False, True]
    with acc.accumulate(model):
        _micro_batch(acc, model)
    assert model.calls == [False, True]  # the closing micro-batch syncs


def test_accumulate_leaves_no_sync_when_the_body_raises() -> None:
    model = _DdpLike()
    GradientState(GradientAccumulationPlugin(num_steps=2))
    acc = GradientAccumulator()
    with pytest.raises(KeyError), acc.accumulate(model):
        assert model.in_no_sync
        raise KeyError("boom")
    assert not model.in_no_sync


def test_no_sync_restores_fsdp2_sync_on_error_and_accepts_plain_modules() -> None:
    model = _Fsdp2Like()
    with pytest.raises(KeyError), no_sync(model):
        raise KeyError("boom")
    assert model.calls == [False, True]
    plain = nn.Linear(2, 1)
    with no_sync(plain):
        plain(torch.ones(1, 2)).sum().backward()
    assert plain.weight.grad is not None


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("first_exact", [True, False])
def test_mixing_backward_with_and_without_num_items_in_one_window_raises(
    first_exact: bool,
) -> None:
    x, y = _data(4)
    model = _mlp()
    _, acc = _setup(model, 2)
    with acc.accumulate(model):
        if first_exact:
            acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())
        else:
            acc.backward(F.mse_loss(model(x), y))
    with acc.accumulate(model), pytest.raises(ValueError, match="num_items"):
        if first_exact:
            acc.backward(F.mse_loss(model(x), y))
        else:
            acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())


def test_two_num_items_backwards_on_the_closing_micro_batch_raise() -> None:
    x, y = _data(4)
    model = _mlp()
    _, acc = _setup(model, 2)
    with acc.accumulate(model):
        acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())
    with acc.accumulate(model):
        acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())
        with pytest.raises(RuntimeError, match="twice"):
            acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())


def test_num_items_without_a_known_optimizer_or_model_points_to_accumulate() -> None:
    x, y = _data(4)
    model = _mlp()
    acc = GradientAccumulator()
    with pytest.raises(RuntimeError, match="accumulate"):
        acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=y.numel())


def test_num_items_with_only_the_model_passed_to_accumulate_normalises() -> None:
    x, y = _data(6)
    model = _mlp()
    reference = copy.deepcopy(model)
    GradientState(GradientAccumulationPlugin(num_steps=2))
    acc = GradientAccumulator()
    for xb, yb in _split(x, y, [4, 2]):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(xb), yb, reduction="sum"), num_items=yb.numel())
    _assert_all_close(_grads(model), _reference_grads(reference, x, y), **TOL[torch.float64])


# --- fp16 with a GradScaler ---------------------------------------------------------------

SCALE = 2.0**12


def _scaled_setup(
    num_steps: int = 1,
) -> tuple[nn.Module, nn.Module, AcceleratedOptimizer, GradientAccumulator, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    optimizer, acc = _setup(model, num_steps, scaler=scaler)
    return model, reference, optimizer, acc, scaler


def _fp16_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def _fp16_data(n: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 3, generator=generator)


def _unscaled_reference(reference: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    reference.zero_grad(set_to_none=True)
    _fp16_loss(reference, x, y).backward()
    return _grads(reference)


def test_unscale_twice_in_one_step_raises_and_keeps_the_unscaled_gradients() -> None:
    model, reference, _, acc, _ = _scaled_setup()
    x, y = _fp16_data()
    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        acc.unscale_gradients()
        with pytest.raises(RuntimeError, match="already"):
            acc.unscale_gradients()
    _assert_all_close(_grads(model), _unscaled_reference(reference, x, y))


def test_unscale_twice_through_a_raw_torch_optimizer_raises_clearly() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    acc = GradientAccumulator(scaler=scaler, optimizers=[torch.optim.SGD(model.parameters())])
    x, y = _fp16_data()
    acc.backward(_fp16_loss(model, x, y))
    acc.unscale_gradients()
    with pytest.raises(RuntimeError, match="already"):
        acc.unscale_gradients()


def test_gradients_are_scaled_before_unscale() -> None:
    model, reference, _, acc, _ = _scaled_setup()
    x, y = _fp16_data()
    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        scaled = _grads(model)
        acc.unscale_gradients()
    expected = _unscaled_reference(reference, x, y)
    _assert_all_close(scaled, [g * SCALE for g in expected])
    _assert_all_close(_grads(model), expected)


@pytest.mark.parametrize("unscale_first", [True, False])
def test_clip_grad_norm_returns_the_unscaled_norm_and_clips_once(unscale_first: bool) -> None:
    model, reference, optimizer, acc, _ = _scaled_setup()
    x, y = _fp16_data()
    max_norm = 0.05
    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        if unscale_first:
            acc.unscale_gradients()
        norm = acc.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    _unscaled_reference(reference, x, y)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert expected_norm > max_norm  # the clipping is real
    assert norm is not None
    torch.testing.assert_close(norm, expected_norm)
    assert not optimizer.step_was_skipped
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    _assert_all_close(_params(model), _params(reference))


def test_clip_grad_value_clamps_the_unscaled_gradients() -> None:
    model, reference, _, acc, _ = _scaled_setup()
    x, y = _fp16_data()
    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        acc.clip_grad_value_(model.parameters(), 0.01)
    expected = [g.clamp(-0.01, 0.01) for g in _unscaled_reference(reference, x, y)]
    assert any((g.abs() > 0.01).any() for g in _grads(reference))
    _assert_all_close(_grads(model), expected)


def test_unscale_works_again_after_the_optimizer_steps() -> None:
    model, reference, optimizer, acc, _ = _scaled_setup()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _fp16_data(6)
    for xb, yb in _split(x, y, [3, 3]):
        with acc.accumulate(model):
            acc.backward(_fp16_loss(model, xb, yb))
            acc.unscale_gradients()
            _assert_all_close(_grads(model), _unscaled_reference(reference, xb, yb))
            optimizer.step()
            optimizer.zero_grad()
            assert not optimizer.step_was_skipped
        ref_optimizer.step()
    _assert_all_close(_params(model), _params(reference))


def test_clipping_on_an_accumulating_micro_batch_warns_once_and_leaves_gradients() -> None:
    model, reference, optimizer, acc, _ = _scaled_setup(num_steps=2)
    x, y = _fp16_data(6)
    first, second, third = _split(x, y, [2, 2, 2])

    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, *first))
        before = _grads(model)
        with pytest.warns(UserWarning, match="does not complete the accumulation window"):
            assert acc.clip_grad_norm_(model.parameters(), 1e-4) is None
        _assert_all_close(_grads(model), before, rtol=0, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert acc.clip_grad_norm_(model.parameters(), 1e-4) is None  # no second warning
        _assert_all_close(_grads(model), before, rtol=0, atol=0)
        with pytest.warns(UserWarning, match="unscale_gradients"):
            acc.unscale_gradients()
        _assert_all_close(_grads(model), before, rtol=0, atol=0)
        with pytest.warns(UserWarning, match="clip_grad_value_"):
            acc.clip_grad_value_(model.parameters(), 1e-6)
        _assert_all_close(_grads(model), before, rtol=0, atol=0)
        optimizer.step()

    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, *second))
        assert acc.sync_gradients
        acc.unscale_gradients()  # the ignored calls above did not count as an unscale
        norm = acc.clip_grad_norm_(model.parameters(), 1e9)

    reference.zero_grad()
    (_fp16_loss(reference, *first) / 2 + _fp16_loss(reference, *second) / 2).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert norm is not None
    torch.testing.assert_close(norm, expected_norm)

    with acc.accumulate(model), warnings.catch_warnings():  # still warned only once
        warnings.simplefilter("error")
        acc.backward(_fp16_loss(model, *third))
        assert acc.clip_grad_norm_(model.parameters(), 1e-4) is None


def test_overflow_skips_the_step_and_keeps_the_weights() -> None:
    model, _, optimizer, acc, scaler = _scaled_setup()
    x, y = _fp16_data()
    initial = _params(model)
    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        model.weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.step_was_skipped
    _assert_all_close(_params(model), initial, rtol=0, atol=0)
    assert scaler.get_scale() < SCALE  # the scaler backed off

    with acc.accumulate(model):
        acc.backward(_fp16_loss(model, x, y))
        optimizer.step()
    assert not optimizer.step_was_skipped
    assert _differs(_params(model), initial)


# --- the engine protocol and the checkpoint state ------------------------------------------


class _RecordingSync:
    """A GradientSync that records what the accumulator asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        self.calls.append("no_sync")
        yield

    def grads_averaged_over(self, model: Any) -> int:
        self.calls.append("averaged_over")
        return 1

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        self.calls.append(f"clip_norm {max_norm}")
        return torch.tensor(3.0)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.calls.append(f"clip_value {clip_value}")


def test_the_accumulator_asks_its_engine_for_sync_averaging_and_clipping() -> None:
    from accel_amp import GradientAccumulationPlugin, GradientSync

    sync = _RecordingSync()
    assert isinstance(sync, GradientSync)
    GradientState(GradientAccumulationPlugin(num_steps=2))
    model = nn.Linear(2, 1)
    accumulator = GradientAccumulator(sync=sync)
    for _ in range(2):
        with accumulator.accumulate(model):
            accumulator.backward(model(torch.ones(1, 2)).sum(), num_items=1)
    assert accumulator.clip_grad_norm_(model.parameters(), 0.5) == 3.0
    accumulator.clip_grad_value_(model.parameters(), 0.25)
    assert sync.calls == ["no_sync", "averaged_over", "clip_norm 0.5", "clip_value 0.25"]


def test_the_accumulator_state_round_trips_and_refuses_a_foreign_one() -> None:
    GradientState()
    model = nn.Linear(2, 1)
    accumulator = GradientAccumulator()
    GradientState(GradientAccumulationPlugin(num_steps=3))
    with accumulator.accumulate(model):
        accumulator.backward(model(torch.ones(1, 2)).sum(), num_items=4)
    state = accumulator.state_dict()
    assert state["mode"] == "sum" and float(state["items"]) == 4.0
    fresh = GradientAccumulator()
    fresh.load_state_dict(state)
    assert fresh.state_dict()["mode"] == "sum"
    assert torch.equal(fresh.state_dict()["loss_sum"], state["loss_sum"])
    with pytest.raises(ValueError, match="mode='median'"):
        fresh.load_state_dict({"mode": "median"})
    assert fresh.state_dict()["mode"] == "sum"  # unchanged by the refused state
