"""``accel.commands.config`` and its submodules as Accelerate has them, over accel-launch.

``default.write_basic_config``, ``update.update_config``, ``config.config_command``,
``get_config_parser`` / ``main``; ``merge.main``; and the same modules reached as
``accelerate.commands...`` where accel stands in for Accelerate.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from accel.commands import config as config_commands
from accel.commands import merge
from accel.commands.config import cluster, config_utils, default, get_config_parser, update
from accel.commands.config import config as questionnaire


@pytest.fixture(autouse=True)
def homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """accel's and Accelerate's default folders, both empty."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path


def test_write_basic_config_writes_this_machine_once(
    homes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = homes / "basic.yaml"
    assert default.write_basic_config("bf16", target) == target
    written = yaml.safe_load(target.read_text())
    assert written["mixed_precision"] == "bf16"
    assert written["distributed_type"] == "NO"
    assert (written["num_processes"], written["use_cpu"]) == (1, True)
    assert default.write_basic_config("no", target) is False  # never overwritten
    assert "already exists" in capsys.readouterr().out
    assert yaml.safe_load(target.read_text())["mixed_precision"] == "bf16"
    with pytest.raises(ValueError, match="mixed_precision='int8' is not one of"):
        default.write_basic_config("int8", homes / "other.yaml")
    assert default.write_basic_config() == homes / "accel" / "default_config.yaml"


def test_the_config_parser_has_accelerates_subcommands(
    homes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = get_config_parser()
    args = parser.parse_args(["default", "--mixed_precision", "fp16", "--config_file", "x.yaml"])
    assert (args.subcommand, args.mixed_precision) == ("default", "fp16")
    assert args.save_location == "x.yaml"
    assert args.func is default.default_config_command
    args = parser.parse_args(["update", "--config_file", "y.yaml"])
    assert (args.subcommand, args.config_file) == ("update", "y.yaml")
    assert args.func is update.update_config_command
    target = homes / "cmd.yaml"
    default.default_config_command(
        argparse.Namespace(mixed_precision="no", save_location=str(target))
    )
    assert capsys.readouterr().out == f"accel configuration saved at {target}\n"


def test_update_config_rewrites_and_refuses_a_missing_file(
    homes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = homes / "old.yaml"
    old.write_text("distributed_type: 'NO'\nfp16: true\n")
    assert update.update_config(argparse.Namespace(config_file=str(old))) == str(old)
    assert yaml.safe_load(old.read_text())["mixed_precision"] == "fp16"
    update.update_config_command(argparse.Namespace(config_file=str(old)))
    assert capsys.readouterr().out == f"Successfully updated the configuration file at {old}.\n"
    for missing in (str(homes / "missing.yaml"), None):  # None: no default file either
        with pytest.raises(ValueError, match="missing.yaml' does not exist|no default one"):
            update.update_config(argparse.Namespace(config_file=missing))


def test_config_command_asks_and_writes(
    homes: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = iter(["multi-cpu", "2", "1", "no", "no", "fp16"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers, ""))
    target = homes / "asked.json"
    questionnaire.config_command(argparse.Namespace(config_file=str(target)))
    written = yaml.safe_load(target.read_text())  # JSON, as the name says
    assert (written["distributed_type"], written["num_processes"]) == ("MULTI_CPU", 2)
    assert written["mixed_precision"] == "fp16"
    assert capsys.readouterr().out.endswith(f"accel configuration saved at {target}\n")
    monkeypatch.setattr("builtins.input", lambda prompt: "quantum")
    with pytest.raises(ValueError, match="'quantum' is not an answer"):
        cluster.get_cluster_input()


def test_main_runs_a_subcommand_or_refuses_in_one_line(
    homes: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = homes / "main.yaml"
    monkeypatch.setattr(sys, "argv", ["accel-config", "default", "--config_file", str(target)])
    assert config_commands.main() == 0 and target.is_file()
    monkeypatch.setattr(sys, "argv", ["accel-config", "update", "--config_file", "nope.yaml"])
    assert config_commands.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("accel config: ") and "nope.yaml" in err


def test_config_utils_names() -> None:
    assert "INDUCTOR" in config_utils.DYNAMO_BACKENDS and "NO" not in config_utils.DYNAMO_BACKENDS
    parser = argparse.ArgumentParser(
        prog="accel <command> [<args>] x", formatter_class=config_utils.SubcommandHelpFormatter
    )
    assert "<command> [<args>]" not in parser.format_usage()


def test_merge_main_returns_the_exit_code(
    homes: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (homes / "plain").mkdir()
    argv = ["accel-merge-weights", str(homes / "plain"), str(homes / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    assert merge.main() == 2
    assert "is not a sharded FSDP checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(
    any(p.joinpath("accelerate", "__init__.py").exists() for p in map(Path, sys.path) if p.name),
    reason="the real Accelerate is importable here: accel does not stand in for it",
)
def test_accelerates_names_reach_these_modules() -> None:
    code = textwrap.dedent(
        """
        import accel
        accel.install_as_accelerate()
        import accelerate.commands.config.default as default
        from accelerate.commands.config import get_config_parser, main
        from accelerate.commands.config.update import update_config, update_config_command
        from accelerate.commands.config.config import config_command, config_command_parser
        from accelerate.commands.config.cluster import get_cluster_input
        from accelerate.commands.config.config_utils import DYNAMO_BACKENDS
        from accelerate.commands.merge import main as merge_main
        from accelerate.commands.tpu import tpu_command_launcher
        import accel.commands.config.default
        print(default is accel.commands.config.default, callable(default.write_basic_config))
        """
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
