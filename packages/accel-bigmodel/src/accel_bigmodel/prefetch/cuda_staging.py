"""Staging: copy a unit's host weights to a GPU on a side stream, at the link's speed.

Imported on every machine; a device is touched only when a pool stages something, which the
engine does only for hooks that execute on a CUDA device while CUDA is available. All device
calls go through a :class:`~.copy_api.CopyApi`, so the tests run this code with a fake.

Two routes, chosen per weight:

- **Direct** (CPU-resident weights, ``auto``/``register`` modes): the weight's pages are
  page-locked where they are (:class:`~.host_pinning.HostPinning`) the first time it is staged,
  and every copy is one DMA from them: no CPU copy, no thread, no extra memory.
- **Ring** (disk weights; resident weights the driver would not page-lock; ``ring`` mode): the
  bytes are copied by several threads (:class:`~.copy_threads.ParallelCopier`) into a ring of
  pinned slots, and each filled slot is copied to the device while the next one fills. A slot
  is refilled only after the event recorded behind its previous copies has completed.

Bytes travel as stored; a weight whose file dtype differs from the model's is cast on the
device, on the side stream, after its copy. One event recorded after all of a unit's copies
and casts orders the consumer's stream after them (:meth:`StagedWeights.take`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from accel_bigmodel.hooks import AlignDevicesHook
from accel_bigmodel.tensors import castable

from .copy_api import CopyApi, CopyEvent
from .copy_threads import ParallelCopier, Piece
from .host_pinning import HostPinning
from .staging_mode import StagingMode

ALIGNMENT = 256
"""Byte alignment of each piece inside a staging slot."""

RING_SLOTS = 4
RING_SLOT_BYTES = 32 << 20
"""The ring: 4 pinned slots of 32 MiB per device (fewer bytes for a model whose largest unit is
smaller): one slot fills while up to three are being copied."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the staging alignment."""
    return nbytes + (-nbytes % ALIGNMENT)


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` means the calling thread's current device)."""
    if device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def stageable(value: Any) -> bool:
    """Whether ``value`` is a non-empty dense CPU tensor that staging can copy."""
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.is_quantized
        and value.numel() > 0
    )


class StagedItem(NamedTuple):
    """One weight to copy to the device.

    Attributes:
        hook: the offloading hook it belongs to.
        name: its tensor name in the hook's module.
        host: its bytes on the host, as stored (a file map view or a tensor in RAM).
        dtype: the dtype the model wants (cast on the device when it differs and can be).
        resident: it lives in RAM for good (the CPU tier), so it may be page-locked in place;
            disk weights are ``False``.
    """

    hook: AlignDevicesHook
    name: str
    host: torch.Tensor
    dtype: torch.dtype
    resident: bool


DeviceTensors = dict[AlignDevicesHook, dict[str, torch.Tensor]]
"""Device tensors per hook, by tensor name."""


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view (a copy first if not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class StagingRing:
    """``slots`` pinned buffers of ``slot_bytes``, used in turn.

    A slot is handed out only once the event of its previous copies has completed; buffers are
    pinned on first use.
    """

    def __init__(self, api: CopyApi, slots: int, slot_bytes: int) -> None:
        self.api = api
        self.slot_bytes = slot_bytes
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[CopyEvent | None] = [None] * slots
        self._next = 0

    def acquire(self) -> tuple[int, torch.Tensor]:
        """The next slot and its buffer, after its previous copies are done."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = self.api.pinned(self.slot_bytes)
        return slot, buffer

    def filled(self, slot: int, event: CopyEvent) -> None:
        """The copies out of ``slot`` are queued; ``event`` completes after them."""
        self._events[slot] = event

    def wait(self) -> None:
        """Wait for every slot's copies."""
        for event in self._events:
            if event is not None:
                event.synchronize()


class _RingFill:
    """The pieces going through one ring slot: filled together, then copied out together."""

    def __init__(self, slot: int, buffer: torch.Tensor) -> None:
        self.slot = slot
        self.buffer = buffer
        self.used = 0
        self.pieces: list[Piece] = []
        self.copies: list[tuple[torch.Tensor, int, int]] = []  # (target bytes, offset, length)

    def room(self) -> int:
        return self.buffer.numel() - self.used

    def add(self, target: torch.Tensor, source: torch.Tensor, start: int, length: int) -> None:
        """Queue ``source[start:start+length]`` through this slot into ``target[start:...]``."""
        self.pieces.append(
            Piece(self.buffer.data_ptr() + self.used, source.data_ptr() + start, length)
        )
        self.copies.append((target[start : start + length], self.used, length))
        self.used = min(self.buffer.numel(), self.used + aligned(length))


class CudaStager:
    """Copies host weights to one device on its own side stream (see the module documentation).

    Args:
        api: the device calls.
        device: the device, with its index.
        ring: the device's pinned ring.
        pinning: the engine's page-locked ranges.
        copier: the threads filling the ring.
    """

    def __init__(
        self,
        api: CopyApi,
        device: torch.device,
        ring: StagingRing,
        pinning: HostPinning,
        copier: ParallelCopier,
    ) -> None:
        self.api = api
        self.device = device
        self.stream = api.new_stream(device)
        self.ring = ring
        self.pinning = pinning
        self.copier = copier
        self.direct_bytes = 0
        self.ring_bytes = 0

    def stage(self, items: Sequence[StagedItem]) -> tuple[DeviceTensors, CopyEvent]:
        """Start copying ``items`` to the device.

        Returns:
            The device tensors (in the model's dtypes), and the event recorded after their
            copies and casts.
        """
        api = self.api
        staged: DeviceTensors = {}
        with torch.no_grad(), api.on_stream(self.device, self.stream):
            direct = self._direct(items)
            raw = [api.empty(aligned(_nbytes(item.host)), self.device) for item in items]
            through_ring: list[tuple[torch.Tensor, torch.Tensor]] = []
            for item, target, straight in zip(items, raw, direct, strict=True):
                source = host_bytes(item.host)
                if straight:
                    api.copy(target[: source.numel()], source)
                    self.direct_bytes += source.numel()
                else:
                    through_ring.append((target, source))
            self._through_ring(through_ring)
            for item, target in zip(items, raw, strict=True):
                host = item.host
                value = target[: _nbytes(host)].view(host.dtype).view(host.shape)
                if item.dtype != host.dtype and castable(host.dtype) and castable(item.dtype):
                    value = api.cast(value, item.dtype)
                staged.setdefault(item.hook, {})[item.name] = value
            done = api.record(self.stream)
        return staged, done

    def _direct(self, items: Sequence[StagedItem]) -> list[bool]:
        """Which items the device reads in place (page-locked now or already pinned)."""
        flags = [self.api.is_pinned(item.host) and item.host.is_contiguous() for item in items]
        wanted = [i for i, item in enumerate(items) if item.resident and not flags[i]]
        if wanted:
            pinned = self.pinning.pin([items[i].host for i in wanted], self.device)
            for position, ok in zip(wanted, pinned, strict=True):
                flags[position] = ok
        return flags

    def _through_ring(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(device bytes, host bytes)`` pair through the ring."""
        fill: _RingFill | None = None
        for target, source in pairs:
            length = source.numel()
            start = 0
            while start < length:
                left = length - start
                if fill is not None and (fill.room() == 0 or (left > fill.room() and fill.used)):
                    # Full, or a piece that a fresh slot would hold whole: next slot.
                    self._flush(fill)
                    fill = None
                if fill is None:
                    fill = _RingFill(*self.ring.acquire())
                take = min(left, fill.room())
                fill.add(target, source, start, take)
                start += take
            self.ring_bytes += length
        if fill is not None:
            self._flush(fill)

    def _flush(self, fill: _RingFill) -> None:
        """Fill the slot (threads), queue its copies to the device, record its event."""
        self.copier.copy(fill.pieces)
        for target, offset, length in fill.copies:
            self.api.copy(target, fill.buffer[offset : offset + length])
        self.ring.filled(fill.slot, self.api.record(self.stream))

    def close(self) -> None:
        """Wait for everything queued on the side stream."""
        self.api.synchronize(self.stream)
        self.ring.wait()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class StagingPool:
    """The staging of one engine: one stager per device, one set of page-locked ranges.

    Args:
        api: the device calls.
        mode: the staging mode (see :mod:`.staging_mode`).
        copy_threads: the threads filling the rings.
        largest: the largest unit's bytes (a ring slot is no larger).
    """

    def __init__(self, api: CopyApi, mode: StagingMode, copy_threads: int, largest: int) -> None:
        self.api = api
        self.mode = mode
        self.pinning = HostPinning(api, mode)
        self.copier = ParallelCopier(copy_threads)
        self.slot_bytes = max(ALIGNMENT, min(RING_SLOT_BYTES, aligned(largest)))
        self._stagers: dict[torch.device, CudaStager] = {}
        self._pid = os.getpid()

    def stage(self, by_device: dict[torch.device, list[StagedItem]]) -> StagedWeights:
        """Start copying each device's items to it; returns the tensors and their events."""
        values: DeviceTensors = {}
        events: dict[torch.device, CopyEvent] = {}
        for device, items in by_device.items():
            stager = self._stagers.get(device)
            if stager is None:
                ring = StagingRing(self.api, RING_SLOTS, self.slot_bytes)
                stager = CudaStager(self.api, device, ring, self.pinning, self.copier)
                self._stagers[device] = stager
            staged, events[device] = stager.stage(items)
            for hook, tensors in staged.items():
                values.setdefault(hook, {}).update(tensors)
        return StagedWeights(self.api, values, events)

    def report(self) -> dict[str, Any]:
        """Bytes staged by each route, and the page-locked bytes (for benchmarks and logs)."""
        return {
            "mode": self.mode,
            "direct_bytes": sum(stager.direct_bytes for stager in self._stagers.values()),
            "ring_bytes": sum(stager.ring_bytes for stager in self._stagers.values()),
            "registered_bytes": self.pinning.registered_bytes,
            "registration_refused": self.pinning.refusal,
        }

    def close(self) -> None:
        """Wait for every copy, unregister the page-locked ranges, stop the copy threads.

        Does nothing in a forked child, which has none of them (and may not touch CUDA).
        """
        if os.getpid() != self._pid:
            return
        stagers, self._stagers = list(self._stagers.values()), {}
        try:
            for stager in stagers:
                stager.close()
        finally:
            self.pinning.release()
            self.copier.close()


class StagedWeights:
    """What a finished prefetch produced: device tensors per hook and their copy events.

    Empty on CPU execution, where the weights stay views of the files' maps.
    """

    __slots__ = ("api", "events", "values")

    def __init__(
        self,
        api: CopyApi | None = None,
        values: DeviceTensors | None = None,
        events: dict[torch.device, CopyEvent] | None = None,
    ) -> None:
        self.api = api
        self.values: DeviceTensors = {} if values is None else values
        self.events: dict[torch.device, CopyEvent] = {} if events is None else events

    def take(self, hook: AlignDevicesHook) -> dict[str, torch.Tensor] | None:
        """Hand over ``hook``'s device tensors, ordered after their copies on the current stream."""
        values = self.values.pop(hook, None)
        if not values or self.api is None:
            return values or None
        device = hook.target_device
        if device is None:
            return values
        if device.type == "cuda":
            device = cuda_device(device)
        event = self.events.get(device)
        if event is not None:
            self.api.hand_over(device, event, list(values.values()))
        return values
