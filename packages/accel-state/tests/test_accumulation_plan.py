"""The accumulation plan: one grammar for a step count, parsed once, stored by GradientState."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from accel_state import GradientState
from accel_state import accumulation_plan as plan_module
from accel_state.accumulation_plan import (
    AccumulationPlan,
    PlansAccumulation,
    accumulation_steps_from_environment,
    parse_accumulation_steps,
)

ENV = "ACCEL_GRADIENT_ACCUMULATION_STEPS"
ACCELERATE_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
FIX = "must be an integer >= 1 (1 means no accumulation)"


# --- the grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(1, 1), (4, 4), (2.0, 2)])
def test_numbers_are_whole_numbers_at_least_one(value: Any, expected: int) -> None:
    steps = parse_accumulation_steps(value, "gradient_accumulation_steps")
    assert steps == expected and type(steps) is int


@pytest.mark.parametrize("value", [0, -1, 2.5, True, False, None, "2", [2]])
def test_other_values_are_refused_naming_the_argument_the_value_and_the_fix(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        parse_accumulation_steps(value, "gradient_accumulation_steps")
    assert str(info.value) == f"gradient_accumulation_steps={value!r}: {FIX}"


def test_a_field_is_named_with_its_class() -> None:
    with pytest.raises(ValueError) as info:
        parse_accumulation_steps(0, "num_steps", owner="GradientAccumulationPlugin")
    assert str(info.value) == f"GradientAccumulationPlugin(num_steps=0): {FIX}"


@pytest.mark.parametrize(("text", "expected"), [("4", 4), (" 8 ", 8), ("1", 1)])
def test_text_is_a_decimal_integer(text: str, expected: int) -> None:
    assert parse_accumulation_steps(text, ENV, text=True) == expected


@pytest.mark.parametrize("text", ["abc", "0", "-2", "2.5", "4.0", "auto", ""])
def test_bad_text_is_refused_with_the_same_message(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_accumulation_steps(text, ENV, text=True)
    assert str(info.value) == f"{ENV}={text!r}: {FIX}"


# --- the environment -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({ENV: ""}, None),
        ({ENV: "4"}, (ENV, 4)),
        ({ACCELERATE_ENV: "3"}, (ACCELERATE_ENV, 3)),
        ({ENV: "2", ACCELERATE_ENV: "2"}, (ENV, 2)),
    ],
)
def test_the_variable_is_read_in_both_spellings(
    environ: dict[str, str], expected: tuple[str, int] | None
) -> None:
    assert accumulation_steps_from_environment(environ) == expected


def test_a_bad_variable_is_named_and_disagreeing_spellings_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape(f"{ACCELERATE_ENV}='x': {FIX}")):
        accumulation_steps_from_environment({ACCELERATE_ENV: "x"})
    with pytest.raises(ValueError, match="disagree"):
        accumulation_steps_from_environment({ENV: "2", ACCELERATE_ENV: "4"})


# --- the plan ------------------------------------------------------------------------------


def test_the_plan_is_frozen_and_holds_parsed_values_only() -> None:
    plan = AccumulationPlan(steps=4, sync_each_batch=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps = 2  # type: ignore[misc]
    for bad in (0, "4", 2.0, True):
        with pytest.raises(ValueError, match=r"AccumulationPlan\(steps="):
            AccumulationPlan(steps=bad)  # type: ignore[arg-type]


def test_the_plan_round_trips_through_plugin_kwargs() -> None:
    plan = AccumulationPlan(steps=4, adjust_scheduler=False, sync_each_batch=True)
    kwargs = plan.to_kwargs()
    assert kwargs == {"num_steps": 4, "adjust_scheduler": False, "sync_each_batch": True}
    assert AccumulationPlan.from_kwargs(kwargs) == plan
    assert AccumulationPlan().to_kwargs() == {}
    assert AccumulationPlan.from_kwargs({}) == AccumulationPlan()


def test_foreign_plugin_kwargs_are_parsed_naming_the_plugin() -> None:
    with pytest.raises(ValueError) as info:
        AccumulationPlan.from_kwargs({"num_steps": "2"}, owner="OtherPlugin")
    assert str(info.value) == f"OtherPlugin(num_steps='2'): {FIX}"


# --- GradientState stores the plan ---------------------------------------------------------


class _PlanOnly:
    """Settings that state their plan (as accel-amp's plugin does)."""

    def __init__(self, plan: AccumulationPlan) -> None:
        self.plan = plan

    def to_plan(self) -> AccumulationPlan:
        return self.plan

    def to_kwargs(self) -> dict[str, Any]:
        return {"num_steps": self.plan.steps}


class _KwargsOnly:
    """A plugin accel did not build (Accelerate's): it only has ``to_kwargs()``."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def to_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)


def _refuse_to_parse(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("the step count was parsed again")


def test_gradient_state_stores_a_given_plan_and_reads_it_without_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = AccumulationPlan(steps=3, sync_with_dataloader=False)
    monkeypatch.setattr(plan_module, "parse_accumulation_steps", _refuse_to_parse)
    state = GradientState(plan)
    assert state.plan is plan
    assert isinstance(_PlanOnly(plan), PlansAccumulation)
    GradientState(_PlanOnly(plan))  # a plugin's plan is stored as it is
    assert state.plan is plan
    decisions = [state.advance() for _ in range(6)]
    assert decisions == [False, False, True] * 2
    assert (state.num_steps, state.sync_with_dataloader) == (3, False)


def test_a_kwargs_only_plugin_is_parsed_once_when_it_enters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[object] = []
    real = plan_module.parse_accumulation_steps

    def counting(value: object, name: str, **kwargs: Any) -> int:
        calls.append(value)
        return real(value, name, **kwargs)

    monkeypatch.setattr(plan_module, "parse_accumulation_steps", counting)
    state = GradientState(_KwargsOnly(num_steps=4, sync_each_batch=True))
    for _ in range(8):
        state.advance()
    assert (state.num_steps, state.sync_each_batch) == (4, True)
    assert calls == [4]
    assert state.plan == AccumulationPlan(steps=4, sync_each_batch=True)
    with pytest.raises(ValueError, match=re.escape(f"_KwargsOnly(num_steps=0): {FIX}")):
        GradientState(_KwargsOnly(num_steps=0))
    assert state.num_steps == 4  # a refused plugin changes nothing


def test_plugin_kwargs_stays_consistent_with_the_plan() -> None:
    state = GradientState(AccumulationPlan(steps=2))
    assert state.plugin_kwargs == {"num_steps": 2}
    with pytest.raises(TypeError):
        state.plugin_kwargs["num_steps"] = 8  # type: ignore[index]
    state.plugin_kwargs = {**state.plugin_kwargs, "num_steps": 5, "adjust_scheduler": False}
    assert state.plan == AccumulationPlan(steps=5, adjust_scheduler=False)
    with pytest.raises(ValueError, match=re.escape(f"plugin_kwargs['num_steps']=0: {FIX}")):
        state.plugin_kwargs = {"num_steps": 0}
    assert state.num_steps == 5
    state.plan = dataclasses.replace(state.plan, steps=6)
    assert state.plugin_kwargs == {"num_steps": 6, "adjust_scheduler": False}
    with pytest.raises(TypeError, match="AccumulationPlan"):
        state.plan = 6  # type: ignore[assignment]


def test_the_xla_sync_flag_is_set_through_its_property() -> None:
    state = GradientState()
    assert state.is_xla_gradients_synced is False
    state.is_xla_gradients_synced = True
    assert GradientState().is_xla_gradients_synced is True
    state.is_xla_gradients_synced = False
    assert state.is_xla_gradients_synced is False
