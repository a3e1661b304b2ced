"""The debug launcher's failure notes are written atomically and durably (accel_state.files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_launch import launchers
from accel_state import files


def test_a_failure_note_is_whole_durable_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    folders: list[str] = []
    real = files.fsync_directory

    def fsync_directory(directory: str | os.PathLike[str]) -> None:
        folders.append(os.fspath(directory))
        real(directory)

    monkeypatch.setattr(files, "fsync_directory", fsync_directory)
    launchers._write_failure_note(str(tmp_path), ZeroDivisionError("boom"))
    assert folders == [str(tmp_path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.json"]
    (note,) = launchers._read_failure_notes(str(tmp_path))
    assert (note["rank"], note["local_rank"], note["pid"]) == (3, 1, os.getpid())
    assert "ZeroDivisionError: boom" in note["error"]


def test_a_note_being_written_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    seen: list[list[dict[str, object]]] = []
    real = files.fsync_file

    def fsync_file(path: str | os.PathLike[str]) -> None:
        # The moment before the rename: the temporary file is complete but not yet the note.
        seen.append(launchers._read_failure_notes(str(tmp_path)))
        real(path)

    monkeypatch.setattr(files, "fsync_file", fsync_file)
    launchers._write_failure_note(str(tmp_path), RuntimeError("x"))
    assert seen == [[]]
    assert len(launchers._read_failure_notes(str(tmp_path))) == 1
