"""``accel tpu-config``: the gcloud command built exactly as Accelerate 1.15 builds it.

The nine expected lines are the output of ``accelerate tpu-config ... --debug`` (Accelerate's
``TpuConfigTester`` asserts the first eight). No test runs the real ``gcloud``: with
``--debug`` nothing runs, and the runs use a fake ``gcloud`` on ``PATH`` that records its
arguments, or a ``PATH`` without one.
"""

from __future__ import annotations

import argparse
import stat
import subprocess
from pathlib import Path

import pytest

from accel.commands.tpu import tpu_command_launcher, tpu_command_parser
from accel.test_utils.testing import capture_call_output
from accel_launch.cli import main

PACKAGE = Path(__file__).resolve().parents[1]  # latest.yaml's command_file is relative to it
GCLOUD = "Running gcloud compute tpus tpu-vm ssh"
FILE_COMMANDS = 'echo "hello world"; echo "this is a second command"'


@pytest.fixture(autouse=True)
def _in_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run where Accelerate's relative paths resolve; no default config file."""
    monkeypatch.chdir(PACKAGE)
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def fake_gcloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``gcloud`` that writes its arguments, one a line, to the returned file."""
    folder = tmp_path / "bin"
    folder.mkdir()
    record = tmp_path / "gcloud-args"
    fake = folder / "gcloud"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit "${{FAKE_EXIT:-0}}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(folder))
    return record


def _run(*argv: str) -> tuple[str, argparse.Namespace]:
    args = tpu_command_parser().parse_args(list(argv))
    return capture_call_output(tpu_command_launcher, args), args


LATEST = ("--config_file", "tests/test_configs/latest.yaml")
OLD = ("--config_file", "tests/test_configs/0_12_0.yaml")
WHERE = ("--tpu_zone", "us-central1-a", "--tpu_name", "test-tpu")
SAMPLE = ("--command_file", "tests/test_samples/test_command_file.sh")
INSTALL = ("--install_accelerate", "--accelerate_version")
GIT = "git+https://github.com/huggingface/accelerate.git"


def _line(commands: str, tpu: str = "test-tpu --zone us-central1-a", alpha: str = "") -> str:
    return f"Running gcloud {alpha}compute tpus tpu-vm ssh {tpu} --command {commands} --worker all"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (("--command", "ls", *WHERE), _line("cd /usr/share; ls")),
        ((*OLD, "--command", "ls", *WHERE), _line("cd /usr/share; ls")),
        (LATEST, _line(f"cd /usr/share; {FILE_COMMANDS}")),
        ((*LATEST, "--command", "ls"), _line("cd /usr/share; ls")),
        (
            (*LATEST, "--command", "ls", "--command", 'echo "Hello World"'),
            _line('cd /usr/share; ls; echo "Hello World"'),
        ),
        ((*LATEST, *SAMPLE), _line(f"cd /usr/share; {FILE_COMMANDS}")),
        ((*OLD, *SAMPLE, *WHERE), _line(f"cd /usr/share; {FILE_COMMANDS}")),
        (
            (*LATEST, "--install_accelerate"),
            _line(f"cd /usr/share; pip install accelerate -U; {FILE_COMMANDS}"),
        ),
        (
            (*LATEST, *INSTALL, "12.0.0"),
            _line(f"cd /usr/share; pip install accelerate==12.0.0; {FILE_COMMANDS}"),
        ),
        (
            (*LATEST, *INSTALL, "dev", "--use_alpha"),
            _line(f"cd /usr/share; pip install {GIT}; {FILE_COMMANDS}", alpha="alpha "),
        ),
        (
            ("--command", "echo", "hi", "--tpu_name", "t", "--tpu_zone", "z"),
            _line("cd /usr/share; echo; hi", tpu="t --zone z"),
        ),
    ],
)
def test_the_debug_line_is_accelerates(argv: tuple[str, ...], line: str) -> None:
    output, _ = _run(*argv, "--debug")
    assert output == line + "\n"


def test_flags_win_over_the_config_and_args_are_filled_in(tmp_path: Path) -> None:
    config = tmp_path / "tpu.yaml"
    config.write_text(
        "distributed_type: 'NO'\ntpu_name: cfg-tpu\ntpu_zone: cfg-zone\n"
        "commands: [echo a, echo b]\n"
    )
    output, args = _run("--config_file", str(config), "--tpu_name", "flag-tpu", "--debug")
    assert output == _line("cd /usr/share; echo a; echo b", tpu="flag-tpu --zone cfg-zone") + "\n"
    assert args.command == "cd /usr/share; echo a; echo b"
    assert args.accelerate_version == "accelerate -U"


def test_the_parser_has_accelerates_defaults() -> None:
    args = tpu_command_parser().parse_args([])
    assert vars(args) == {
        "config_file": None, "tpu_name": None, "tpu_zone": None, "use_alpha": False,
        "command_file": None, "command": None, "install_accelerate": False,
        "accelerate_version": "latest", "debug": False, "func": tpu_command_launcher,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "error", "match"),
    [
        (("--tpu_name", "t", "--tpu_zone", "z"), ValueError, "You must specify either a command"),
        (("--command", "ls", "--tpu_zone", "z"), ValueError, "tpu_name=None: the TPU's name and"),
        (("--command", "ls", "--tpu_name", "t"), ValueError, "tpu_zone=None"),
        (
            ("--command", "ls", *WHERE, "--accelerate_version", "notaversion"),
            ValueError,
            "--accelerate_version='notaversion' is not a version",
        ),
        (
            ("--config_file", "missing.yaml", "--command", "ls"),
            FileNotFoundError,
            "'missing.yaml' does not exist",
        ),
        (("--command_file", "missing.sh", *WHERE), FileNotFoundError, "missing.sh"),
    ],
)
def test_bad_requests_are_refused(
    argv: tuple[str, ...], error: type[Exception], match: str, fake_gcloud: Path
) -> None:
    with pytest.raises(error, match=match):
        _run(*argv, "--debug")
    with pytest.raises(error, match=match):
        _run(*argv)
    assert not fake_gcloud.exists()  # nothing ran


def test_without_gcloud_on_path_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder
    ran: list[object] = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ran.append(a))  # never the real one
    with pytest.raises(FileNotFoundError, match="gcloud is not on PATH.*nothing was run"):
        _run("--command", "ls", *WHERE)
    assert main(["tpu-config", "--command", "ls", *WHERE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel tpu-config: gcloud is not on PATH") and err.count("\n") == 1
    assert ran == []
    assert _run("--command", "ls", *WHERE, "--debug")[0].startswith(GCLOUD)  # needs no gcloud


def test_with_gcloud_the_line_runs(fake_gcloud: Path) -> None:
    output, _ = _run(*LATEST, "--install_accelerate", "--use_alpha")
    assert fake_gcloud.read_text().splitlines() == [
        "alpha", "compute", "tpus", "tpu-vm", "ssh", "test-tpu", "--zone", "us-central1-a",
        "--command", f"cd /usr/share; pip install accelerate -U; {FILE_COMMANDS}",
        "--worker", "all",
    ]  # fmt: skip
    assert "ran on every VM of test-tpu" in output


def test_a_failing_gcloud_is_reported(
    fake_gcloud: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_EXIT", "5")
    with pytest.raises(subprocess.CalledProcessError) as raised:
        _run("--command", "ls", *WHERE)
    assert raised.value.returncode == 5
    assert main(["tpu-config", "--command", "ls", *WHERE]) == 5
    assert "returned non-zero exit status 5" in capsys.readouterr().err


def test_registered_as_an_accel_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tpu-config", "--command", "ls", *WHERE, "--debug"]) == 0
    assert capsys.readouterr().out.startswith(f"{GCLOUD} test-tpu")
