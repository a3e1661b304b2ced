"""``accel.commands.to_fsdp2`` as a Python API: Accelerate's exceptions, warnings and output.

``latest_fsdp.yaml`` holds the keys and values of Accelerate 1.15's FSDP1 test config.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import yaml

from accel.commands import to_fsdp2
from accel.commands.config import load_config_from_file
from accel.commands.to_fsdp2 import to_fsdp2_command, to_fsdp2_command_parser
from accel_launch.cli import main

LATEST_FSDP = Path(__file__).with_name("test_configs") / "latest_fsdp.yaml"
FSDP1_ONLY = (
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
)


def _args(*argv: str) -> argparse.Namespace:
    return to_fsdp2_command_parser().parse_args(list(argv))


def test_latest_fsdp_converts_to_fsdp2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out.yaml"
    with caplog.at_level(logging.WARNING):
        returned = to_fsdp2_command(
            _args("--config_file", str(LATEST_FSDP), "--output_file", str(target))
        )
    assert returned is None
    section = yaml.safe_load(target.read_text())["fsdp_config"]
    assert section == {
        "fsdp_activation_checkpointing": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_ignored_modules": None,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
        "fsdp_version": 2,
    }
    for key in FSDP1_ONLY:  # each dropped key is named in a warning
        assert any(key in record.getMessage() for record in caplog.records)
    assert load_config_from_file(target).fsdp_config["fsdp_version"] == 2
    assert "wrote the FSDP2 config" in capsys.readouterr().out


def test_overwrite_converts_in_place(tmp_path: Path) -> None:
    copy = tmp_path / "latest_fsdp.yaml"
    copy.write_text(LATEST_FSDP.read_text())
    to_fsdp2_command(_args("--config_file", str(copy), "--overwrite"))
    assert load_config_from_file(copy).fsdp_config["fsdp_version"] == 2


@pytest.mark.parametrize(
    ("argv", "error", "match"),
    [
        (["--config_file", "nonexistent.yaml"], FileNotFoundError, "nonexistent.yaml not found"),
        (["--config_file", str(LATEST_FSDP)], ValueError, "If --overwrite is not set, --output"),
        (
            ["--config_file", str(LATEST_FSDP), "--output_file", str(LATEST_FSDP)],
            FileExistsError,
            "already exists and --overwrite is not set",
        ),
    ],
)
def test_bad_requests_raise_accelerates_exceptions(
    argv: list[str], error: type[Exception], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = LATEST_FSDP.read_text()
    with pytest.raises(error, match=match):
        to_fsdp2_command(_args(*argv))
    assert main(["to-fsdp2", *argv]) == 2  # the command: one line, exit code 2
    err = capsys.readouterr().err
    assert err.startswith("accel to-fsdp2: ") and err.count("\n") == 1
    assert LATEST_FSDP.read_text() == before


def test_no_shard_and_empty_files_are_value_errors(tmp_path: Path) -> None:
    no_shard = tmp_path / "no_shard.yaml"
    no_shard.write_text("fsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for source, match in ((no_shard, "NO_SHARD shards nothing"), (empty, "Config file is empty")):
        target = tmp_path / f"{source.stem}.out.yaml"
        with pytest.raises(ValueError, match=match):
            to_fsdp2_command(_args("--config_file", str(source), "--output_file", str(target)))
        assert not target.exists()


def test_an_fsdp2_config_is_copied_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As Accelerate's test_config_already_fsdp2, which patches load_config.
    monkeypatch.setattr(to_fsdp2, "load_config", lambda path: {"fsdp_config": {"fsdp_version": 2}})
    target = tmp_path / "out.yaml"
    with caplog.at_level(logging.WARNING):
        to_fsdp2_command(_args("--config_file", str(LATEST_FSDP), "--output_file", str(target)))
    assert (
        "Config already specifies FSDP2, skipping conversion..." in caplog.records[0].getMessage()
    )
    assert "fsdp_version: 1" in caplog.records[1].getMessage()
    assert yaml.safe_load(target.read_text()) == {"fsdp_config": {"fsdp_version": 2}}


def test_a_config_without_fsdp_is_copied_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, target = tmp_path / "plain.yaml", tmp_path / "out.yaml"
    source.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    with caplog.at_level(logging.INFO, logger="accel.commands.to_fsdp2"):
        to_fsdp2_command(_args("--config_file", str(source), "--output_file", str(target)))
    assert yaml.safe_load(target.read_text()) == {
        "distributed_type": "MULTI_CPU",
        "num_processes": 2,
    }
    assert "No FSDP config found" in caplog.text
