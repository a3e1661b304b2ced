"""The ``accel launch`` namespace: Accelerate's parser defaults, ``nondefault``, and the launcher
counting only what was typed. Golden values: Accelerate 1.15's ``launch_command_parser()``."""

from __future__ import annotations

import argparse
import os

import pytest

from accel_launch.arguments import ACCELERATE_LAUNCH_DEFAULTS, typed_arguments
from accel_launch.cli import build_parser, launch_parser
from accel_launch.launch import plan_launch

pytestmark = pytest.mark.usefixtures("launch_environment")


def test_a_parse_has_accelerates_defaults() -> None:
    args = launch_parser().parse_args(["train.py"])
    assert args.fsdp_sync_module_states == "true"
    assert args.fsdp_version == "1"
    assert (args.rdzv_backend, args.tee, args.role, args.rdzv_conf) == (
        "static",
        "0",
        "default",
        "",
    )
    assert (args.monitor_interval, args.max_restarts) == (0.1, 0)
    assert args.fsdp_min_num_params == 100_000_000
    assert args.fp8_override_linear_precision == (False, False, False)
    assert args.parallelism_config_sp_seq_length_is_variable is True
    # Accelerate leaves these None: they are decided later.
    for name in ("num_processes", "num_machines", "mixed_precision", "debug", "gpu_ids"):
        assert getattr(args, name) is None, name


def test_every_default_belongs_to_a_flag() -> None:
    destinations = {action.dest for action in launch_parser()._actions}
    assert set(ACCELERATE_LAUNCH_DEFAULTS) <= destinations


def test_nondefault_holds_what_was_typed_in_either_spelling() -> None:
    args = build_parser().parse_args(
        ["launch", "--num-processes", "2", "--fsdp_sync_module_states", "false", "--cpu", "t.py"]
    )
    assert args.nondefault == {
        "num_processes",
        "fsdp_sync_module_states",
        "cpu",
        "training_script",
        "training_script_args",
    }
    assert launch_parser().parse_args(["t.py"]).nondefault == {
        "training_script",
        "training_script_args",
    }


def test_typed_arguments_drops_the_defaults_only() -> None:
    args = launch_parser().parse_args(["--fsdp_version", "1", "--tee", "3", "t.py"])
    args.fsdp_offload_params = "true"  # set after parsing, unlike the default: counts
    typed = typed_arguments(args)
    assert typed.fsdp_version == "1"  # typed, although it is the default
    assert typed.tee == "3"
    assert typed.fsdp_offload_params == "true"
    assert typed.fsdp_sync_module_states is None and typed.rdzv_backend is None
    assert args.fsdp_sync_module_states == "true"  # the namespace itself is unchanged
    # Built by hand (no nondefault): every value counts.
    by_hand = argparse.Namespace(fsdp_version="1", tee="0")
    assert vars(typed_arguments(by_hand)) == {"fsdp_version": "1", "tee": "0"}


def test_the_defaults_do_not_reach_the_launch(script: str) -> None:
    plan = plan_launch(build_parser().parse_args(["launch", "--cpu", script]), os.environ)
    assert plan["settings"]["rdzv_backend"].source == "default"
    assert plan["settings"]["monitor_interval"].source == "default"
    assert not any(name.startswith(("FSDP_", "PARALLELISM_CONFIG")) for name in plan["env"])
    # The same flag typed is a flag, even at its default value.
    plan = plan_launch(
        build_parser().parse_args(["launch", "--cpu", "--rdzv_backend", "static", script]),
        os.environ,
    )
    assert plan["settings"]["rdzv_backend"].source == "flag"


def test_a_typed_fp8_default_is_still_refused(script: str) -> None:
    with pytest.raises(ValueError, match="--fp8_interval"):
        plan_launch(
            build_parser().parse_args(["launch", "--fp8_interval", "1", script]), os.environ
        )


def test_torchrun_gets_no_role_or_tee_unless_typed(script: str) -> None:
    argv = ["launch", "--cpu", "--num_processes", "2", script]
    command = plan_launch(build_parser().parse_args(argv), os.environ)["command"]
    assert "--role" not in command and "--tee" not in command
    argv = ["launch", "--cpu", "--num_processes", "2", "--role", "default", script]
    command = plan_launch(build_parser().parse_args(argv), os.environ)["command"]
    assert command[command.index("--role") + 1] == "default"
