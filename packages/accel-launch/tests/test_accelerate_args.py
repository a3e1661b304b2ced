"""Accelerate's launcher helpers: an FSDP request reaches the processes, others are refused."""

from __future__ import annotations

import argparse

import pytest

from accel_launch.accelerate_args import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
from accel_launch.launch import LaunchError

pytestmark = pytest.mark.usefixtures("launch_environment")


@pytest.mark.torch_feature("fully_shard")
def test_use_fsdp_exports_the_switch_and_its_settings() -> None:
    args = argparse.Namespace(
        use_fsdp=True, fsdp_auto_wrap_policy="SIZE_BASED_WRAP", num_processes=2
    )
    env = prepare_multi_gpu_env(args)
    assert env["ACCEL_USE_FSDP"] == "true"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "SIZE_BASED_WRAP"
    assert env["FSDP_MIN_NUM_PARAMS"] == "100000000"  # Accelerate's launcher default
    assert args.nproc_per_node == "2"
    command, env = prepare_simple_launcher_cmd_env(
        argparse.Namespace(use_fsdp=True, training_script="train.py")
    )
    assert command[-1] == "train.py" and env["ACCEL_USE_FSDP"] == "true"


def test_a_namespace_without_an_engine_exports_none() -> None:
    env = prepare_multi_gpu_env(argparse.Namespace(num_processes=2))
    assert env.get("ACCEL_USE_FSDP") != "true"
    # Accelerate's parser fills every fsdp_* default; they count only with use_fsdp.
    defaults = argparse.Namespace(num_processes=2, fsdp_version="1", fsdp_offload_params="false")
    env = prepare_multi_gpu_env(defaults)
    assert env.get("ACCEL_USE_FSDP") != "true" and "FSDP_VERSION" not in env


def test_deepspeed_settings_reach_the_processes() -> None:
    env = prepare_multi_gpu_env(
        argparse.Namespace(use_deepspeed=True, zero_stage="3", num_processes=2)
    )
    assert env["ACCEL_USE_DEEPSPEED"] == "true" and env["ACCEL_DEEPSPEED_ZERO_STAGE"] == "3"


@pytest.mark.torch_feature("fully_shard")
def test_megatron_and_fsdp1_are_refused() -> None:
    with pytest.raises(LaunchError, match="Megatron-LM"):
        prepare_multi_gpu_env(argparse.Namespace(use_megatron_lm=True, num_processes=2))
    with pytest.raises(LaunchError, match="accel to-fsdp2"):
        prepare_multi_gpu_env(argparse.Namespace(use_fsdp=True, fsdp_version="1"))
