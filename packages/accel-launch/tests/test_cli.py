"""The ``accel`` command line, without starting processes (``--dry_run`` and the config/env
subcommands); real launches are tested in tests-integration/test_launch.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from accel_launch.cli import build_parser, main


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes a real config file."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_both_spellings_parse_the_same(script: str) -> None:
    parser = build_parser()
    underscore = parser.parse_args(["launch", "--num_processes", "2", "--cpu", script, "--x-y"])
    dash = parser.parse_args(["launch", "--num-processes", "2", "--cpu", script, "--x-y"])
    assert underscore.num_processes == dash.num_processes == 2
    # The script's own arguments are passed through untouched.
    assert underscore.training_script_args == dash.training_script_args == ["--x-y"]


def test_help_shows_the_underscore_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = capsys.readouterr().out
    # Options are listed with underscores; the description says dashes work too.
    assert "--num_processes NUM_PROCESSES" in out
    assert "--num-processes NUM_PROCESSES" not in out
    assert "--num-processes is --num_processes" in " ".join(out.split())


def test_dry_run_of_two_cpu_processes_hands_torchrun_its_arguments(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--cpu", "--num_processes", "2", "--dry_run", script, "--lr", "1"]) == 0
    captured = capsys.readouterr()
    command = captured.out.split()
    assert command[command.index("--nproc_per_node") + 1] == "2"
    assert command[command.index("--nnodes") + 1] == "1"
    assert command[-3:] == [script, "--lr", "1"]
    assert "use_cpu" in captured.err and "flag" in captured.err  # the settings table


def test_dry_run_of_one_process_runs_the_script_directly(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--cpu", "-q", "--dry_run", script]) == 0
    captured = capsys.readouterr()
    assert captured.out.split()[-1] == script
    assert "--nproc_per_node" not in captured.out
    assert captured.err == ""  # --quiet: no table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num_processes", "0"], "num_processes=0"),
        (["--cpu", "--multi_gpu"], "at most one of --cpu, --multi_gpu"),
        (["--use_megatron_lm"], "Megatron-LM was requested by --use_megatron_lm"),
        (["--downcast_bf16"], "--downcast_bf16: it applies to XLA runs only (--tpu)"),
        (["--use_deepspeed", "--use_fsdp"], "at most one of --use_deepspeed, --use_fsdp"),
        (["--num_processes", "3", "--num_machines", "2"], "multiple of"),
    ],
)
def test_bad_input_returns_2_with_a_message(
    script: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *args, "--dry_run", script]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_script_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.py")
    assert main(["launch", "--cpu", missing]) == 2
    assert "nope.py" in capsys.readouterr().err


def test_config_default_writes_yaml_once_then_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cfg.yaml"
    assert main(["config", "default", "--config_file", str(target)]) == 0
    written = yaml.safe_load(target.read_text())
    assert written["distributed_type"] == "NO" and written["mixed_precision"] == "no"
    before = target.read_text()
    capsys.readouterr()
    # As Accelerate: an existing file is kept, said so, and that is not an error.
    assert main(["config", "default", "--config_file", str(target)]) == 0
    assert f"{target} already exists and was left unchanged" in capsys.readouterr().out
    assert target.read_text() == before


def test_version_is_accels(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    line = capsys.readouterr().out.strip()
    assert f"accel-launch {metadata.version('accel-launch')}" in line
    try:
        accel = metadata.version("accel")
    except metadata.PackageNotFoundError:  # accel-launch alone (its own test session)
        assert "(the accel package is not installed)" in line
    else:
        assert line.startswith(f"accel {accel} (")


def test_config_from_a_file_is_used_and_announced(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
        "use_cpu: true\ndebug: false\nmixed_precision: bf16\n"
    )
    assert main(["launch", "--dry_run", script]) == 0
    err = capsys.readouterr().err
    assert "default_config.yaml" in err  # no config file wins silently
    assert "bf16" in err


def test_config_update_rewrites_an_old_file(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nfp16: true\n"
        "machine_rank: 0\nmain_process_ip: null\nmain_process_port: null\n"
        "main_training_function: main\nnum_machines: 1\nnum_processes: 1\n"
    )
    assert main(["config", "update", "--config_file", str(old)]) == 0
    updated = yaml.safe_load(old.read_text())
    assert updated["mixed_precision"] == "fp16" and "fp16" not in updated


def test_env_prints_versions_and_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cfg.yaml"
    main(["config", "default", "--config_file", str(target)])
    capsys.readouterr()
    assert main(["env", "--config_file", str(target)]) == 0
    out = capsys.readouterr().out
    assert "PyTorch version" in out and "accel-launch version" in out
    assert str(target) in out and "distributed_type" in out


def test_env_reports_a_broken_config_file_instead_of_failing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cfg.yaml"
    target.write_text("distributed_type: [MULTI_CPU\n")
    assert main(["env", "--config_file", str(target)]) == 0
    out = capsys.readouterr().out
    assert "PyTorch version" in out
    assert f"not usable: The config file at {target} is not valid YAML" in out
