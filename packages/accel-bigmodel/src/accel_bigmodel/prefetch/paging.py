"""The OS paging layer: check weight files and page memory-mapped ranges in ahead of use.

Pure OS work, no model knowledge: ``stat`` checks that a file still holds the bytes a weight
needs, and ``madvise`` (through ctypes, which releases the GIL during the call) asks the kernel
to read ranges of a memory map in: ``MADV_WILLNEED`` for read-ahead, then
``MADV_POPULATE_READ`` (Linux >= 5.14), which reads the pages and maps them into the very maps
the weight views use, and fails with ``EFAULT`` where touching the pages would raise ``SIGBUS``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
"""The size of a memory page: ranges handed to ``madvise`` start and end on one."""

MADV_WILLNEED: int | None = getattr(mmap, "MADV_WILLNEED", None)
# Python's mmap module does not export it; the value is Linux's.
MADV_POPULATE_READ: int | None = getattr(
    mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None
)

LibcCall = Callable[[int, int, Any], int]
"""The shape of ``madvise`` / ``mincore``: ``(address, length, third argument) -> status``."""


class Span(NamedTuple):
    """A byte range of a memory map and the file mapped there."""

    address: int
    length: int
    path: str


class FileNeed(NamedTuple):
    """A file that must still have ``needed`` bytes, and a weight read from it (for messages)."""

    path: str
    needed: int
    weight: str


def missing_file(path: str, name: str) -> FileNotFoundError:
    """The error for a weight file that was deleted or moved under a dispatched model."""
    return FileNotFoundError(
        errno.ENOENT,
        f"{path} no longer exists: it holds the offloaded weight {name!r}, which is read from "
        "it at every forward. It was deleted or moved while the model was dispatched; put it "
        "back, or load and dispatch the model again from where the weights are now.",
    )


def _shrunk_file(path: str, name: str, size: int, needed: int) -> ValueError:
    return ValueError(
        f"{path} has {size} bytes but the offloaded weight {name!r} needs its first {needed} "
        "bytes: the file was truncated or rewritten while the model was dispatched. Restore "
        "it, or load and dispatch the model again."
    )


def check_files(files: Iterable[FileNeed]) -> None:
    """Check that each file still exists and holds the bytes its weights need.

    Raises:
        FileNotFoundError: a file is gone (the message names it and a weight read from it).
        ValueError: a file is shorter than its weights need.
    """
    for path, needed, name in files:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise missing_file(path, name) from None
        if size < needed:
            raise _shrunk_file(path, name, size, needed)


def page_aligned(span: tuple[int, int, str]) -> Span:
    """``span`` widened to whole pages."""
    address, length, path = span
    start = address - address % PAGE
    end = address + length
    end += -end % PAGE
    return Span(start, end - start, path)


def merge_spans(spans: Iterable[tuple[int, int, str]]) -> tuple[Span, ...]:
    """Page-align spans and merge those of one file that touch or overlap, by address."""
    merged: list[Span] = []
    for span in sorted(page_aligned(span) for span in spans):
        last = merged[-1] if merged else None
        if last is not None and last.path == span.path and span.address <= _end(last):
            end = max(_end(last), _end(span))
            merged[-1] = last._replace(length=end - last.address)
        else:
            merged.append(span)
    return tuple(merged)


def _end(span: Span) -> int:
    return span.address + span.length


def _libc_function(name: str, third: Any) -> LibcCall | None:
    """``madvise`` / ``mincore`` from the C library, or ``None`` where there is none."""
    if sys.platform == "win32":
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    function.restype = ctypes.c_int
    return function


class Pager:
    """Pages memory-mapped ranges in with ``madvise``; knows whether the kernel can populate.

    Args:
        madvise: the C library's ``madvise`` (``None``: paging in does nothing).
        mincore: the C library's ``mincore`` (``None``: no range counts as resident).
        populate_read: the ``MADV_POPULATE_READ`` advice (``None``: read-ahead only).

    Attributes:
        populate_works: whether to ask for ``MADV_POPULATE_READ``; cleared for good the first
            time the kernel refuses it as unknown (a kernel older than 5.14).
    """

    def __init__(
        self,
        madvise: LibcCall | None,
        mincore: LibcCall | None,
        populate_read: int | None = MADV_POPULATE_READ,
    ) -> None:
        self.madvise = madvise
        self.mincore = mincore
        self.populate_read = populate_read
        self.populate_works = populate_read is not None

    def resident(self, address: int, length: int) -> bool:
        """Whether every page of a page-aligned mapped range is in memory (``mincore``)."""
        mincore = self.mincore
        if mincore is None:
            return False
        pages = -(-length // PAGE)
        vector = ctypes.create_string_buffer(pages)
        if mincore(address, length, vector) != 0:
            return False
        return ctypes.string_at(vector, pages).count(0) == 0

    def page_in(self, ranges: Sequence[Span], skip_resident: bool) -> None:
        """Read the pages of page-aligned memory-map ranges, in order.

        With ``skip_resident`` a range whose pages are all in memory (one cheap ``mincore``) is
        left alone: the caller sets it once the ranges were populated, as populating pages that
        are already mapped still costs a page-table walk with reference counting.

        Raises:
            ValueError: a file shrank under its map (``MADV_POPULATE_READ`` failed with
                ``EFAULT`` where touching the pages would raise ``SIGBUS``); names the file.
        """
        madvise = self.madvise
        if madvise is None:
            return
        for address, length, path in ranges:
            if skip_resident and self.resident(address, length):
                continue
            if MADV_WILLNEED is not None:
                madvise(address, length, MADV_WILLNEED)
            if self.populate_read is not None and self.populate_works:
                if madvise(address, length, self.populate_read) != 0:
                    self._populate_failed(ctypes.get_errno(), path, length)

    def _populate_failed(self, code: int, path: str, length: int) -> None:
        if code == errno.EFAULT:
            raise ValueError(
                f"{path} is shorter than when it was mapped: paging in {length} bytes of "
                "offloaded weights from it failed (the file was truncated or rewritten "
                "while the model was dispatched). Restore it, or load and dispatch the "
                "model again."
            )
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            self.populate_works = False  # an older kernel: read-ahead only from now on


PAGER = Pager(_libc_function("madvise", ctypes.c_int), _libc_function("mincore", ctypes.c_void_p))
"""The process's pager, on the C library's ``madvise`` and ``mincore``."""


def page_in_background(spans: Sequence[tuple[int, int, str]]) -> threading.Thread | None:
    """Page in ``(address, length, path)`` memory-map spans, in this order, on a daemon thread.

    For weights that are zero-copy views of their files and will be used soon (the first
    forward of a freshly loaded model): the reads run ahead of the compute instead of as page
    faults inside it. Spans already in memory are skipped (one ``mincore`` each), so a warm
    page cache costs next to nothing. Failures are logged at debug level only: the forward
    reads the pages itself anyway.

    Returns:
        The thread, or ``None`` when there is nothing to do or no ``madvise`` here.
    """
    pager = PAGER
    if pager.madvise is None or not spans:
        return None
    ranges = [page_aligned(span) for span in spans]

    def run() -> None:
        try:
            pager.page_in(ranges, skip_resident=True)
        except (OSError, ValueError) as error:
            logger.debug("Paging in the weights ahead of the first forward stopped: %s", error)

    thread = threading.Thread(target=run, name="accel-page-in", daemon=True)
    thread.start()
    return thread
