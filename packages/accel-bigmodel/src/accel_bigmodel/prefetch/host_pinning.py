"""Page-locking CPU-resident weights in place, so that a GPU copies them with no CPU work.

A weight kept in RAM for a GPU model (a ``"cpu"`` block of the device map) is, with accel, a
zero-copy view of the user's safetensors file or a tensor in anonymous memory. Page-locking
its pages where they are (``cuMemHostRegister``, read-only) lets every later forward copy it to
the device by DMA at the link's speed, with no staging copy, no thread and no extra memory;
the pages stay resident until the engine closes (they are the CPU tier: the device map sized
it to fit in RAM). Disk weights are never page-locked: they would then stay in RAM.

Registrations are page ranges. Each engine owns its own; a range that touches a page another
engine registered is not used (that engine may unregister it while a copy reads it), and those
weights take the pinned ring instead. Overlapping ranges of one engine (neighbouring tensors
sharing a page) are registered once.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .copy_api import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CopyApi
from .staging_mode import StagingMode

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE

_TAKEN: dict[int, tuple[int, object]] = {}
"""Every registered range of the process: start -> (end, owning registry)."""
_TAKEN_LOCK = threading.Lock()


class _Range(NamedTuple):
    start: int
    end: int


def page_range(tensor: torch.Tensor) -> _Range | None:
    """The whole pages holding a contiguous CPU tensor's bytes (``None``: not contiguous)."""
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return _Range(start - start % PAGE, end + (-end % PAGE))


def merge_ranges(ranges: Sequence[_Range]) -> list[_Range]:
    """Sorted ranges with the overlapping or touching ones merged."""
    merged: list[_Range] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1].end:
            if end > merged[-1].end:
                merged[-1] = _Range(merged[-1].start, end)
        else:
            merged.append(_Range(start, end))
    return merged


class HostPinning:
    """The page-locked ranges of one engine's CPU-resident weights.

    Args:
        api: the device calls (:class:`~.copy_api.CudaCopyApi`, or a fake in tests).
        mode: the staging mode; ``"ring"`` never registers anything.

    Attributes:
        works: registration is used; cleared for good by the first refusal other than
            "already registered" (logged once: INFO in ``auto`` mode, WARNING in ``register``).
        refusal: that refusal, for reports.
    """

    def __init__(self, api: CopyApi, mode: StagingMode) -> None:
        self.api = api
        self.mode = mode
        self.works = mode != "ring"
        self.refusal = ""
        self._ranges: dict[int, tuple[int, list[torch.Tensor]]] = {}  # start -> (end, keep)
        self._lock = threading.Lock()

    @property
    def registered_bytes(self) -> int:
        """How many bytes this engine has page-locked."""
        return sum(end - start for start, (end, _) in self._ranges.items())

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor``'s pages are in this engine's registrations."""
        wanted = page_range(tensor)
        return wanted is not None and not self._gaps(wanted)

    def pin(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[bool]:
        """Page-lock the pages of ``tensors`` for copies to ``device``; which of them are now.

        A tensor is left out (``False``) when it is not contiguous, when its pages touch
        another engine's registration, or when the driver refuses; its bytes then go through
        the pinned ring. Never raises for a refusal.
        """
        if not self.works:
            return [False] * len(tensors)
        wanted = [page_range(tensor) for tensor in tensors]
        with self._lock:
            blocked: set[int] = set()
            for position, span in enumerate(wanted):
                if span is None or self._foreign(span):
                    blocked.add(position)
            chosen = [
                (span, tensors[i])
                for i, span in enumerate(wanted)
                if span is not None and i not in blocked
            ]
            for merged in merge_ranges([span for span, _ in chosen]):
                for gap in self._gaps(merged):
                    # The tensors over the gap keep its memory mapped while it is registered.
                    keep = [tensor for span, tensor in chosen if _overlap(span, gap)]
                    if not self._register(gap, keep, device):
                        break
                if not self.works:
                    break
            return [
                span is not None and i not in blocked and not self._gaps(span)
                for i, span in enumerate(wanted)
            ]

    def release(self) -> None:
        """Unregister every range (the caller has waited for the copies reading them)."""
        with self._lock:
            ranges, self._ranges = self._ranges, {}
        with _TAKEN_LOCK:
            for start in ranges:
                _TAKEN.pop(start, None)
        for start in ranges:
            code = self.api.unregister(start)
            if code != 0:
                logger.debug(
                    "Unregistering page-locked offload weights at %#x failed: %s",
                    start,
                    self.api.error_name(code),
                )

    def _gaps(self, span: _Range) -> list[_Range]:
        """The parts of ``span`` this engine has not registered (whole pages)."""
        gaps: list[_Range] = []
        cursor = span.start
        for start in sorted(self._ranges):
            end = self._ranges[start][0]
            if end <= cursor or start >= span.end:
                continue
            if start > cursor:
                gaps.append(_Range(cursor, start))
            cursor = max(cursor, end)
            if cursor >= span.end:
                break
        if cursor < span.end:
            gaps.append(_Range(cursor, span.end))
        return gaps

    def _foreign(self, span: _Range) -> bool:
        """Whether ``span`` touches a range another engine registered."""
        with _TAKEN_LOCK:
            return any(
                owner is not self and start < span.end and span.start < end
                for start, (end, owner) in _TAKEN.items()
            )

    def _register(self, gap: _Range, keep: list[torch.Tensor], device: torch.device) -> bool:
        code = self.api.register(gap.start, gap.end - gap.start, device)
        if code == 0:
            self._ranges[gap.start] = (gap.end, keep)
            with _TAKEN_LOCK:
                _TAKEN[gap.start] = (gap.end, self)
            return True
        if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            return False  # pinned by someone else (e.g. pin_memory()): the ring takes it
        self.works = False
        self.refusal = self.api.error_name(code)
        level = logging.WARNING if self.mode == "register" else logging.INFO
        logger.log(
            level,
            "Offload: page-locking %d MB of CPU-resident weights in place failed (%s); they "
            "are copied to the GPU through a pinned staging ring instead (slower, and it uses "
            "CPU threads). Set ACCEL_OFFLOAD_STAGING=ring to skip the attempt.",
            (gap.end - gap.start) // 1_000_000,
            self.refusal,
        )
        return False


def _overlap(first: _Range, second: _Range) -> bool:
    return first.start < second.end and second.start < first.end
