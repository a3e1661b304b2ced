"""``accel.commands.launch`` as a Python API: Accelerate's exceptions, defaults and config files.

The config files under ``test_configs/`` hold the keys and values of Accelerate 1.15's
``tests/test_configs/``; the expectations are those of its ``tests/test_cli.py`` where accel
behaves the same, and accel's refusals (documented in docs/compat.md) where it does not.
Launches are planned or dry-run; one script really runs, in one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel.commands.config import load_config_from_file
from accel.commands.launch import _validate_launch_command, launch_command, launch_command_parser
from accel_launch.launch import plan_launch

CONFIGS = Path(__file__).with_name("test_configs")


@pytest.fixture(autouse=True)
def _no_config_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No default config file, no engine switch or thread count from this shell."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in list(os.environ):
        if name.startswith(("FSDP_", "ACCEL_", "ACCELERATE_", "SLURM_")) and name != "ACCEL_HOME":
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("import sys\nprint('ran', sys.argv[1:])\n")
    return str(path)


def _parse(*argv: str) -> argparse.Namespace:
    return launch_command_parser().parse_args(list(argv))


def test_validate_combines_the_flags_and_the_file_as_accelerate() -> None:
    # Accelerate's test_validate_launch_command, step by step.
    args = launch_command_parser().parse_args(
        ["--num-processes", "2", "--deepspeed_config_file", "path/to/be/accepted",
         "--config-file", str(CONFIGS / "validate_launch_cmd.yaml"), "test.py"]
    )  # fmt: skip
    assert not args.debug
    assert args.fsdp_sync_module_states == "true"  # the parser's default, a string
    returned, config, from_config = _validate_launch_command(args)
    assert returned is args and config is not None and from_config is False
    assert args.debug is True  # from the file
    assert args.num_processes == 2  # the flag wins over the file's 1
    assert args.fsdp_sync_module_states is False  # the file's fsdp_config section
    assert args.deepspeed_config_file == "path/to/be/accepted"  # typed: not the file's
    assert (args.mixed_precision, args.dynamo_backend, args.gpu_ids) == ("no", "no", "all")


def test_validate_without_a_file_fills_the_defaults() -> None:
    args = launch_command_parser().parse_args(["test.py"])
    assert _validate_launch_command(args) == (args, None, False)
    assert (args.num_processes, args.num_machines) == (1, 1)  # one process on this CPU
    assert (args.mixed_precision, args.dynamo_backend, args.debug) == ("no", "no", False)
    assert args.use_cpu is False  # Accelerate: --cpu decides
    assert args.num_cpu_threads_per_process == 1  # OMP_NUM_THREADS


def test_validate_takes_the_paradigm_and_sections_from_the_file() -> None:
    args = _parse("--config_file", str(CONFIGS / "latest_fsdp.yaml"), "test.py")
    _validate_launch_command(args)
    assert args.use_fsdp is True and args.multi_gpu is False
    assert args.fsdp_sync_module_states is True  # the file's boolean, not the parser's text
    assert args.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert args.fsdp_transformer_layer_cls_to_wrap == "BertLayer"
    args = _parse("--config_file", str(CONFIGS / "0_34_0_fp8.yaml"), "test.py")
    _, _, from_config = _validate_launch_command(args)
    assert args.multi_gpu is True and args.use_fsdp is False
    assert (args.num_processes, args.mixed_precision, from_config) == (2, "fp8", True)
    assert args.fp8_backend == "TE"  # copied as Accelerate does; launching it is refused


def test_validate_with_the_mpi_file_and_cpu() -> None:
    # Accelerate's test_mpi_multicpu_config_cmd, up to its own mpirun command line.
    args = _parse(str(CONFIGS / "x.py"), "--cpu")
    args.config_file = str(CONFIGS / "0_28_0_mpi.yaml")
    _validate_launch_command(args)
    assert (args.num_processes, args.num_machines, args.main_process_port) == (16, 4, 29500)
    assert args.use_cpu is True and args.mpirun_hostfile == "/home/user/hostfile"


def test_an_environment_variable_outranks_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    args = _parse("--config_file", str(CONFIGS / "0_34_0_fp8.yaml"), "test.py")
    _, _, from_config = _validate_launch_command(args)
    assert (args.mixed_precision, from_config) == ("bf16", False)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--cpu", "--multi_gpu"], "choose at most one of --cpu, --multi_gpu"),
        (["--use_fsdp", "--use_deepspeed"], "choose at most one of --use_deepspeed, --use_fsdp"),
        (["--multi_gpu", "--num_processes", "1"], "at least 2 processes to use `--multi_gpu`"),
        (["--use_parallelism_config"], "without `--use_fsdp` and `--fsdp_version=2`"),
        (["--use_parallelism_config", "--use_fsdp", "--fsdp_version", "1"], "fsdp_version='1'"),
        (["--config_file", str(CONFIGS / "invalid_keys.yaml")], r"\['another_invalid_key', "),
        (["--config_file", str(CONFIGS / "0_30_0_sagemaker.yaml")], "Amazon SageMaker"),
    ],
)
def test_refusals_are_value_errors(argv: list[str], match: str, script: str) -> None:
    with pytest.raises(ValueError, match=match):
        _validate_launch_command(_parse(*argv, script))
    with pytest.raises(ValueError, match=match):
        launch_command(_parse(*argv, script))


def test_parallelism_config_with_fsdp2_passes_validation() -> None:
    args = _parse("--use_parallelism_config", "--use_fsdp", "test.py")
    _validate_launch_command(args)
    assert args.use_fsdp is True


def test_a_missing_config_file_is_file_not_found(script: str) -> None:
    for call in (_validate_launch_command, launch_command):
        with pytest.raises(FileNotFoundError, match="'missing.yaml' does not exist"):
            call(_parse("--config_file", "missing.yaml", script))


def test_the_default_file_is_read_but_not_with_cpu(tmp_path: Path) -> None:
    default = tmp_path / "home" / "default_config.yaml"
    default.parent.mkdir()
    default.write_text("distributed_type: MULTI_CPU\nnum_processes: 3\n")
    args = _parse("test.py")
    assert _validate_launch_command(args)[1] is not None and args.num_processes == 3
    args = _parse("--cpu", "test.py")
    assert _validate_launch_command(args)[1] is None and args.num_processes == 1
    assert load_config_from_file(None).num_processes == 3


def test_launch_command_runs_the_script_and_returns_none(
    script: str, capfd: pytest.CaptureFixture[str]
) -> None:
    assert launch_command(_parse("--cpu", script, "a", "b")) is None
    assert "ran ['a', 'b']" in capfd.readouterr().out


def test_a_failed_script_raises_with_accelerates_command(tmp_path: Path) -> None:
    failing = tmp_path / "fail.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    for quiet in ([], ["--quiet"]):
        with pytest.raises(subprocess.CalledProcessError) as raised:
            launch_command(_parse(*quiet, "--cpu", str(failing), "--x"))
        assert raised.value.returncode == 3
        assert raised.value.cmd == [sys.executable, str(failing), "--x"]


@pytest.mark.parametrize("name", ["0_11_0", "0_12_0", "latest"])
def test_old_and_current_files_plan_one_process_without_an_engine(name: str, script: str) -> None:
    args = _parse("--config_file", str(CONFIGS / f"{name}.yaml"), "--dry_run", script)
    plan = plan_launch(args, os.environ)
    assert plan["settings"]["num_processes"].value == 1
    assert "engine" not in plan["settings"]
    assert plan["command"] == [sys.executable, script]
    assert load_config_from_file(CONFIGS / f"{name}.yaml").distributed_type.value == "NO"


@pytest.mark.torch_feature("fully_shard")
def test_the_fsdp1_file_plans_fsdp2(script: str) -> None:
    args = _parse("--config_file", str(CONFIGS / "latest_fsdp.yaml"), script)
    plan = plan_launch(args, os.environ)
    assert plan["settings"]["engine"].value == "fsdp"
    assert plan["env"]["ACCEL_USE_FSDP"] == "true"
    assert plan["env"]["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert plan["settings"]["num_processes"].value == 1


@pytest.mark.torch_feature("fully_shard")
def test_the_fsdp1_file_builds_an_fsdp2_accelerator(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from accel import Accelerator\n"
        "a = Accelerator()\n"
        "print('probe', a.distributed_type.value, a.state.fsdp_plugin.fsdp_version)\n"
    )
    launch_command(_parse("--config_file", str(CONFIGS / "latest_fsdp.yaml"), str(probe)))
    assert "probe FSDP 2" in capfd.readouterr().out


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("0_28_0_mpi", "mpirun_config.mpirun_hostfile='/home/user/hostfile': accel does not"),
        ("0_34_0_fp8", "fp8_config.backend='TE': accel drives FP8 through torchao only"),
    ],
)
def test_files_asking_for_refused_launchers_start_nothing(
    name: str, match: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    touch = tmp_path / "touch.py"
    touch.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match=match):
        launch_command(_parse("--config_file", str(CONFIGS / f"{name}.yaml"), str(touch)))
    assert not marker.exists()
