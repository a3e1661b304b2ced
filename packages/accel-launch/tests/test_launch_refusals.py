"""What a config file asks for is refused like the matching flag, before anything starts;
``--multi_gpu`` needs 2 processes; ``launch_command`` turns each refusal into exit code 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from accel_launch.cli import build_parser, main
from accel_launch.launch import LaunchError, plan_launch, run_launch

pytestmark = pytest.mark.usefixtures("launch_environment")

MPI = {
    "distributed_type": "MULTI_CPU",
    "num_processes": 16,
    "num_machines": 4,
    "main_process_ip": "127.0.0.1",
    "main_process_port": 29500,
    "use_cpu": True,
    "mpirun_config": {"mpirun_hostfile": "/home/user/hostfile"},
}
FP8 = {
    "distributed_type": "MULTI_GPU",
    "num_processes": 2,
    "mixed_precision": "fp8",
    "fp8_config": {"backend": "TE", "fp8_format": "E4M3", "amax_history_len": 1024},
}


def _config(tmp_path: Path, data: dict[str, object]) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _plan(*argv: str) -> dict[str, object]:
    return plan_launch(build_parser().parse_args(["launch", *argv]), os.environ)


def test_an_mpirun_hostfile_in_the_file_is_refused_as_the_flag_is(
    tmp_path: Path, script: str
) -> None:
    with pytest.raises(LaunchError) as from_flag:
        _plan("--mpirun_hostfile", "/home/user/hostfile", script)
    with pytest.raises(LaunchError) as from_file:
        _plan("--config_file", _config(tmp_path, MPI), script)
    message = str(from_file.value)
    assert "mpirun_config.mpirun_hostfile='/home/user/hostfile'" in message
    assert "config.yaml" in message and "refused before starting anything" in message
    reason = "accel does not start processes with mpirun"
    assert reason in message and reason in str(from_flag.value)


@pytest.mark.parametrize("backend", ["TE", "MSAMP", "te"])
def test_an_fp8_backend_other_than_torchao_in_the_file_is_refused(
    tmp_path: Path, script: str, backend: str
) -> None:
    config = _config(tmp_path, {**FP8, "fp8_config": {**FP8["fp8_config"], "backend": backend}})
    with pytest.raises(ValueError, match=f"fp8_config.backend='{backend}': accel drives FP8 "):
        _plan("--config_file", config, script)


@pytest.mark.parametrize("backend", ["AO", "ao", None])
def test_torchao_or_no_backend_in_the_file_launches(
    tmp_path: Path, script: str, backend: str | None
) -> None:
    section = {} if backend is None else {"backend": backend}
    config = _config(tmp_path, {**FP8, "distributed_type": "MULTI_CPU", "fp8_config": section})
    plan = _plan("--config_file", config, "--dry_run", script)
    assert plan["env"]["ACCEL_MIXED_PRECISION"] == "fp8"  # type: ignore[index]


def test_the_fp8_backend_flag_outranks_the_file(tmp_path: Path, script: str) -> None:
    config = _config(tmp_path, {**FP8, "distributed_type": "MULTI_CPU"})
    plan = _plan("--config_file", config, "--fp8_backend", "ao", script)
    assert plan["env"]["ACCEL_MIXED_PRECISION"] == "fp8"  # type: ignore[index]


def test_a_refused_file_starts_nothing_and_exits_2(
    tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    Path(script).write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert main(["launch", "--config_file", _config(tmp_path, MPI), script]) == 2
    assert "mpirun_hostfile" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("processes", ["1", "0"])
def test_multi_gpu_needs_two_processes(script: str, processes: str) -> None:
    with pytest.raises(LaunchError, match="at least 2 processes to use `--multi_gpu`"):
        _plan("--multi_gpu", "--num_processes", processes, script)


def test_run_launch_raises_where_launch_command_returns_2(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["launch", "--cpu", "--multi_gpu", script])
    with pytest.raises(ValueError, match="choose at most one of --cpu, --multi_gpu"):
        run_launch(args)
    assert args.func(args) == 2
    assert "choose at most one of --cpu, --multi_gpu" in capsys.readouterr().err


def test_a_launch_error_is_a_value_error_and_a_runtime_error() -> None:
    assert issubclass(LaunchError, ValueError) and issubclass(LaunchError, RuntimeError)
