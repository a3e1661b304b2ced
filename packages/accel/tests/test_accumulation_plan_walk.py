"""``gradient_accumulation_steps`` is parsed once, from ``Accelerator(...)`` to the optimizer step.

The one parser is accel-state's ``parse_accumulation_steps``: the Accelerator's argument, its
plugin, ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` and the DeepSpeed plugin's reading of that
variable all go through it, and ``GradientState`` stores the resulting plan. The optional engine
capabilities the accumulator asks for are typed protocols each engine declares.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.engines.ddp import DDPEngine
from accel.engines.deepspeed import DeepSpeedZeroEngine
from accel.engines.fsdp2 import FSDP2Engine
from accel.engines.single import SingleDeviceEngine
from accel.engines.tensor_parallel import TensorParallelEngine
from accel.engines.xla import XLAEngine
from accel.utils import DeepSpeedPlugin, GradientAccumulationPlugin
from accel_amp import (
    HasAveragingGroup,
    OwnsBackward,
    SumsOverAveragingWorld,
    make_gradient_accumulation_plugin,
)
from accel_amp import accumulation as accumulation_module
from accel_state import accumulation_plan as plan_module
from accel_state.accumulation_plan import AccumulationPlan

ENV = "ACCEL_GRADIENT_ACCUMULATION_STEPS"
ACCELERATE_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


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


def _train(accelerator: Accelerator, batches: int) -> int:
    """Run ``batches`` micro-batches; return how many times the optimizer stepped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(batches * 2, 2), torch.randn(batches * 2, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            steps += int(accelerator.sync_gradients)
            optimizer.zero_grad()
    return steps


def test_the_argument_is_parsed_once_on_the_way_to_the_optimizer_step(
    parses: list[object],
) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    assert _train(accelerator, batches=8) == 2
    assert parses == [4]
    assert accelerator.gradient_state.plan == AccumulationPlan(steps=4)
    assert type(accelerator.gradient_accumulation_steps) is int


def test_the_variable_is_parsed_once_on_the_way_to_the_optimizer_step(
    parses: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "2")
    accelerator = Accelerator(cpu=True)
    assert _train(accelerator, batches=4) == 2
    assert parses == ["2"]
    assert accelerator.gradient_state.plan.steps == 2


def test_a_plugin_is_parsed_once_when_it_is_built(parses: list[object]) -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    assert _train(accelerator, batches=4) == 2
    assert parses == [2]
    assert accelerator.gradient_state.plan == plugin.to_plan()


def test_setting_the_steps_keeps_the_plan_consistent() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    accelerator.gradient_accumulation_steps = 3
    assert accelerator.gradient_state.plan == AccumulationPlan(steps=3)
    assert accelerator.gradient_state.plugin_kwargs["num_steps"] == 3
    assert _train(accelerator, batches=6) == 2


# --- the DeepSpeed plugin reads the variable with the same parser ---------------------------


@pytest.mark.parametrize(
    ("variable", "raw", "expected"), [(ENV, "4", 4), (ENV, " 8 ", 8), (ACCELERATE_ENV, "3", 3)]
)
def test_the_deepspeed_plugin_reads_the_steps_with_the_accelerators_parser(
    monkeypatch: pytest.MonkeyPatch, parses: list[object], variable: str, raw: str, expected: int
) -> None:
    monkeypatch.setenv(variable, raw)
    plugin = DeepSpeedPlugin()
    assert plugin.gradient_accumulation_steps == expected
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == expected
    assert parses == [raw]


def test_without_the_variable_the_deepspeed_plugin_leaves_the_steps_to_prepare() -> None:
    plugin = DeepSpeedPlugin()
    assert plugin.gradient_accumulation_steps == "auto"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
    assert DeepSpeedPlugin(gradient_accumulation_steps=2).gradient_accumulation_steps == 2


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "2.5", "auto"])
def test_a_bad_variable_is_refused_by_the_deepspeed_plugin_as_by_the_accelerator(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError) as accelerator_error:
        make_gradient_accumulation_plugin()
    message = str(accelerator_error.value)
    assert message == f"{ENV}={raw!r}: must be an integer >= 1 (1 means no accumulation)"
    with pytest.raises(ValueError, match=re.escape(message)):
        DeepSpeedPlugin()


# --- the engines' optional capabilities -----------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "capabilities"),
    [
        (SingleDeviceEngine, set()),
        (DDPEngine, set()),
        (TensorParallelEngine, set()),
        (FSDP2Engine, {HasAveragingGroup}),
        (XLAEngine, {SumsOverAveragingWorld}),
        (DeepSpeedZeroEngine, {OwnsBackward}),
    ],
)
def test_each_engine_has_exactly_its_declared_capabilities(
    engine: type, capabilities: set[type]
) -> None:
    for capability in (HasAveragingGroup, SumsOverAveragingWorld, OwnsBackward):
        assert issubclass(engine, capability) == (capability in capabilities), capability
        # Declared, not only matched by name: a misspelt method would make the class abstract.
        assert (capability in engine.__mro__) == (capability in capabilities)


def test_an_engine_declaring_a_capability_it_misspells_cannot_be_built() -> None:
    class Forgotten(SingleDeviceEngine, HasAveragingGroup):
        def averaging_grop(self, model: Any) -> Any:
            return None

    with pytest.raises(TypeError, match="averaging_group"):
        Forgotten(None)  # type: ignore[abstract, arg-type]


def test_the_accelerators_engine_is_asked_through_the_protocols() -> None:
    accelerator = Accelerator(cpu=True)
    for capability in (HasAveragingGroup, SumsOverAveragingWorld, OwnsBackward):
        assert not isinstance(accelerator.engine, capability)


def test_a_deepspeed_run_asked_for_by_the_environment_reads_the_steps_once(
    parses: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # accel launch --use_deepspeed --gradient_accumulation_steps 4: the connector reads the
    # variable for the plan, and the DeepSpeed plugin it builds takes the plan's steps.
    from accel import options as options_module

    monkeypatch.setenv("ACCEL_USE_DEEPSPEED", "true")
    monkeypatch.setenv(ENV, "4")
    arguments: dict[str, Any] = {
        "device_placement": True,
        "split_batches": options_module.SPLIT_BATCHES_UNSET,
        "mixed_precision": None,
        "gradient_accumulation_steps": 1,
        "cpu": True,
        "dataloader_config": None,
        "engines": dict.fromkeys(
            (
                "deepspeed_plugin",
                "fsdp_plugin",
                "torch_tp_plugin",
                "megatron_lm_plugin",
                "deepspeed_plugins",
                "parallelism_config",
            )
        ),
        "rng_types": None,
        "log_with": None,
        "project_dir": None,
        "project_config": None,
        "gradient_accumulation_plugin": None,
        "step_scheduler_with_optimizer": True,
        "kwargs_handlers": None,
        "dynamo_backend": None,
        "dynamo_plugin": None,
    }
    options = options_module.AcceleratorOptions.from_arguments(**arguments)
    assert options.accumulation.num_steps == 4
    assert options.deepspeed_plugin.gradient_accumulation_steps == 4
    assert parses == ["4"]
    monkeypatch.delenv(ENV)
    options = options_module.AcceleratorOptions.from_arguments(**arguments)
    assert options.deepspeed_plugin.gradient_accumulation_steps == "auto"  # the config decides
