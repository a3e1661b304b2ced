"""``JSONLTracker.store_init_configuration`` writes ``config.json`` through accel_state.files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from accel.tracking import JSONLTracker
from accel_state import files


def test_config_is_fsynced_renamed_and_its_folder_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_file, real_folder = files.fsync_file, files.fsync_directory

    def fsync_file(path: str | os.PathLike[str]) -> None:
        synced.append(f"file {Path(path).name}")
        real_file(path)

    def fsync_directory(directory: str | os.PathLike[str]) -> None:
        synced.append(f"folder {Path(directory).name}")
        real_folder(directory)

    monkeypatch.setattr(files, "fsync_file", fsync_file)
    monkeypatch.setattr(files, "fsync_directory", fsync_directory)
    tracker = JSONLTracker("run", tmp_path)
    tracker.store_init_configuration({"lr": 0.1})
    assert json.loads(tracker.config_path.read_text(encoding="utf-8")) == {"lr": 0.1}
    # The temporary sibling was made durable before the rename, the folder after it.
    (written,) = [entry for entry in synced if entry.startswith("file ")]
    assert written.startswith("file .config.json.") and written.endswith(".tmp")
    assert synced[-1] == "folder run"
    assert sorted(p.name for p in tracker.logging_dir.iterdir()) == ["config.json"]


def test_a_rejected_config_leaves_the_old_one_and_no_temporary(tmp_path: Path) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.store_init_configuration({"lr": 0.1})
    with pytest.raises(TypeError):
        tracker.store_init_configuration({"bad": object()})
    assert json.loads(tracker.config_path.read_text(encoding="utf-8")) == {"lr": 0.1}
    assert sorted(p.name for p in tracker.logging_dir.iterdir()) == ["config.json"]


def test_a_failed_write_leaves_the_old_config_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker = JSONLTracker("run", tmp_path)
    tracker.store_init_configuration({"lr": 0.1})

    def refuse(source: str, target: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        tracker.store_init_configuration({"lr": 0.2})
    monkeypatch.undo()
    assert json.loads(tracker.config_path.read_text(encoding="utf-8")) == {"lr": 0.1}
    assert sorted(p.name for p in tracker.logging_dir.iterdir()) == ["config.json"]
