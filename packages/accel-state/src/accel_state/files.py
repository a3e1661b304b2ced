"""Durable, atomic file writes: the one implementation every accel package uses.

A file written here appears under its name only when it is complete, and stays there after a
power loss: the bytes go to a hidden temporary sibling (same folder, so the rename is atomic),
which is flushed and fsynced, renamed over the target with :func:`os.replace`, and then the
folder itself is fsynced so that the rename is on disk too. If anything fails, including an
interrupt, the temporary file is removed and the previous file, if any, is left as it was.

The new file gets the permissions any new file gets here (``0o666`` less the umask), whatever
the writer did to the temporary file (``safetensors`` replaces it with a private ``0o600`` one).

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

__all__ = ["atomic_path", "atomic_write", "fsync_directory", "fsync_file"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk (``fsync``)."""
    # Opened for writing: Windows refuses to fsync a read-only handle.
    with open(path, "r+b") as stream:
        os.fsync(stream.fileno())


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the renames and new entries in ``directory`` durable (POSIX only; best effort).

    Some file systems cannot fsync a directory; that is not an error.
    """
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _new_temporary(directory: str, base: str) -> str:
    """Create an empty hidden sibling ``.<base>.<random>.tmp`` that no one else has taken."""
    while True:
        temporary = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            # 0o666 and the umask: the permissions a plain open(path, "w") would give.
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return temporary


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Write ``path`` atomically and durably through a temporary path.

    The body of the ``with`` block writes the file named by the yielded path, by any means
    (``torch.save``, ``safetensors.torch.save_file``, ``open``); when the block ends normally
    that file is fsynced and renamed over ``path``, and the folder is fsynced. When the block
    raises, the temporary file is removed and ``path`` is left as it was.

    Example:
        >>> with atomic_path("weights.pt") as temporary:  # doctest: +SKIP
        ...     torch.save(state_dict, temporary)

    Args:
        path: The file to write; its folder must exist.

    Yields:
        The temporary path to write, an existing empty file in the same folder.
    """
    target = os.fspath(path)
    directory, base = os.path.split(target)
    directory = directory or os.curdir
    temporary = _new_temporary(directory, base)
    try:
        mode = os.stat(temporary).st_mode & 0o777
        yield temporary
        if os.stat(temporary).st_mode & 0o777 != mode:
            os.chmod(temporary, mode)
        fsync_file(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    fsync_directory(directory)


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes | bytearray | memoryview,
    *,
    encoding: str = "utf-8",
) -> None:
    """Write ``data`` to ``path`` atomically and durably (see :func:`atomic_path`).

    Args:
        path: The file to write; its folder must exist.
        data: The whole content: bytes, or text encoded with ``encoding`` (its newlines
            are written as they are, on every platform).
        encoding: The encoding of text ``data``.
    """
    payload = data.encode(encoding) if isinstance(data, str) else data
    with atomic_path(path) as temporary, open(temporary, "wb") as stream:
        stream.write(payload)
