"""The device plan: a ``device_map`` parsed once, at the door, then handed on.

A user writes a device map as ``{module name: device}`` with devices in any of their forms
(``0``, ``"cuda:1"``, ``"cpu"``, ``"disk"``, ``torch.device(...)``), or names a strategy
(``"auto"``...) that :func:`~accel_bigmodel.dispatch.plan_device_map` turns into such a map.
Every entry point that takes a ``device_map`` (``load_checkpoint_and_dispatch``,
``dispatch_model``, ``load_checkpoint_in_model``, ``load_pretrained``, ``load_state_dict``)
turns it into a :class:`DevicePlan` before anything else reads it: the plan is built by
:func:`~accel_bigmodel.device_map.parse_device_map`, which validates the map with errors that
name the entry, its value and the fix, and it keeps the parsed devices. ``disk_offload`` uses
the plan of a model wholly on disk.

From there on, loading, weight planning and hook attachment are given the plan, not the map.
They ask it where a tensor goes (:meth:`DevicePlan.placement_of`, by longest matching prefix),
whether it goes to disk (:meth:`DevicePlan.on_disk`, :attr:`DevicePlan.has_disk`), which blocks
are offloaded and where each block runs (:meth:`DevicePlan.offload_flags`,
:meth:`DevicePlan.execution_devices`). None of them parses the map again or compares its values
with ``"disk"``. The hooks are given :class:`ExecutionDevice` pairs: the device as the user wrote
it (what ``hook.execution_device`` shows, as in Accelerate) together with the parsed device, so
attaching a hook parses nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .device_map import parse_device_map
from .tensors import DeviceLike, Placement, longest_prefix, placement_key, placement_kind

__all__ = ["DevicePlan", "ExecutionDevice"]

_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class ExecutionDevice:
    """Where a block runs, parsed once: the device as the user wrote it and as a torch device.

    An :class:`~accel_bigmodel.hooks.AlignDevicesHook` given one of these shows ``given`` as
    its ``execution_device`` (``0`` stays ``0``, as in Accelerate), runs on ``device`` and
    parses nothing.

    Attributes:
        given: the device as written in the device map or in the ``main_device`` argument.
        device: the same device, parsed.
    """

    given: DeviceLike
    device: torch.device


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """A device map parsed once: where each part of a model goes, and where it runs.

    Build it with :meth:`from_device_map` (which validates the map) at the entry point that
    received the ``device_map``; everything downstream reads the plan.

    Attributes:
        device_map: the map as the user wrote it (or as a strategy planned it), read-only: what
            ``model.hf_device_map`` shows and what error messages quote.
        placements: the same keys in the same order, with parsed devices (a ``torch.device``,
            or ``"disk"``), read-only.
        strategy: the strategy (``"auto"``, ``"balanced"``, ...) the map was planned with, or
            ``None`` when the user gave the map itself.
    """

    device_map: Mapping[str, DeviceLike]
    placements: Mapping[str, Placement]
    strategy: str | None = None

    @classmethod
    def from_device_map(
        cls,
        device_map: Any,
        model: nn.Module | None = None,
        *,
        on_this_machine: bool = True,
        strategy: str | None = None,
    ) -> DevicePlan:
        """Validate ``device_map`` with ``parse_device_map`` and keep it with its parsed devices.

        Args:
            device_map: ``{module or tensor name: device}``, as the user gave it.
            model: the model the map is for (to refuse a module placed twice).
            on_this_machine: also refuse accelerators this machine does not have.
            strategy: the strategy name the map was planned with, if it was.

        Raises:
            TypeError: ``device_map`` is not a mapping, or a key is not a string.
            ValueError: a value is not a device, names a device this machine lacks, or an
                entry lies inside another one with a different device (the message names the
                entry, its value and the fix).
        """
        placements = parse_device_map(device_map, model, on_this_machine=on_this_machine)
        return cls(MappingProxyType(dict(device_map)), MappingProxyType(placements), strategy)

    # -- where a tensor goes -------------------------------------------------------------

    def key_of(self, name: str) -> str | None:
        """The entry placing ``name``: its longest dotted prefix among the keys, or ``None``.

        ``""`` (the whole model) is a prefix of every name.
        """
        return longest_prefix(name, self.placements)

    def placement_of(self, name: str) -> Placement | None:
        """Where the entry placing ``name`` puts it (``None``: no entry places it)."""
        key = self.key_of(name)
        return None if key is None else self.placements[key]

    def on_disk(self, name: str) -> bool:
        """Whether the entry placing ``name`` sends it to disk."""
        placement = self.placement_of(name)
        return placement is not None and placement_kind(placement) == "disk"

    def keys_on(self, kind: str) -> list[str]:
        """The keys whose device is of ``kind`` (``"disk"``, ``"cpu"``, ``"meta"``, ``"cuda"``)."""
        return [key for key, device in self.placements.items() if placement_kind(device) == kind]

    # -- what the plan holds -------------------------------------------------------------

    @property
    def disk_keys(self) -> list[str]:
        """The keys whose tensors go to disk."""
        return self.keys_on("disk")

    @property
    def has_disk(self) -> bool:
        """Whether some entry sends its tensors to disk."""
        return bool(self.disk_keys)

    @property
    def offloaded_to(self) -> list[str]:
        """Which of ``"disk"`` and ``"cpu"`` some entry uses, ``"disk"`` first."""
        kinds = {placement_kind(device) for device in self.placements.values()}
        return [kind for kind in ("disk", "cpu") if kind in kinds]

    @property
    def needs_hooks(self) -> bool:
        """Whether running the model needs hooks: the map names several devices, or disk."""
        devices = {placement_key(device) for device in self.placements.values()}
        return len(devices) > 1 or self.has_disk

    @property
    def one_device(self) -> torch.device | None:
        """The device to move the whole model to when no hooks are needed.

        ``None`` when hooks are needed, or when the map is empty (nothing to move).
        """
        if self.needs_hooks:
            return None
        first = next(iter(self.placements.values()), None)
        return first if isinstance(first, torch.device) else None

    # -- where each block runs -----------------------------------------------------------

    def default_main_device(self) -> ExecutionDevice:
        """Where offloaded blocks run by default: the first device that is not the CPU or disk.

        The CPU when every entry is on the CPU or disk.
        """
        for key, device in self.placements.items():
            if isinstance(device, torch.device) and device.type != "cpu":
                return ExecutionDevice(self.device_map[key], device)
        return ExecutionDevice("cpu", _CPU)

    def offload_flags(self, main: torch.device | None) -> dict[str, bool]:
        """``{key: whether its block is offloaded}`` when offloaded blocks run on ``main``.

        Disk blocks always are. CPU blocks are only when ``main`` is an accelerator other
        than MPS: on the CPU or on MPS (which shares the host's memory) they already run
        where they are. ``main=None`` (no main device yet) offloads disk blocks only.
        """
        offloaded = ("disk",) if main is None or main.type in ("cpu", "mps") else ("cpu", "disk")
        return {key: placement_kind(device) in offloaded for key, device in self.placements.items()}

    def execution_devices(self, main: ExecutionDevice) -> dict[str, ExecutionDevice]:
        """``{key: where its block runs}``: its own device, or ``main`` for CPU and disk blocks.

        The root (``""``) runs on ``main`` too: its hook brings inputs there.
        """
        execution: dict[str, ExecutionDevice] = {}
        for key, device in self.placements.items():
            if isinstance(device, torch.device) and device.type != "cpu":
                execution[key] = ExecutionDevice(self.device_map[key], device)
            else:
                execution[key] = main
        execution[""] = main
        return execution
