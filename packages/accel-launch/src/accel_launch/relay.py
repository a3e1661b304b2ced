"""The ranks' output on the launcher's terminal, as the script wrote it.

torchrun's own ``--tee`` prefixes every line with the rank (``[default0]:``), which breaks
scripts and tools that read a run's output. ``accel launch`` instead has torchrun write each
rank's stdout and stderr to its log folder only (``--redirects 3``; the per-rank files stay
there for the failure report) and :class:`OutputRelay` copies them, unchanged, to the
launcher's own stdout and stderr while the run goes on: whole lines, a rank's lines in order,
lines of different ranks never cut into each other. The processes get ``PYTHONUNBUFFERED=1``
(unless it is set) so that their output shows up as it is printed, not when a buffer fills.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import IO, Any

__all__ = ["OutputRelay"]

_STREAMS = ("stdout", "stderr")


class _Followed:
    """One log file being copied: its handle, where it goes, a line not finished yet."""

    def __init__(self, path: Path, destination: str) -> None:
        self.handle: IO[bytes] = open(path, "rb")  # closed by the relay
        self.destination = destination
        self.partial = b""


class OutputRelay:
    """Copy ``<log_dir>/*/attempt_*/<rank>/{stdout,stderr}.log`` to this process's streams.

    Use as a context manager around the run; leaving it copies what is left (a last line
    without a newline included) and closes the files.

    Args:
        log_dir: torchrun's ``--log_dir``.
        interval: Seconds between two looks at the files.
    """

    def __init__(self, log_dir: str, interval: float = 0.05) -> None:
        self.log_dir = Path(log_dir)
        self.interval = interval
        self._followed: dict[Path, _Followed] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accel-output-relay", daemon=True)

    def __enter__(self) -> OutputRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._copy(final=True)
        for followed in self._followed.values():
            followed.handle.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._copy(final=False)

    def _discover(self) -> None:
        for stream in _STREAMS:
            for path in sorted(self.log_dir.glob(f"*/attempt_*/*/{stream}.log")):
                if path not in self._followed:
                    try:
                        self._followed[path] = _Followed(path, stream)
                    except OSError:
                        continue  # not readable yet: the next look finds it

    def _copy(self, final: bool) -> None:
        self._discover()
        for followed in self._followed.values():
            data = followed.handle.read()
            if not data and not (final and followed.partial):
                continue
            text = followed.partial + (data or b"")
            cut = len(text) if final else text.rfind(b"\n") + 1
            followed.partial = text[cut:]
            if cut:
                _write(followed.destination, text[:cut])


def _write(destination: str, data: bytes) -> None:
    stream = sys.stdout if destination == "stdout" else sys.stderr
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        stream.flush()
        raw.write(data)
        raw.flush()
    else:  # a text stream without bytes (a test's capture)
        stream.write(data.decode(errors="replace"))
        stream.flush()
