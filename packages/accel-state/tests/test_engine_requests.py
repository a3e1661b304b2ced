"""Engine requests: where each comes from, and the refusal of an engine this release lacks."""

from __future__ import annotations

import dataclasses

import pytest

from accel_state import engine_requests
from accel_state.engine_requests import (
    ENGINES,
    EngineRequest,
    EngineUnavailableError,
    accelerate_switch,
    argument_requests,
    environment_requests,
    refuse_conflicting_engines,
    refuse_unavailable_engines,
)


def test_the_table_names_every_engine_and_which_are_available() -> None:
    assert list(ENGINES) == ["fsdp", "deepspeed", "megatron_lm", "parallelism_config", "xla"]
    available = [key for key, spec in ENGINES.items() if spec.available]
    assert available == ["fsdp", "deepspeed", "parallelism_config", "xla"]
    assert {spec.flag for spec in ENGINES.values()} == {
        "--use_fsdp",
        "--use_deepspeed",
        "--use_megatron_lm",
        "--use_parallelism_config",
        "--tpu",
    }


def test_the_refusal_names_the_engine_the_source_and_what_to_do() -> None:
    request = EngineRequest("megatron_lm", "--use_megatron_lm", "drop --use_megatron_lm")
    with pytest.raises(EngineUnavailableError) as info:
        refuse_unavailable_engines([request])
    assert str(info.value).startswith(
        "Megatron-LM was requested by --use_megatron_lm, but this release of accel does not "
        "implement it, so nothing was started. Drop --use_megatron_lm to train with DDP "
        "instead."
    )
    assert str(info.value).endswith(
        "accel never trains with another engine than the one asked for."
    )
    assert info.value.request is request
    assert isinstance(info.value, NotImplementedError)


def test_megatron_says_what_its_alternative_is() -> None:
    with pytest.raises(EngineUnavailableError) as info:
        refuse_unavailable_engines([EngineRequest("megatron_lm", "x", "drop x")])
    assert "accel deliberately does not build Megatron-LM (its own loop" in str(info.value)
    assert "trains with FSDP2 and tensor parallelism" in str(info.value)


def test_nothing_asked_nothing_refused() -> None:
    refuse_unavailable_engines([])


def test_an_available_engine_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    table = dict(ENGINES)
    table["megatron_lm"] = dataclasses.replace(ENGINES["megatron_lm"], available=True)
    table["xla"] = dataclasses.replace(ENGINES["xla"], available=False)
    monkeypatch.setattr(engine_requests, "ENGINES", table)
    refuse_unavailable_engines([EngineRequest("megatron_lm", "x", "drop x")])
    refuse_unavailable_engines(
        [EngineRequest("deepspeed", "--use_deepspeed", "drop --use_deepspeed")]
    )
    with pytest.raises(EngineUnavailableError, match="XLA / TPU"):
        refuse_unavailable_engines(
            [
                EngineRequest("deepspeed", "--use_deepspeed", "drop --use_deepspeed"),
                EngineRequest("xla", "--tpu", "drop --tpu"),
            ]
        )


def test_an_unknown_engine_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="engine='zero'.*choose one of fsdp, deepspeed"):
        EngineRequest("zero", "x", "y")


def test_environment_requests_read_accel_and_accelerate_switches() -> None:
    assert environment_requests({}) == []
    assert environment_requests({"ACCEL_USE_FSDP": "false", "ACCELERATE_USE_FSDP": "0"}) == []
    assert environment_requests({"ACCEL_USE_FSDP": " "}) == []
    found = environment_requests(
        {"ACCEL_USE_DEEPSPEED": "TRUE", "ACCELERATE_USE_PARALLELISM_CONFIG": "1"}
    )
    assert [request.engine for request in found] == ["deepspeed", "parallelism_config"]
    assert found[0].source == (
        "ACCEL_USE_DEEPSPEED=TRUE in the environment (`accel launch --use_deepspeed` sets it)"
    )
    assert found[0].undo == "unset ACCEL_USE_DEEPSPEED"
    assert found[1].source == (
        "ACCELERATE_USE_PARALLELISM_CONFIG=1 in the environment (Accelerate's name for "
        "ACCEL_USE_PARALLELISM_CONFIG; `accelerate launch --use_parallelism_config` sets it)"
    )


def test_a_switch_that_is_no_truth_value_names_itself() -> None:
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_FSDP='sure'.*invalid truth value"):
        environment_requests({"ACCELERATE_USE_FSDP": "sure"})


def test_argument_requests_map_every_plugin_argument() -> None:
    given = {
        "deepspeed_plugin": object(),
        "deepspeed_plugins": {"a": object()},
        "fsdp_plugin": object(),
        "megatron_lm_plugin": object(),
        "torch_tp_plugin": object(),
        "parallelism_config": object(),
        "mixed_precision": "bf16",
        "cpu": None,
    }
    found = argument_requests("Accelerator", given)
    assert [request.engine for request in found] == [
        "deepspeed",
        "deepspeed",
        "fsdp",
        "megatron_lm",
        "parallelism_config",
        "parallelism_config",
    ]
    assert found[2].source == "Accelerator(fsdp_plugin=...)"
    assert found[2].undo == "remove fsdp_plugin from Accelerator(...)"
    assert argument_requests("Accelerator", {"fsdp_plugin": None}) == []


def test_accelerate_switch_names() -> None:
    assert accelerate_switch("ACCEL_USE_FSDP") == "ACCELERATE_USE_FSDP"


def test_two_engines_that_own_the_model_conflict() -> None:
    refuse_conflicting_engines([EngineRequest("fsdp", "--use_fsdp", "drop it")])
    refuse_conflicting_engines(
        [
            EngineRequest("fsdp", "--use_fsdp", "drop it"),
            EngineRequest("parallelism_config", "--use_parallelism_config", "drop it"),
        ]
    )
    with pytest.raises(ValueError, match="several were asked for") as info:
        refuse_conflicting_engines(
            [
                EngineRequest("fsdp", "--use_fsdp", "drop it"),
                EngineRequest("deepspeed", "ACCEL_USE_DEEPSPEED=true", "unset it"),
            ]
        )
    assert "FSDP (fully sharded data parallel) by --use_fsdp" in str(info.value)
    assert "DeepSpeed (ZeRO) by ACCEL_USE_DEEPSPEED=true" in str(info.value)
