"""Optional engine capabilities are typed protocols: a misspelt member is not a capability."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accel_amp import (
    DuckGradientSync,
    GradientAccumulationPlugin,
    GradientAccumulator,
    GradientSync,
    HasAveragingGroup,
    OwnsBackward,
    SumsOverAveragingWorld,
)
from accel_state import GradientState


class _TwoRanks(DuckGradientSync):
    """Gradients averaged over two ranks, with a recording of what the accumulator asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        yield

    def grads_averaged_over(self, model: Any) -> int:
        return 2


class _WithGroup(_TwoRanks):
    GROUP = object()

    def averaging_group(self, model: Any) -> Any:
        self.calls.append("averaging_group")
        return self.GROUP


class _MisspeltGroup(_TwoRanks):
    def averaging_grop(self, model: Any) -> Any:  # the typo the protocol guards against
        self.calls.append("averaging_grop")
        return object()


class _SumsItself(_TwoRanks):
    def sum_over_averaging_world(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("sum_over_averaging_world")
        return tensor * 2


class _Backward(_TwoRanks):
    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        self.calls.append(f"backward sync={sync_gradients}")


class _FlagOnly(_TwoRanks):
    owns_backward = True  # the old string-looked-up flag, without the method


def test_each_capability_is_told_by_its_protocol() -> None:
    assert isinstance(_WithGroup(), HasAveragingGroup)
    assert not isinstance(_MisspeltGroup(), HasAveragingGroup)
    assert isinstance(_SumsItself(), SumsOverAveragingWorld)
    assert isinstance(_Backward(), OwnsBackward)
    assert not isinstance(_FlagOnly(), OwnsBackward)
    plain = DuckGradientSync()
    assert isinstance(plain, GradientSync)
    for capability in (HasAveragingGroup, SumsOverAveragingWorld, OwnsBackward):
        assert not isinstance(plain, capability)


def test_a_declared_capability_with_a_misspelt_method_cannot_be_built() -> None:
    class Declared(_TwoRanks, HasAveragingGroup):
        def averaging_grop(self, model: Any) -> Any:
            return None

    with pytest.raises(TypeError, match="averaging_group"):
        Declared()  # type: ignore[abstract]


def _window(sync: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """One two-micro-batch window with ``num_items``; the groups ``all_reduce`` was given."""
    groups: list[Any] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: groups.append(group))
    GradientState(GradientAccumulationPlugin(num_steps=2))
    model = nn.Linear(2, 1)
    accumulator = GradientAccumulator(sync=sync)
    for _ in range(2):
        with accumulator.accumulate(model):
            accumulator.backward(model(torch.ones(1, 2)).sum(), num_items=1)
    return groups


def test_the_averaging_group_is_asked_of_an_engine_that_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sync = _WithGroup()
    assert _window(sync, monkeypatch) == [_WithGroup.GROUP]
    assert sync.calls == ["averaging_group"]


def test_a_misspelt_averaging_group_is_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = _MisspeltGroup()
    assert _window(sync, monkeypatch) == [None]  # the default group, as for any engine
    assert sync.calls == []


def test_an_engine_without_a_group_sums_the_items_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = _SumsItself()
    assert _window(sync, monkeypatch) == []
    assert sync.calls == ["sum_over_averaging_world"]


def test_an_engine_that_owns_backward_gets_every_loss() -> None:
    GradientState(GradientAccumulationPlugin(num_steps=2))
    model = nn.Linear(2, 1)
    sync = _Backward()
    accumulator = GradientAccumulator(sync=sync)
    for _ in range(2):
        with accumulator.accumulate(model):
            accumulator.backward(model(torch.ones(1, 2)).sum())
    assert sync.calls == ["backward sync=False", "backward sync=True"]
    assert model.weight.grad is None  # the accumulator ran no backward itself
    with pytest.raises(ValueError, match="num_items"):
        accumulator.backward(model(torch.ones(1, 2)).sum(), num_items=1)


def test_a_flag_without_the_method_leaves_backward_to_the_accumulator() -> None:
    GradientState()
    model = nn.Linear(2, 1)
    accumulator = GradientAccumulator(sync=_FlagOnly())
    with accumulator.accumulate(model):
        accumulator.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None
