"""The engine seam: the selection table, the protocol the accumulator needs, one-process rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from accel import Accelerator
from accel.engines import ENGINES, EngineOptions, select_engine
from accel.engines.ddp import DDPEngine
from accel.engines.fsdp2 import FSDP2Engine
from accel.engines.single import SingleDeviceEngine
from accel.handlers import TorchDynamoPlugin
from accel_amp import GradientSync, PrecisionPolicy
from accel_state import AcceleratorState, DistributedType


class _State:
    """Stands for an AcceleratorState with a chosen distributed type."""

    def __init__(self, distributed_type: DistributedType) -> None:
        self.distributed_type = distributed_type
        self.device = torch.device("cpu")
        self.use_distributed = distributed_type != DistributedType.NO
        self.is_main_process = True
        self.local_process_index = 0


def _options(distributed_type: DistributedType) -> EngineOptions:
    return EngineOptions(
        state=_State(distributed_type),  # type: ignore[arg-type]
        policy=PrecisionPolicy.resolve("no"),
        dynamo_plugin=TorchDynamoPlugin(),
    )


@pytest.mark.parametrize(
    ("distributed_type", "engine"),
    [
        (DistributedType.NO, SingleDeviceEngine),
        (DistributedType.MULTI_CPU, DDPEngine),
        (DistributedType.MULTI_GPU, DDPEngine),
        (DistributedType.MULTI_XPU, DDPEngine),
    ],
)
def test_the_table_picks_the_engine_of_the_distributed_type(
    distributed_type: DistributedType, engine: type
) -> None:
    assert isinstance(select_engine(_options(distributed_type)), engine)
    assert ENGINES[DistributedType.FSDP].endswith(":FSDP2Engine")


@pytest.mark.parametrize("distributed_type", [DistributedType.MEGATRON_LM])
def test_a_type_without_an_engine_lists_the_choices(distributed_type: DistributedType) -> None:
    with pytest.raises(ValueError, match="no training engine for distributed_type=") as info:
        select_engine(_options(distributed_type))
    assert "DistributedType.MULTI_CPU" in str(info.value)
    assert "DistributedType.FSDP" in str(info.value)


@pytest.mark.parametrize("engine", [SingleDeviceEngine, DDPEngine, FSDP2Engine])
def test_every_engine_is_a_gradient_sync(engine: type) -> None:
    # accel-amp's accumulator drives engines through this protocol, without importing accel.
    for method in ("no_sync", "grads_averaged_over", "clip_grad_norm_", "clip_grad_value_"):
        assert callable(getattr(engine, method))
    assert isinstance(select_engine(_options(DistributedType.NO)), GradientSync)


def test_the_accelerator_asks_its_engine() -> None:
    accelerator = Accelerator()
    assert isinstance(accelerator.engine, SingleDeviceEngine)
    assert accelerator.accumulator.sync is accelerator.engine
    assert (accelerator.is_fsdp2, accelerator.multi_device) == (False, False)
    assert accelerator.deepspeed_plugin is None
    assert "engine=single device" in repr(accelerator)


@pytest.mark.torch_feature("fully_shard")
def test_cpu_offload_policy_is_refused_on_a_cpu_run_before_anything_starts() -> None:
    from accel.utils import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match=r"cpu_offload=True.*CPUOffloadPolicy.*cpu_offload=False"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_offload=True))
    assert not torch.distributed.is_initialized()
    assert AcceleratorState._shared_state == {}


def test_a_failed_prepare_registers_nothing() -> None:
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    bad: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    bad.param_groups = "not a list"  # AcceleratedOptimizer cannot read it
    with pytest.raises(Exception):  # noqa: B017 - whatever the optimizer raises
        accelerator.prepare(model, bad)
    assert accelerator._models == [] and accelerator._optimizers == []
    assert accelerator.accumulator.models == []


def test_the_engine_is_decided_once_from_requests_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connector (accel.options) reads the environment's engine switches; the state
    # decides from those requests and does not read them again; select_engine builds the
    # decided row's class without deciding anything.
    import accel.options
    import accel_state.state
    from accel_state import engine_requests

    reads: list[int] = []

    def counted(environ: Any) -> list[engine_requests.EngineRequest]:
        reads.append(1)
        return engine_requests.environment_requests(environ)

    decisions: list[str] = []

    def decided(*args: Any, **kwargs: Any) -> engine_requests.EngineSpec:
        spec = engine_requests.decide_engine(*args, **kwargs)
        decisions.append(spec.key)
        return spec

    monkeypatch.setattr(accel.options, "environment_requests", counted)
    monkeypatch.setattr(accel_state.state, "environment_requests", counted)
    monkeypatch.setattr(accel_state.state, "decide_engine", decided)
    accelerator = Accelerator()
    assert (len(reads), decisions) == (1, ["single"])
    assert accelerator.state.engine.key == "single"
    assert isinstance(accelerator.engine, SingleDeviceEngine)


def test_select_engine_builds_the_states_decision() -> None:
    from accel.engines import engine_class
    from accel_state.engine_requests import ENGINES as REQUESTABLE
    from accel_state.engine_requests import REGISTRY

    ddp = next(spec for spec in REGISTRY if spec.key == "ddp")
    options = dataclasses.replace(_options(DistributedType.NO), engine=ddp)
    assert isinstance(select_engine(options), DDPEngine)  # the decision, not the type
    assert engine_class(REQUESTABLE["fsdp"]) is FSDP2Engine
    with pytest.raises(ValueError, match="Megatron-LM has no engine class"):
        engine_class(REQUESTABLE["megatron_lm"])
