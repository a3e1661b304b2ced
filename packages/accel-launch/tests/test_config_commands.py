"""Reading the default config file, ``accel config update`` and the questionnaire's writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from accel_launch.cli import main
from accel_launch.config import (
    load_config_from_file,
    update_config_file,
    write_config_from_answers,
)


@pytest.fixture
def homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """accel's and Accelerate's default folders, both empty."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path


def test_none_reads_the_default_file(homes: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config file was given and there is no"):
        load_config_from_file(None)
    legacy = homes / "hf" / "accelerate" / "default_config.yaml"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("distributed_type: MULTI_CPU\nnum_processes: 3\n")
    assert load_config_from_file(None).num_processes == 3  # Accelerate's, as accel has none
    own = homes / "accel" / "default_config.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    assert load_config_from_file(None).num_processes == 4


def test_a_missing_file_says_how_to_make_one(homes: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist: pass an existing file, or"):
        load_config_from_file(homes / "missing.yaml")


def test_update_rewrites_in_place_or_into_accels_default(homes: Path) -> None:
    old = homes / "old.yaml"
    old.write_text("distributed_type: 'NO'\nfp16: true\n")
    read, written, how = update_config_file(old)
    assert (read, written, how) == (old, old, "--config_file")
    assert yaml.safe_load(old.read_text())["mixed_precision"] == "fp16"
    legacy = homes / "hf" / "accelerate" / "default_config.yaml"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("distributed_type: 'NO'\nfp16: true\n")
    read, written, _ = update_config_file(None)
    assert (read, written) == (legacy, homes / "accel" / "default_config.yaml")
    assert "fp16" in legacy.read_text()  # Accelerate's file is only read


def test_update_of_nothing_is_refused_in_one_line(
    homes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(FileNotFoundError, match="no default one"):
        update_config_file(None)
    assert main(["config", "update", "--config_file", str(homes / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel config update: ") and "missing.yaml" in err
    assert err.count("\n") == 1


def test_the_questionnaire_writer_writes_only_accepted_answers(homes: Path) -> None:
    answers = iter(["multi-cpu", "2", "1", "no", "no", "bf16"])
    written = write_config_from_answers(lambda question, default: next(answers, ""))
    assert written == homes / "accel" / "default_config.yaml"
    config = load_config_from_file(written)
    assert (config.distributed_type.value, config.num_processes) == ("MULTI_CPU", 2)
    assert config.mixed_precision == "bf16"
    target = homes / "bad.yaml"
    with pytest.raises(ValueError, match="is not an answer to"):
        write_config_from_answers(lambda question, default: "quantum", target)
    assert not target.exists()
