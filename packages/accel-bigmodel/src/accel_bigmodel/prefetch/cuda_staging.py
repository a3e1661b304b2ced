"""CUDA staging: copy host weights to a device through pinned buffers on a side stream.

Imported on every machine; CUDA is touched only when a stager is created, which the engine does
only for hooks that execute on a CUDA device while CUDA is available.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accel_bigmodel.hooks import AlignDevicesHook

ALIGNMENT = 256
"""Byte alignment of each tensor inside a staging buffer."""

StagedItem = tuple[AlignDevicesHook, str, torch.Tensor]
"""``(hook, tensor name, host tensor)``: one weight to copy to the device."""

DeviceTensors = dict[AlignDevicesHook, dict[str, torch.Tensor]]
"""Device tensors per hook, by tensor name."""


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


class CudaStager:
    """Copies host tensors to one CUDA device through pinned staging buffers on a side stream.

    Used by the background thread only. ``slots`` buffers of at least the capacity asked for
    are pinned on first use; a buffer is refilled only after the event recorded behind its
    previous copies has completed.

    Args:
        device: the CUDA device, with its index.
        slots: how many staging buffers to rotate through.
    """

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        self._next = 0

    def stage(self, items: Sequence[StagedItem], capacity: int) -> tuple[DeviceTensors, Any]:
        """Start copying ``items`` to the device.

        Args:
            items: the weights to copy.
            capacity: the least size of a new buffer (the largest unit's bytes), so that one
                allocation serves every unit.

        Returns:
            The device tensors, and the event recorded after their copies.
        """
        offsets: list[int] = []
        total = 0
        for _, _, host in items:
            offsets.append(total)
            total += aligned(host.numel() * host.element_size())
        slot, buffer = self._free_buffer(total, capacity)
        staged: DeviceTensors = {}
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for (hook, name, host), offset in zip(items, offsets, strict=True):
                if host.is_pinned():
                    source = host
                else:
                    nbytes = host.numel() * host.element_size()
                    source = buffer[offset : offset + nbytes].view(host.dtype).view(host.shape)
                    source.copy_(host)
                target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                target.copy_(source, non_blocking=True)
                staged.setdefault(hook, {})[name] = target
            done = torch.cuda.Event()
            done.record(self.stream)
        self._events[slot] = done
        return staged, done

    def _free_buffer(self, total: int, capacity: int) -> tuple[int, torch.Tensor]:
        """The next slot and its buffer, once its last copies are done, of >= ``total`` bytes."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        previous = self._events[slot]
        if previous is not None:
            previous.synchronize()
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < total:
            self._buffers[slot] = None  # free the old one before pinning its replacement
            buffer = torch.empty(max(total, capacity), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        return slot, buffer


class StagingPool:
    """One :class:`CudaStager` per device, created on first use.

    Args:
        slots: staging buffers per device.
        capacity: the least size of a staging buffer, in bytes.
    """

    def __init__(self, slots: int, capacity: int) -> None:
        self.slots = slots
        self.capacity = capacity
        self._stagers: dict[torch.device, CudaStager] = {}

    def stage(self, by_device: dict[torch.device, list[StagedItem]]) -> StagedWeights:
        """Start copying each device's items to it; returns the tensors and their events."""
        values: DeviceTensors = {}
        events: dict[torch.device, Any] = {}
        for device, items in by_device.items():
            stager = self._stagers.get(device)
            if stager is None:
                stager = CudaStager(device, self.slots)
                self._stagers[device] = stager
            staged, events[device] = stager.stage(items, self.capacity)
            for hook, tensors in staged.items():
                values.setdefault(hook, {}).update(tensors)
        return StagedWeights(values, events)


class StagedWeights:
    """What a finished prefetch produced: device tensors per hook and their copy events.

    Empty on CPU execution, where the weights stay views of the files' maps.
    """

    __slots__ = ("events", "values")

    def __init__(
        self, values: DeviceTensors | None = None, events: dict[torch.device, Any] | None = None
    ) -> None:
        self.values: DeviceTensors = {} if values is None else values
        self.events: dict[torch.device, Any] = {} if events is None else events

    def take(self, hook: AlignDevicesHook) -> dict[str, torch.Tensor] | None:
        """Hand over ``hook``'s device tensors, ordered after their copies on the current stream."""
        values = self.values.pop(hook, None)
        if not values:
            return None
        device = hook.target_device
        if device is None or device.type != "cuda":
            return values
        device = cuda_device(device)
        event = self.events.get(device)
        if event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            for tensor in values.values():
                tensor.record_stream(stream)
        return values
