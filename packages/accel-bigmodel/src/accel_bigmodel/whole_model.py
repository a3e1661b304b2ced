"""Whole-model offload: every weight kept off the execution device until its module runs.

:func:`cpu_offload` keeps one CPU copy of the weights, :func:`disk_offload` keeps them on disk
(or read in place from safetensors files), and both bring each module's weights in for its
forward. :func:`cpu_offload_with_hook` moves a whole model in and out for pipelines that run
several models in turn. :func:`get_state_dict_offloaded_model` and
:func:`get_state_dict_from_offload` read the real tensors back from an offloaded model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .device_plan import DevicePlan, ExecutionDevice
from .hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    find_align_devices_hook,
    has_offloaded_params,
)
from .hooks.align import parse_execution_device
from .prefetch import install_prefetch, resolve_prefetch_depth
from .tensors import DeviceLike, named_module_tensors
from .weight_sources import plan_weights, preview_names

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _WholeModelOffload:
    """What :func:`cpu_offload` and :func:`disk_offload` ask of the hooks."""

    caller: str
    execution_device: DeviceLike
    offload_buffers: bool
    preload_module_classes: list[str] | None
    prefetch_depth: int

    def hook_every_module(
        self, model: nn.Module, weights_map: Mapping[str, torch.Tensor] | None
    ) -> nn.Module:
        """Offload every module of ``model`` to ``weights_map``; outputs return to the inputs.

        Raises:
            ValueError: ``execution_device`` is not a device, or is ``"disk"`` (checked before
                any hook is attached).
        """
        # Parsed once here rather than once per hook.
        parsed = parse_execution_device(self.execution_device)
        assert parsed is not None
        execution = ExecutionDevice(self.execution_device, parsed)
        add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
        attach_align_device_hook(
            model,
            execution_device=execution,
            offload=True,
            offload_buffers=self.offload_buffers,
            weights_map=weights_map,
            preload_module_classes=self.preload_module_classes,
        )
        install_prefetch(model, self.prefetch_depth, self.caller)
        return model


def _default_execution_device(model: nn.Module) -> DeviceLike:
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta":
        return "cpu"
    return first.device


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
    *,
    prefetch_depth: int | None = None,
) -> nn.Module:
    """Keep one CPU copy of the weights; bring each module's weights in for its forward.

    Every parameter of ``model`` goes to ``meta``; at each module's forward its weights are
    copied from the CPU state dict to ``execution_device`` and dropped afterwards. Outputs come
    back on the device of the inputs.

    Args:
        model: the model.
        execution_device: where the forwards run; default: the device of the first parameter.
        offload_buffers: offload the buffers too.
        state_dict: the CPU weights; default: the model's own (no copy for CPU tensors).
        preload_module_classes: class names whose instances load all their weights (their
            submodules' too) at the start of their forward.
        prefetch_depth: how many offloaded modules to load ahead of the running one (``0``:
            synchronous, as Accelerate); default ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1.

    Returns:
        The model (changed in place).

    Raises:
        ValueError: no ``state_dict`` was given and some weights are on ``meta`` (named), or
            ``prefetch_depth`` is not an int >= 0.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    if execution_device is None:
        execution_device = _default_execution_device(model)
    if state_dict is None:
        own = model.state_dict()
        empty = [name for name, tensor in own.items() if tensor.device.type == "meta"]
        if empty:
            raise ValueError(
                f"cpu_offload: {preview_names(empty)} are on the meta device, so there is no "
                "CPU copy to bring back at forward. Load the weights first, or pass state_dict=."
            )
        state_dict = {name: tensor.to("cpu") for name, tensor in own.items()}
    offload = _WholeModelOffload(
        "cpu_offload", execution_device, offload_buffers, preload_module_classes, depth
    )
    return offload.hook_every_module(model, state_dict)


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until its forward, then leave it on the execution device.

    Meant for pipelines that run several models in turn: the previous model's hook (passed as
    ``prev_module_hook``) is offloaded when this model starts; call ``hook.offload()`` to send
    the last one back yourself.

    Args:
        model: the model (moved to the CPU now).
        execution_device: where it runs; default: MPS, else GPU 0, else the CPU.
        prev_module_hook: the hook returned for the previous model of the pipeline.

    Returns:
        ``(model, hook)``.

    Example::

        model_1, hook_1 = cpu_offload_with_hook(model_1, "cuda")
        model_2, hook_2 = cpu_offload_with_hook(model_2, "cuda", prev_module_hook=hook_1)
        out = model_2(model_1(x))  # model_1 goes back to the CPU when model_2 starts
        hook_2.offload()
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
    *,
    prefetch_depth: int | None = None,
) -> nn.Module:
    """Keep every weight on disk; bring each module's weights in for its forward.

    Weights already described by ``offload_dir/index.json`` are read from there; weights that
    ``load_checkpoint_in_model`` left on ``meta`` with a registered in-place entry are read from
    the safetensors file; every other weight is written to ``offload_dir`` once (Accelerate's
    folder format).

    Args:
        model: the model.
        offload_dir: the offload folder (created when needed).
        execution_device: where the forwards run; default: the device of the first parameter
            (the CPU when it is on ``meta``).
        offload_buffers: offload the buffers too.
        preload_module_classes: class names whose instances load all their weights (their
            submodules' too) at the start of their forward.
        prefetch_depth: how many offloaded modules to load ahead of the running one (``0``:
            synchronous, as Accelerate); default ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1.

    Returns:
        The model (changed in place).

    Raises:
        ValueError: weights on ``meta`` that no index describes (named), an ``offload_dir``
            that is a file or whose index or files do not fit the model (see
            ``dispatch_model``), or a ``prefetch_depth`` that is not an int >= 0.
        FileNotFoundError: a file the offload index reads from does not exist.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    if execution_device is None:
        execution_device = _default_execution_device(model)
    on_disk = DevicePlan.from_device_map({"": "disk"})
    plan = plan_weights(
        model,
        plan=on_disk,
        offload_flags=on_disk.offload_flags(None),
        main=execution_device,
        offload_dir=offload_dir,
        offload_buffers=offload_buffers,
    )
    weights_map = plan.apply(model)
    offload = _WholeModelOffload(
        "disk_offload", execution_device, offload_buffers, preload_module_classes, depth
    )
    return offload.hook_every_module(model, weights_map)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model whose weights may be offloaded, on the CPU.

    Each offloaded module's weights are brought in one module at a time (so only one module's
    weights are materialised at once besides the result); weights on a device are copied to the
    CPU. Tensors that stay on ``meta`` (never loaded, not offloaded) are left out with a
    warning.

    Args:
        model: the model (dispatched, offloaded or plain).

    Returns:
        ``{name: CPU tensor}`` in ``model.state_dict()`` order.
    """
    collected: dict[str, torch.Tensor] = {}
    skip_under: list[str] = []
    for module_name, module in model.named_modules():
        if any(module_name.startswith(prefix) for prefix in skip_under):
            continue
        hook = find_align_devices_hook(module)
        offloading = has_offloaded_params(module)
        recurse = bool(offloading and hook is not None and hook.place_submodules)
        if offloading:
            context: Any = align_module_device(module, "cpu")
        else:
            context = contextlib.nullcontext()
        prefix = f"{module_name}." if module_name else ""
        with context:
            for name, tensor in named_module_tensors(
                module, recurse=recurse, remove_non_persistent=True
            ):
                if tensor.device.type != "meta":
                    collected[prefix + name] = tensor.detach().to("cpu")
        if recurse:
            skip_under.append(prefix)
    ordered: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name in model.state_dict(keep_vars=True):
        if name in collected:
            ordered[name] = collected[name]
        else:
            missing.append(name)
    if missing:
        logger.warning(
            "These tensors were left out of the state dict because they are on the meta "
            "device and no offload hook holds them: %s",
            missing,
        )
    return ordered


def get_state_dict_from_offload(
    module: nn.Module,
    module_name: str,
    state_dict: dict[str, Any],
    device_to_put_offload: int | str | torch.device = "cpu",
) -> dict[str, Any]:
    """Fill ``state_dict``'s entries of ``module`` with its real tensors.

    ``module_name`` is the name of one of its tensors (``"lin.weight"``): its module prefix
    locates the entries. An offloaded module's weights are brought to
    ``device_to_put_offload`` for the copy. ``state_dict`` is changed in place and returned.
    """
    root = module_name.rsplit(".", 1)[0] if "." in module_name else ""
    prefix = f"{root}." if root else ""
    context: Any = (
        align_module_device(module, device_to_put_offload)
        if has_offloaded_params(module)
        else contextlib.nullcontext()
    )
    with context:
        for key, tensor in module.state_dict().items():
            if prefix + key in state_dict:
                state_dict[prefix + key] = tensor
    return state_dict
