"""accel_state.files: atomic, durable writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_state import files
from accel_state.files import atomic_path, atomic_write


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def _new_file_mode(folder: Path) -> int:
    reference = folder / "reference"
    reference.write_bytes(b"")
    mode = reference.stat().st_mode & 0o777
    reference.unlink()
    return mode


def test_atomic_write_text_and_bytes(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    atomic_write(target, "{}\nä\n")
    assert target.read_bytes() == "{}\nä\n".encode()
    atomic_write(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    atomic_write(str(target), memoryview(b"abc"))
    assert target.read_bytes() == b"abc"
    assert _leftovers(tmp_path) == []


def test_atomic_write_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    atomic_write("plain.txt", "x")
    assert (tmp_path / "plain.txt").read_text() == "x"


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_crash_in_the_middle_keeps_the_old_file(tmp_path: Path, error: BaseException) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(type(error)), atomic_path(target) as temporary:
        Path(temporary).write_bytes(b"half of the new")
        raise error
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_a_failed_first_write_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new.bin"
    with pytest.raises(OSError), atomic_path(target):
        raise OSError("no space left")
    assert list(tmp_path.iterdir()) == []


def test_the_temporary_is_a_hidden_sibling(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    with atomic_path(target) as temporary:
        assert os.path.dirname(temporary) == str(tmp_path)
        assert os.path.basename(temporary).startswith(".model.safetensors.")
        assert temporary.endswith(".tmp")
        assert not target.exists()
    assert target.exists()


def test_the_file_gets_new_file_permissions(tmp_path: Path) -> None:
    expected = _new_file_mode(tmp_path)
    target = tmp_path / "private"
    with atomic_path(target) as temporary:
        # A writer that replaces the file with a private one (as safetensors does).
        os.chmod(temporary, 0o600)
    assert target.stat().st_mode & 0o777 == expected


def test_writes_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    monkeypatch.setattr(files, "fsync_file", lambda path: synced.append(f"file {path}"))
    monkeypatch.setattr(files, "fsync_directory", lambda path: synced.append(f"dir {path}"))
    atomic_write(tmp_path / "a", b"1")
    assert len(synced) == 2
    assert synced[0].startswith(f"file {tmp_path}{os.sep}.a.")
    assert synced[1] == f"dir {tmp_path}"


def test_fsync_directory_ignores_what_it_cannot_sync(tmp_path: Path) -> None:
    files.fsync_directory(tmp_path / "missing")
    files.fsync_directory(tmp_path)
