"""Engines this release lacks: the plugins build, the Accelerator refuses them, nothing trains.

Accelerate 1.15 drops an FSDP or DeepSpeed plugin on a CPU run without a word and trains DDP
(engines.md §8); accel refuses every such request before any process group exists, whether it
came as an argument or as an ``ACCEL_USE_*`` / ``ACCELERATE_USE_*`` switch.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

import accel
import accel.utils
from accel import Accelerator
from accel.engine_plugins import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    MegatronLMPlugin,
    TorchTensorParallelPlugin,
)
from accel.parallelism_config import ParallelismConfig
from accel_state import AcceleratorState, GradientState, PartialState
from accel_state.engine_requests import EngineUnavailableError
from accel_state.testing import MultiProcessError, run_on_cpu

# A sample of Accelerate 1.15's defaults (the full signatures are compared with Accelerate
# itself in tests-integration/test_accelerate_compat.py).
DEFAULTS: list[tuple[type, dict[str, Any]]] = [
    (
        FullyShardedDataParallelPlugin,
        # resolved in __post_init__ (fsdp_version defaults to 2: accel has no FSDP1)
        {"fsdp_version": 2, "limit_all_gathers": True, "reshard_after_forward": True},
    ),
    (
        DeepSpeedPlugin,
        # resolved in __post_init__ from the ACCEL_DEEPSPEED_* variables (Accelerate's defaults)
        {"zero_stage": 2, "gradient_clipping": "auto", "is_train_batch_min": True},
    ),
    (TorchTensorParallelPlugin, {"tp_size": 1, "torch_device_mesh": None}),
    (
        MegatronLMPlugin,
        {"weight_decay_incr_style": "constant", "lr_decay_style": "linear", "eval_iters": 100},
    ),
]


@pytest.mark.torch_feature("fully_shard")
@pytest.mark.parametrize(("cls", "defaults"), DEFAULTS)
def test_plugins_build_with_accelerates_defaults(cls: type, defaults: dict[str, Any]) -> None:
    plugin = cls()
    for name, value in defaults.items():
        assert getattr(plugin, name) == value, name
    assert dataclasses.is_dataclass(plugin)
    assert getattr(accel.utils, cls.__name__) is cls


@pytest.mark.torch_feature("fully_shard")
def test_plugins_take_keyword_arguments() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    assert (plugin.fsdp_version, plugin.reshard_after_forward) == (2, False)
    assert DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0).zero_stage == 3
    assert "hf_ds_config" in inspect.signature(DeepSpeedPlugin).parameters
    assert accel.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert accel.DeepSpeedPlugin is DeepSpeedPlugin
    assert accel.ParallelismConfig is ParallelismConfig


def _no_state_left() -> None:
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state == {}
    assert GradientState._shared_state == {}
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("argument", "value", "engine"),
    [
        ("megatron_lm_plugin", MegatronLMPlugin(), "Megatron-LM"),
    ],
)
def test_the_accelerator_refuses_every_engine_argument(
    argument: str, value: Any, engine: str
) -> None:
    with pytest.raises(EngineUnavailableError) as info:
        Accelerator(**{argument: value})
    message = str(info.value)
    assert message.startswith(engine)
    assert f"requested by Accelerator({argument}=...)" in message
    assert f"Remove {argument} from Accelerator(...) to train with DDP instead" in message
    _no_state_left()


@pytest.mark.parametrize(
    "variable",
    [
        "ACCEL_USE_MEGATRON_LM",
        "ACCELERATE_USE_MEGATRON_LM",
    ],
)
def test_the_accelerator_refuses_every_engine_switch(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "true")
    with pytest.raises(EngineUnavailableError, match=f"requested by {variable}=true"):
        Accelerator()
    _no_state_left()
    monkeypatch.setenv(variable, "false")
    Accelerator()  # a false switch asks for nothing


def _build_and_train(_: int) -> str:
    """One rank of a script launched with ACCEL_USE_MEGATRON_LM=true: it never reaches a step."""
    try:
        Accelerator()
    except NotImplementedError as error:
        return str(error)
    return "trained"


def test_two_ranks_under_a_switch_both_refuse_before_any_group() -> None:
    try:
        messages = run_on_cpu(
            _build_and_train, 0, world_size=2, timeout=60, env={"ACCEL_USE_MEGATRON_LM": "true"}
        )
    except MultiProcessError as error:  # pragma: no cover - the failure is the message
        pytest.fail(str(error))
    assert len(messages) == 2
    for message in messages:
        assert message.startswith("Megatron-LM was requested by")
        assert "ACCEL_USE_MEGATRON_LM=true in the environment" in message


@pytest.mark.torch_feature("fully_shard")
def test_fsdp1_is_refused_before_anything_starts() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1)  # building one still works
    with pytest.raises(ValueError, match=r"fsdp_version=1.*FSDP2 .*only.*accel to-fsdp2"):
        Accelerator(fsdp_plugin=plugin)
    _no_state_left()


@pytest.mark.torch_feature("fully_shard")
def test_fsdp_and_deepspeed_together_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="one run can train with one engine") as info:
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    message = str(info.value)
    assert "FSDP (fully sharded data parallel) by Accelerator(fsdp_plugin=...)" in message
    assert "DeepSpeed (ZeRO) by ACCEL_USE_DEEPSPEED=true in the environment" in message
    _no_state_left()


def test_a_deepspeed_plugin_of_another_type_is_refused_before_anything_starts() -> None:
    with pytest.raises(TypeError, match="pass an accel.DeepSpeedPlugin"):
        Accelerator(deepspeed_plugin=object())
    _no_state_left()
