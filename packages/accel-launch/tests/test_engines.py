"""DeepSpeed and FSDP launch settings: resolution, checks, and the variables handed over."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from accel_launch.cli import build_parser, main
from accel_launch.config import ClusterConfig, load_config_from_file
from accel_launch.engines import (
    DEEPSPEED_KEYS,
    FSDP_KEYS,
    engine_environment,
    resolve_engine_settings,
)
from accel_launch.launch import plan_launch
from accel_state.environment import CONTRACT

pytestmark = pytest.mark.usefixtures("launch_environment")


def resolve(
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    config: ClusterConfig | None = None,
) -> dict[str, tuple[Any, str]]:
    out = resolve_engine_settings(flags or {}, environ or {}, config, "cfg.yaml")
    return {key: (item.value, item.source) for key, item in out.items()}


def test_every_variable_belongs_to_the_contract() -> None:
    for key in (*DEEPSPEED_KEYS, *FSDP_KEYS):
        assert key.variable in CONTRACT, key
    assert {key.name for key in FSDP_KEYS} >= {
        "fsdp_version",
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_state_dict_type",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_activation_checkpointing",
    }


def test_no_engine_by_default() -> None:
    assert resolve() == {"engine": ("none", "default")}
    assert engine_environment(resolve_engine_settings({}, {}, None, None)) == {}


def test_deepspeed_flags_become_the_contract_variables() -> None:
    flags = {
        "engine": "deepspeed",
        "zero_stage": "3",
        "offload_optimizer_device": "CPU",
        "offload_param_device": "cpu",
        "gradient_clipping": "1.0",
        "zero3_init_flag": "true",
        "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock",
    }
    settings = resolve_engine_settings(flags, {}, None, None)
    assert settings["zero_stage"].value == 3 and settings["zero_stage"].source == "flag"
    assert settings["zero3_save_16bit_model"].value is None  # unset: the plugin decides
    env = engine_environment(settings)
    assert env == {
        "ACCEL_USE_DEEPSPEED": "true",
        "ACCEL_DEEPSPEED_ZERO_STAGE": "3",
        "ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
        "ACCEL_GRADIENT_CLIPPING": "1.0",
        "ACCEL_DEEPSPEED_ZERO3_INIT": "true",
        "ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES": "MixtralSparseMoeBlock",
        "ACCEL_CONFIG_DS_FIELDS": "",
    }


def test_fsdp_flags_become_the_fsdp_variables() -> None:
    flags = {
        "engine": "fsdp",
        "fsdp_version": "2",
        "fsdp_reshard_after_forward": "false",
        "fsdp_auto_wrap_policy": "transformer_based_wrap",
        "fsdp_transformer_layer_cls_to_wrap": "Block,Head",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": "true",
        "fsdp_activation_checkpointing": "yes",
    }
    env = engine_environment(resolve_engine_settings(flags, {}, None, None))
    assert env == {
        "ACCEL_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Head",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
    }


def _config(tmp_path: Path, text: str) -> ClusterConfig:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config_from_file(path)


def test_precedence_flag_env_config_for_engine_settings(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_version: 2\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
        "  fsdp_offload_params: false\n  fsdp_activation_checkpointing: false\n",
    )
    resolved = resolve(
        {"fsdp_activation_checkpointing": "true"},
        {"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"},
        config,
    )
    assert resolved["engine"] == ("fsdp", "config cfg.yaml")
    assert resolved["fsdp_version"] == (2, "config cfg.yaml")
    assert resolved["fsdp_state_dict_type"] == ("SHARDED_STATE_DICT", "env FSDP_STATE_DICT_TYPE")
    assert resolved["fsdp_activation_checkpointing"] == (True, "flag")
    assert resolved["fsdp_offload_params"] == (False, "config cfg.yaml")
    assert resolved["fsdp_min_num_params"] == (None, "default")


def test_engine_from_environment_and_from_an_explicit_paradigm(tmp_path: Path) -> None:
    assert resolve(environ={"ACCEL_USE_DEEPSPEED": "1"})["engine"] == (
        "deepspeed",
        "env ACCEL_USE_DEEPSPEED",
    )
    with pytest.raises(ValueError, match="ACCEL_USE_DEEPSPEED=true and ACCEL_USE_FSDP=true"):
        resolve(environ={"ACCEL_USE_DEEPSPEED": "true", "ACCEL_USE_FSDP": "yes"})
    config = _config(tmp_path, "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    # --cpu or --multi_gpu (engine "none" from a flag) wins over the config's engine.
    assert resolve({"engine": "none"}, config=config) == {"engine": ("none", "flag")}
    assert resolve(config=_config(tmp_path, "distributed_type: MULTI_CPU\n"))["engine"] == (
        "none",
        "config cfg.yaml",
    )


def test_config_deepspeed_fields_are_listed_like_accelerate(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "distributed_type: DEEPSPEED\nmixed_precision: fp16\ndeepspeed_config:\n"
        "  zero_stage: 2\n  gradient_accumulation_steps: 4\n  offload_optimizer_device: none\n",
    )
    settings = resolve_engine_settings({}, {}, config, "cfg.yaml")
    assert settings["zero_stage"].value == 2
    assert settings["offload_optimizer_device"].value == "none"
    env = engine_environment(settings, config)
    fields = env["ACCEL_CONFIG_DS_FIELDS"].split(",")
    assert fields == [
        "zero_stage",
        "gradient_accumulation_steps",
        "offload_optimizer_device",
        "mixed_precision",
    ]


def test_a_config_value_of_none_means_unset(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: none\n"
        "  offload_param_nvme_path: none\n",
    )
    resolved = resolve(config=config)
    assert resolved["deepspeed_config_file"] == (None, "default")
    assert resolved["offload_param_nvme_path"] == (None, "default")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"engine": "fsdp", "zero_stage": "2"}, "--zero_stage is a setting of deepspeed"),
        ({"fsdp_version": "2"}, "pass --use_fsdp"),
        ({"engine": "deepspeed", "zero_stage": "4"}, "zero_stage='4' (from flag) is not one of"),
        (
            {"engine": "deepspeed", "offload_param_device": "disk"},
            "offload_param_device='disk' (from flag) is not one of none, cpu, nvme",
        ),
        (
            {"engine": "deepspeed", "offload_optimizer_device": "nvme"},
            "needs --offload_optimizer_nvme_path",
        ),
        (
            {"engine": "deepspeed", "zero_stage": "2", "offload_param_device": "cpu"},
            "needs ZeRO stage 3",
        ),
        (
            {"engine": "deepspeed", "zero_stage": "1", "zero3_save_16bit_model": "true"},
            "applies to ZeRO stage 3 only",
        ),
        ({"engine": "deepspeed", "gradient_clipping": "0"}, "must be > 0"),
        (
            {"engine": "deepspeed", "deepspeed_config_file": "/nowhere/ds.json"},
            "does not exist",
        ),
        (
            {"engine": "fsdp", "fsdp_version": "3"},
            "fsdp_version='3' (from flag) is not 2 (FSDP2)",
        ),
        (
            {"engine": "fsdp", "fsdp_sharding_strategy": "SHARD_EVERYTHING"},
            "is not one of FULL_SHARD",
        ),
        (
            {"engine": "fsdp", "fsdp_version": "2", "fsdp_reshard_after_forward": "NO_SHARD"},
            "FSDP2 takes true or false",
        ),
        ({"engine": "fsdp", "fsdp_reshard_after_forward": "maybe"}, "neither true/false"),
        (
            {"engine": "fsdp", "fsdp_version": "2", "fsdp_state_dict_type": "local_state_dict"},
            "does not exist in FSDP2",
        ),
        (
            {
                "engine": "fsdp",
                "fsdp_cpu_ram_efficient_loading": "true",
                "fsdp_sync_module_states": "false",
            },
            "set fsdp_sync_module_states to true",
        ),
        (
            {"engine": "fsdp", "fsdp_activation_checkpointing_offload": "true"},
            "needs fsdp_activation_checkpointing=true",
        ),
        (
            {"engine": "fsdp", "fsdp_version": "1"},
            "accel implements FSDP2 (fully_shard) only",
        ),
        (
            {
                "engine": "fsdp",
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_transformer_layer_cls_to_wrap": "Block",
            },
            "used by the TRANSFORMER_BASED_WRAP policy only",
        ),
        ({"engine": "fsdp", "fsdp_offload_params": "sometimes"}, "is not a boolean"),
    ],
)
def test_bad_engine_settings_are_named(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(flags)


def test_a_deepspeed_json_takes_its_settings_from_the_file(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    settings = resolve_engine_settings(
        {"engine": "deepspeed", "deepspeed_config_file": str(ds)}, {}, None, None
    )
    assert engine_environment(settings)["ACCEL_DEEPSPEED_CONFIG_FILE"] == str(ds.resolve())
    with pytest.raises(ValueError, match="zero_stage=3 \\(from env ACCEL_DEEPSPEED_ZERO_STAGE\\)"):
        resolve(
            {"engine": "deepspeed", "deepspeed_config_file": str(ds)},
            {"ACCEL_DEEPSPEED_ZERO_STAGE": "3"},
        )


@pytest.mark.usefixtures("engines_available")
def test_dry_run_prints_the_engine_rows_and_exports_them(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch", "--use_deepspeed", "--zero-stage", "2", "--num_processes", "2", script]
    plan = plan_launch(build_parser().parse_args(argv), os.environ)
    assert plan["env"]["ACCEL_USE_DEEPSPEED"] == "true"
    assert plan["env"]["ACCEL_DEEPSPEED_ZERO_STAGE"] == "2"
    assert "--nproc_per_node" in plan["command"]
    assert main([*argv[:-1], "--dry_run", script]) == 0
    table = capsys.readouterr().err
    assert "engine" in table and "deepspeed" in table
    assert any(line.split("|")[0].strip() == "zero_stage" for line in table.splitlines())


def test_no_engine_rows_without_an_engine(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--cpu", "--dry_run", script]) == 0
    assert "zero_stage" not in capsys.readouterr().err


def test_deepspeed_launcher_options_are_refused(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch", "--use_deepspeed", "--deepspeed_hostfile", "/etc/hosts", "--dry_run"]
    assert main([*argv, script]) == 2
    err = capsys.readouterr().err
    assert "--deepspeed_hostfile='/etc/hosts'" in err and "one `accel launch` per machine" in err


def test_help_lists_the_engine_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = capsys.readouterr().out
    assert "--zero_stage" in out and "--fsdp_state_dict_type" in out
    assert "--deepspeed_hostfile" not in out
