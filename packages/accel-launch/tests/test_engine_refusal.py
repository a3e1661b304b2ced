"""``accel launch`` refuses an engine this release lacks, whichever way it was asked for.

Each path (flag, environment switch under accel's or Accelerate's name, config file) must stop
the launch before any process starts, naming the engine, where the request came from and how
to withdraw it. A paradigm flag (``--cpu``, ``--multi_gpu``) outranks a switch in the shell, and
the processes are then told so (the switch is exported as false).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_launch.cli import build_parser, main
from accel_launch.launch import LaunchError, plan_launch

ENGINE_TITLES = {
    "fsdp": "FSDP (fully sharded data parallel)",
    "deepspeed": "DeepSpeed (ZeRO)",
    "megatron_lm": "Megatron-LM",
    "parallelism_config": "ParallelismConfig (HSDP, tensor, context and sequence parallelism)",
}


pytestmark = pytest.mark.usefixtures("launch_environment")


def refusal(argv: list[str], environ: dict[str, str] | None = None) -> str:
    args = build_parser().parse_args(["launch", *argv])
    with pytest.raises(LaunchError) as info:
        plan_launch(args, {**os.environ, **(environ or {})})
    return str(info.value)


@pytest.mark.parametrize(
    ("flags", "engine", "source"),
    [
        (["--use_megatron_lm"], "megatron_lm", "--use_megatron_lm"),
    ],
)
def test_engine_flags_are_refused(script: str, flags: list[str], engine: str, source: str) -> None:
    message = refusal([*flags, "--num_processes", "2", script])
    assert message.startswith(f"accel launch: {ENGINE_TITLES[engine]} was requested by {source}")
    assert f"Drop {source}" in message
    assert "nothing was started" in message


@pytest.mark.parametrize(
    ("variable", "engine"),
    [
        ("ACCEL_USE_MEGATRON_LM", "megatron_lm"),
        ("ACCELERATE_USE_MEGATRON_LM", "megatron_lm"),
    ],
)
def test_engine_switches_are_refused(script: str, variable: str, engine: str) -> None:
    message = refusal(["--num_processes", "2", script], {variable: "true"})
    assert f"{ENGINE_TITLES[engine]} was requested by {variable}=true in the environment" in (
        message
    )
    assert f"Unset {variable}" in message


@pytest.mark.parametrize(
    ("kind", "engine"),
    [("MEGATRON_LM", "megatron_lm")],
)
def test_config_files_are_refused(tmp_path: Path, script: str, kind: str, engine: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(f"distributed_type: {kind}\nnum_processes: 2\n")
    message = refusal(["--config_file", str(config), script])
    assert f"{ENGINE_TITLES[engine]} was requested by distributed_type: {kind} in {config}" in (
        message
    )
    assert f"Set distributed_type to MULTI_CPU or MULTI_GPU in {config}" in message


def _plan(argv: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    args = build_parser().parse_args(["launch", *argv])
    return dict(plan_launch(args, {**os.environ, **(environ or {})})["env"])


@pytest.mark.torch_feature("fully_shard")
def test_parallelism_flags_reach_the_processes(script: str) -> None:
    env = _plan(
        [
            "--use_fsdp",
            "--use_parallelism_config",
            "--parallelism_config_dp_replicate_size",
            "2",
            "--parallelism_config_dp_shard_size",
            "2",
            "--num_processes",
            "4",
            script,
        ]
    )
    assert env["ACCEL_USE_FSDP"] == "true"
    assert env["ACCEL_USE_PARALLELISM_CONFIG"] == "true"
    assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    # a size flag alone asks for the config too
    env = _plan(["--parallelism_config_dp_shard_size", "2", "--num_processes", "2", script])
    assert env["ACCEL_USE_PARALLELISM_CONFIG"] == "true"
    assert "ACCEL_USE_PARALLELISM_CONFIG" not in _plan(["--num_processes", "2", script])


def test_a_parallelism_switch_in_the_shell_asks_unless_a_paradigm_flag_outranks_it(
    script: str,
) -> None:
    shell = {"ACCEL_USE_PARALLELISM_CONFIG": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "1"}
    env = _plan(["--num_processes", "2", script], shell)
    assert "ACCEL_USE_PARALLELISM_CONFIG" not in env  # inherited from the shell: it asks
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env
    env = _plan(["--cpu", "--num_processes", "2", script], shell)
    assert env["ACCEL_USE_PARALLELISM_CONFIG"] == "false"
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"
    flagged = ["--cpu", "--use_parallelism_config", "--num_processes", "2", script]
    assert _plan(flagged, shell)["ACCEL_USE_PARALLELISM_CONFIG"] == "true"  # the flag asks


def test_a_parallelism_config_section_reaches_the_processes_flags_win(
    tmp_path: Path, script: str
) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nparallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n  dp_shard_size: 1\n"
    )
    env = _plan(["--config_file", str(config), script])
    assert env["ACCEL_USE_PARALLELISM_CONFIG"] == "true"
    assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "1"
    flagged = ["--config_file", str(config), "--parallelism_config_dp_replicate_size", "1"]
    assert _plan([*flagged, script])["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "1"


def test_sequence_parallelism_is_refused_before_any_process(tmp_path: Path, script: str) -> None:
    message = refusal(["--parallelism_config_sp_size", "2", "--num_processes", "2", script])
    assert "parallelism_config_sp_size=2 asks for sequence parallelism" in message
    assert "nothing was started" in message and "drop --parallelism_config_sp_size" in message
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nparallelism_config:\n"
        "  parallelism_config_sp_size: 2\n"
    )
    assert "asks for sequence parallelism" in refusal(["--config_file", str(config), script])


def test_tensor_and_context_sizes_reach_the_processes(script: str) -> None:
    flags = ["--parallelism_config_tp_size", "2", "--parallelism_config_cp_size", "1"]
    env = _plan([*flags, "--num_processes", "2", script])
    assert env["ACCEL_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_CP_SIZE"]) == ("2", "1")


def test_the_cli_exits_2_and_prints_the_refusal(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--use_megatron_lm", "--num_processes", "2", script]) == 2
    captured = capsys.readouterr()
    assert "Megatron-LM was requested by --use_megatron_lm" in captured.err
    assert captured.out == ""


def test_a_paradigm_flag_outranks_a_switch_and_tells_the_processes(script: str) -> None:
    environ = {**os.environ, "ACCEL_USE_FSDP": "true", "ACCELERATE_USE_DEEPSPEED": "1"}
    for flag in ("--cpu", "--multi_gpu"):
        args = build_parser().parse_args(["launch", flag, "--num_processes", "2", script])
        plan = plan_launch(args, environ)
        assert plan["env"]["ACCEL_USE_FSDP"] == "false"
        assert plan["env"]["ACCELERATE_USE_DEEPSPEED"] == "false"
        assert "ACCEL_USE_MEGATRON_LM" not in plan["env"]  # only the switches that were set


def test_a_paradigm_flag_outranks_the_config_file(tmp_path: Path, script: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    args = build_parser().parse_args(["launch", "--config_file", str(config), "--cpu", script])
    plan = plan_launch(args, os.environ)
    assert "ACCEL_USE_FSDP" not in plan["env"]


def test_the_flag_is_reported_before_a_switch(script: str) -> None:
    message = refusal(["--use_megatron_lm", script], {"ACCEL_USE_PARALLELISM_CONFIG": "true"})
    assert "Megatron-LM was requested by --use_megatron_lm" in message


def test_a_switch_without_a_truth_value_is_named(script: str) -> None:
    message = refusal([script], {"ACCEL_USE_FSDP": "perhaps"})
    assert "ACCEL_USE_FSDP='perhaps'" in message


@pytest.mark.torch_feature("fully_shard")
def test_fsdp_reaches_the_processes_with_its_settings(tmp_path: Path, script: str) -> None:
    flags = ["--use_fsdp", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"]
    flags += ["--fsdp_min_num_params", "1000", "--num_processes", "2", script]
    args = build_parser().parse_args(["launch", *flags])
    env = plan_launch(args, os.environ)["env"]
    assert env["ACCEL_USE_FSDP"] == "true"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "SIZE_BASED_WRAP"
    assert env["FSDP_MIN_NUM_PARAMS"] == "1000"
    config = tmp_path / "cfg.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    args = build_parser().parse_args(["launch", "--config_file", str(config), script])
    env = plan_launch(args, os.environ)["env"]
    assert env["ACCEL_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"


@pytest.mark.torch_feature("fully_shard")
def test_fsdp1_is_refused_before_any_process(script: str) -> None:
    message = refusal(["--use_fsdp", "--fsdp_version", "1", "--num_processes", "2", script])
    assert "fsdp_version='1' (from flag)" in message and "accel to-fsdp2" in message
