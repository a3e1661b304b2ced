"""Accumulation settings enter once: the plugin and the Accelerator's arguments become a plan."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from accel_amp import (
    GradientAccumulationPlugin,
    GradientAccumulator,
    make_gradient_accumulation_plugin,
    plan_accumulation,
)
from accel_amp import accumulation as accumulation_module
from accel_state import GradientState
from accel_state import accumulation_plan as plan_module
from accel_state.accumulation_plan import AccumulationPlan, PlansAccumulation

ENV = "ACCEL_GRADIENT_ACCUMULATION_STEPS"
FIX = "must be an integer >= 1 (1 means no accumulation)"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every value the one parser reads, wherever it is called from."""
    calls: list[object] = []
    real = plan_module.parse_accumulation_steps

    def counting(value: object, name: str, **kwargs: Any) -> int:
        calls.append(value)
        return real(value, name, **kwargs)

    monkeypatch.setattr(plan_module, "parse_accumulation_steps", counting)
    monkeypatch.setattr(accumulation_module, "parse_accumulation_steps", counting)
    return calls


def test_the_plugin_states_its_plan() -> None:
    plugin = GradientAccumulationPlugin(num_steps=4, sync_each_batch=True)
    assert isinstance(plugin, PlansAccumulation)
    assert plugin.to_plan() == AccumulationPlan(steps=4, sync_each_batch=True)
    assert GradientAccumulationPlugin().to_plan() == AccumulationPlan()
    assert GradientAccumulationPlugin(num_steps=2.0).num_steps == 2  # type: ignore[arg-type]


def test_a_plugin_changed_after_it_was_built_cannot_plan_a_bad_count() -> None:
    plugin = GradientAccumulationPlugin(num_steps=2)
    plugin.num_steps = 0
    with pytest.raises(ValueError, match=re.escape(f"AccumulationPlan(steps=0): {FIX}")):
        plugin.to_plan()


def test_a_plugin_is_parsed_once_and_its_plan_stored(parses: list[object]) -> None:
    plugin = GradientAccumulationPlugin(num_steps=3)
    state = GradientState(plugin)
    for _ in range(6):
        state.advance()
    assert parses == [3]
    assert state.plan == AccumulationPlan(steps=3)
    assert plugin.to_kwargs() == {"num_steps": 3}


@pytest.mark.parametrize(
    ("steps", "environ", "expected", "parsed"),
    [
        (1, {}, 1, [1]),
        (4, {}, 4, [4]),
        (1, {ENV: "8"}, 8, ["8"]),
        (3, {ENV: "8"}, 3, [3]),
    ],
)
def test_the_door_parses_the_winning_value_once(
    parses: list[object], steps: int, environ: dict[str, str], expected: int, parsed: list[object]
) -> None:
    assert plan_accumulation(steps, environ=environ) == AccumulationPlan(steps=expected)
    assert parses == parsed
    parses.clear()
    plugin = make_gradient_accumulation_plugin(steps, environ=environ)
    assert (plugin.num_steps, parses) == (expected, parsed)  # the plugin is not parsed again
    parses.clear()
    assert GradientState(plugin).num_steps == expected
    assert parses == []


def test_the_door_returns_a_given_plugins_plan_without_parsing(parses: list[object]) -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False)
    parses.clear()
    plan = plan_accumulation(1, plugin, environ={ENV: "8"})
    assert plan == AccumulationPlan(steps=2, adjust_scheduler=False)
    assert parses == []


@pytest.mark.parametrize("bad", ["2", 1.5, True, 0])
def test_the_argument_and_the_plugin_share_one_grammar(bad: Any) -> None:
    with pytest.raises(ValueError) as argument:
        plan_accumulation(bad, environ={})
    with pytest.raises(ValueError) as field:
        GradientAccumulationPlugin(num_steps=bad)
    assert str(argument.value) == f"gradient_accumulation_steps={bad!r}: {FIX}"
    assert str(field.value) == f"GradientAccumulationPlugin(num_steps={bad!r}): {FIX}"


def test_one_window_reads_the_plan_and_parses_nothing(parses: list[object]) -> None:
    GradientState(make_gradient_accumulation_plugin(2, environ={}))
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulator = GradientAccumulator(optimizers=[optimizer])
    decisions = []
    for _ in range(4):
        with accumulator.accumulate(model):
            accumulator.backward(model(torch.ones(1, 2)).sum())
            decisions.append(accumulator.sync_gradients)
    assert decisions == [False, True, False, True]
    assert parses == [2]
