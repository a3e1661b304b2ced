"""Whole-model CPU offload: :class:`CpuOffload` and the handle ``cpu_offload_with_hook`` returns."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel_bigmodel.tensors import DeviceLike, clear_device_cache, same_device
from accel_state.devices import default_device_type
from accel_state.structures import send_to_device

from .align import parse_execution_device
from .protocol import ModelHook, remove_hook_from_module

__all__ = ["CpuOffload", "UserCpuOffloadHook"]


class CpuOffload(ModelHook):
    """Keep a whole model on the CPU until its forward, then move it to the execution device.

    The model stays on the execution device after the forward; ``init_hook`` (or
    :meth:`UserCpuOffloadHook.offload`) sends it back to the CPU.

    Args:
        execution_device: where the model runs; default: the best available device (MPS, else
            GPU 0, else CPU).
        prev_module_hook: the hook of the previous model of a pipeline, offloaded to the CPU
            when this model starts.
    """

    def __init__(
        self,
        execution_device: DeviceLike | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            kind = default_device_type()
            execution_device = torch.device(kind, 0) if kind not in ("cpu", "mps") else kind
        parsed = parse_execution_device(execution_device)
        assert parsed is not None
        self.execution_device: DeviceLike = execution_device
        self.target_device = parsed

    def __repr__(self) -> str:
        return f"CpuOffload(execution_device={self.execution_device})"

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Send the model to the CPU."""
        return module.to("cpu")

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Offload the previous pipeline model, then bring this one (and its inputs) in."""
        previous = self.prev_module_hook
        if previous is not None:
            first = next(previous.model.parameters(), None)
            if first is not None and first.device.type != "cpu":
                previous.offload()
                clear_device_cache()
        first = next(module.parameters(), None)
        if first is not None and same_device(first.device, self.target_device):
            return args, kwargs
        module.to(self.target_device)
        return send_to_device(args, self.target_device), send_to_device(kwargs, self.target_device)


class UserCpuOffloadHook:
    """A model and its :class:`CpuOffload` hook, as returned by ``cpu_offload_with_hook``.

    Args:
        model: the hooked model.
        hook: its hook.
    """

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Send the model back to the CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook from the model."""
        remove_hook_from_module(self.model)
