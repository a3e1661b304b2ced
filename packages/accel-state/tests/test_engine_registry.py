"""The engine registry: one row per engine, one decision, read by every consumer."""

from __future__ import annotations

import dataclasses

import pytest

from accel_state import DistributedType, engine_requests
from accel_state.engine_requests import (
    ENGINES,
    REGISTRY,
    EngineRequest,
    EngineSpec,
    argument_requests,
    config_requests,
    decide_engine,
    engine_for_distributed_type,
    environment_requests,
    refuse_conflicting_engines,
)


def _request(engine: str) -> EngineRequest:
    return EngineRequest(engine, f"--{engine}", f"drop --{engine}")


def test_every_row_is_complete_and_the_request_table_is_a_view_of_it() -> None:
    keys = [spec.key for spec in REGISTRY]
    assert len(keys) == len(set(keys))
    assert ENGINES == {spec.key: spec for spec in REGISTRY if spec.requestable}
    for spec in REGISTRY:
        if spec.available:
            assert spec.engine_class is not None, spec.key
            module, _, name = spec.engine_class.partition(":")
            assert module.startswith("accel.engines.") and name, spec.engine_class
        if spec.exclusive:
            assert spec.distributed_type is not None and spec.arguments, spec.key
        if spec.requestable:
            assert spec.flag.startswith("--") and spec.instead, spec.key
        else:
            assert spec.layouts and spec.switch is None, spec.key
    # each layout belongs to one row
    layouts = [kind for spec in REGISTRY for kind in spec.layouts]
    assert len(layouts) == len(set(layouts))


@pytest.mark.parametrize(
    ("asked", "layout", "tensor_parallel", "expected"),
    [
        ([], DistributedType.NO, False, "single"),
        ([], DistributedType.MULTI_CPU, False, "ddp"),
        ([], DistributedType.MULTI_GPU, True, "ddp"),  # a config without a request: none
        ([], DistributedType.XLA, False, "xla"),
        (["fsdp"], DistributedType.NO, False, "fsdp"),
        (["fsdp"], DistributedType.MULTI_CPU, False, "fsdp"),
        (["deepspeed"], DistributedType.MULTI_GPU, False, "deepspeed"),
        (["parallelism_config"], DistributedType.MULTI_CPU, True, "parallelism_config"),
        (["parallelism_config"], DistributedType.MULTI_CPU, False, "ddp"),
        (["parallelism_config"], DistributedType.NO, True, "single"),
        (["parallelism_config", "fsdp"], DistributedType.MULTI_CPU, True, "fsdp"),
    ],
)
def test_the_decision(
    asked: list[str], layout: DistributedType, tensor_parallel: bool, expected: str
) -> None:
    spec = decide_engine([_request(key) for key in asked], layout, tensor_parallel=tensor_parallel)
    assert spec.key == expected


def test_the_decision_reports_the_distributed_type() -> None:
    assert decide_engine([_request("fsdp")], DistributedType.MULTI_CPU).distributed_type == (
        DistributedType.FSDP
    )
    assert decide_engine([], DistributedType.MULTI_CPU).distributed_type is None  # the layout's


def test_a_layout_without_an_engine_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError, match="no training engine for .*MULTI_NEURON.*MULTI_CPU"):
        engine_for_distributed_type(DistributedType.MULTI_NEURON)
    with pytest.raises(ValueError, match="no training engine for .*MEGATRON_LM"):
        engine_for_distributed_type(DistributedType.MEGATRON_LM)  # a row without a class


def test_config_files_ask_by_the_rows_distributed_type() -> None:
    assert [r.engine for r in config_requests(DistributedType.FSDP, False, "cfg")] == ["fsdp"]
    assert [r.engine for r in config_requests(DistributedType.XLA, True, "cfg")] == [
        "xla",
        "parallelism_config",
    ]
    assert config_requests(DistributedType.MULTI_GPU, False, "cfg") == []


def test_a_new_row_is_seen_by_every_way_of_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = EngineSpec(
        "toy",
        "Toy engine",
        "ACCEL_USE_TOY",
        "--use_toy",
        True,
        "train with DDP",
        engine_class="accel.engines.toy:ToyEngine",
        distributed_type=DistributedType.MEGATRON_LM,
        arguments=("toy_plugin",),
        exclusive=True,
    )
    table = {**ENGINES, "toy": toy}
    monkeypatch.setattr(engine_requests, "ENGINES", table)
    assert [r.engine for r in argument_requests("Accelerator", {"toy_plugin": object()})] == ["toy"]
    assert [r.engine for r in environment_requests({"ACCELERATE_USE_TOY": "1"})] == ["toy"]
    assert decide_engine([_request("toy")], DistributedType.MULTI_CPU) is toy
    with pytest.raises(ValueError, match="Toy engine by --toy"):
        refuse_conflicting_engines([_request("toy"), _request("fsdp")])
    replaced = dataclasses.replace(toy, exclusive=False)
    monkeypatch.setattr(engine_requests, "ENGINES", {**ENGINES, "toy": replaced})
    refuse_conflicting_engines([_request("toy"), _request("fsdp")])
