"""Host-to-host byte copies split over several threads, without the GIL and without OpenMP.

The pinned staging ring is filled from pageable memory (a file's map, or anonymous memory) by
``memmove`` calls through ctypes, which release the GIL: several threads copy disjoint pieces
at once. torch's ``copy_`` is not used for this: it splits a large copy over the intra-op
(OpenMP) pool, whose threads wait for each other at a barrier, and on a machine where other
processes keep the cores busy that barrier waits for the slowest descheduled thread.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

THREAD_NAME = "accel-offload-copy"
MIN_PIECE = 1 << 20
"""Copies are cut into pieces of at least 1 MiB: smaller ones cost more to hand out than to do."""


class Piece(NamedTuple):
    """Copy ``length`` bytes from address ``source`` to address ``target``."""

    target: int
    source: int
    length: int


def split(pieces: Sequence[Piece], parts: int, minimum: int = MIN_PIECE) -> list[list[Piece]]:
    """Cut ``pieces`` into at most ``parts`` groups of about equal bytes, in order.

    Each group but the last takes ``max(minimum, total / parts)`` bytes (cutting a piece where
    its share ends); the last takes the rest. Fewer groups when there are few bytes.
    """
    total = sum(piece.length for piece in pieces)
    if not total:
        return []
    share = max(minimum, -(-total // max(1, parts)))
    groups: list[list[Piece]] = [[]]
    room = share if parts > 1 else total
    for target, source, length in pieces:
        offset = 0
        while offset < length:
            if room == 0:
                groups.append([])
                room = share if len(groups) < parts else total
            take = min(length - offset, room)
            groups[-1].append(Piece(target + offset, source + offset, take))
            offset += take
            room -= take
    return groups


def _run(group: Sequence[Piece]) -> None:
    for target, source, length in group:
        ctypes.memmove(target, source, length)


class _Job:
    __slots__ = ("done", "error", "group")

    def __init__(self, group: Sequence[Piece]) -> None:
        self.group = group
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            _run(self.group)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            self.error = error
        finally:
            self.done.set()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        del job


class ParallelCopier:
    """Copies with ``threads`` threads: the caller and ``threads - 1`` helpers started on first use.

    Args:
        threads: how many threads copy at once (>= 1).
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._helpers: list[threading.Thread] = []

    def copy(self, pieces: Sequence[Piece]) -> None:
        """Do every copy of ``pieces`` (disjoint targets); returns when all are done.

        Raises:
            BaseException: what a copy raised (the others are finished first).
        """
        groups = split(pieces, self.threads)
        if not groups:
            return
        self._start(len(groups) - 1)
        jobs = [_Job(group) for group in groups[1:]]
        for job in jobs:
            self._jobs.put(job)
        first = _Job(groups[0])
        first.run()
        for job in jobs:
            job.done.wait()
        for job in (first, *jobs):
            if job.error is not None:
                raise job.error

    def _start(self, wanted: int) -> None:
        while len(self._helpers) < wanted:
            thread = threading.Thread(
                target=_serve, args=(self._jobs,), name=THREAD_NAME, daemon=True
            )
            thread.start()
            self._helpers.append(thread)

    def close(self) -> None:
        """Stop the helper threads (they finish what is queued first)."""
        helpers, self._helpers = self._helpers, []
        for _ in helpers:
            self._jobs.put(None)
        for thread in helpers:
            if thread is not threading.current_thread():
                thread.join()
