"""``accel launch --tpu``: the plan (the XLA spawner, its arguments and environment) and
the launches it refuses. The XLA processes themselves are tested in accel's test_xla.py on a
fake torch_xla.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from accel_launch.cli import build_parser
from accel_launch.launch import LaunchError, plan_launch

pytestmark = pytest.mark.usefixtures("launch_environment")


def plan(argv: list[str]) -> dict:
    return plan_launch(build_parser().parse_args(["launch", *argv]), os.environ)


def refusal(argv: list[str]) -> str:
    with pytest.raises(LaunchError) as info:
        plan(argv)
    return str(info.value)


def test_tpu_runs_the_xla_spawner(script: str) -> None:
    planned = plan(["--tpu", "--mixed_precision", "bf16", script, "--lr", "1"])
    assert planned["command"] == [
        sys.executable,
        "-m",
        "accel_launch.xla_spawn",
        "main",
        script,
        "--lr",
        "1",
    ]
    assert planned["env"]["ACCEL_MIXED_PRECISION"] == "bf16"
    assert planned["env"]["ACCEL_USE_CPU"] == "false"
    assert "ACCEL_DOWNCAST_BF16" not in planned["env"]


def test_tpu_options_reach_the_spawner(script: str) -> None:
    planned = plan(
        [
            "--tpu",
            "--num_processes",
            "1",
            "--main_training_function",
            "train",
            "--downcast_bf16",
            "-m",
            "pkg.train",
        ]
    )
    assert planned["command"][3:] == ["--nprocs", "1", "--module", "train", "pkg.train"]
    assert planned["env"]["ACCEL_DOWNCAST_BF16"] == "true"


def test_config_file_with_distributed_type_xla(tmp_path: Path, script: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "distributed_type: XLA\nmain_training_function: run\ndowncast_bf16: 'yes'\n"
        "mixed_precision: bf16\n"
    )
    planned = plan(["--config_file", str(config), script])
    assert planned["command"][3:] == ["run", script]
    assert planned["env"]["ACCEL_DOWNCAST_BF16"] == "true"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tpu", "--no_python"], "the XLA launcher imports a Python script"),
        (
            ["--tpu", "--use_parallelism_config"],
            "--tpu asks for XLA, where accel trains replicated data parallel only, and "
            "--use_parallelism_config asks for parallelism_config too; drop "
            "--use_parallelism_config",
        ),
        (["--tpu", "--use_fsdp"], "at most one of --tpu, --use_fsdp"),
        (["--downcast_bf16"], "--downcast_bf16: it applies to XLA runs only"),
        (["--tpu", "--tpu_use_sudo"], "TPU pod launching"),
    ],
)
def test_refused(script: str, argv: list[str], message: str) -> None:
    assert message in refusal([*argv, script])
