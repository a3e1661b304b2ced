"""Attaching :class:`~accel_bigmodel.hooks.AlignDevicesHook` instances over a module tree.

:func:`attach_align_device_hook` hooks every submodule with tensors of its own;
:func:`attach_align_device_hook_on_blocks` hooks a model per device-map block and chains the
blocks' top hooks in execution order (see :class:`~accel_bigmodel.hooks.align.BlockLink`);
:func:`attach_execution_device_hook` gives unhooked submodules a hook that only moves inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from accel_bigmodel.device_plan import ExecutionDevice
from accel_bigmodel.offload import PrefixedDataset
from accel_bigmodel.tensors import DeviceLike, named_module_tensors

from .align import (
    AlignDevicesHook,
    BlockLink,
    TiedParamsMap,
    find_align_devices_hook,
    offloading_hook,
)
from .protocol import add_hook_to_module, hook_of

__all__ = [
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
]


@dataclass(frozen=True)
class _AttachOptions:
    """The arguments that stay the same all the way down an attach walk."""

    weights_map: Mapping[str, torch.Tensor] | None = None
    offload_buffers: bool = False
    skip_keys: str | list[str] | None = None
    preload_module_classes: list[str] | None = None
    tied_params_map: TiedParamsMap | None = None

    def preloads(self, module: nn.Module) -> bool:
        """Whether ``module`` loads its submodules' weights with its own (no hooks below it)."""
        classes = self.preload_module_classes
        return classes is not None and type(module).__name__ in classes

    def weights_under(self, module_name: str) -> Mapping[str, torch.Tensor] | None:
        """The weights map seen from the module called ``module_name``."""
        if self.weights_map is None or not module_name:
            return self.weights_map
        return PrefixedDataset(self.weights_map, f"{module_name}.")


HookDevice = DeviceLike | ExecutionDevice
"""An execution device as the hooks take it: as written (parsed by each hook), or already parsed
by a :class:`~accel_bigmodel.device_plan.DevicePlan` (parsed by none)."""

_MarkedBlock = tuple[AlignDevicesHook, str, list[tuple[nn.Module, AlignDevicesHook]]]
"""A block hook met by the walk, its block name and the offloading hooks inside its block."""


def _child_name(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _has_state(module: nn.Module) -> bool:
    """Whether ``module.state_dict()`` would be non-empty (without building it)."""
    for _ in module.parameters():
        return True
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                return True
    return False


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: HookDevice | None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Give every submodule that has weights and no hook a hook moving its inputs to a device.

    Args:
        module: the root of the submodules to hook.
        execution_device: where their inputs go.
        skip_keys: keyword-argument keys whose values are not moved.
        preload_module_classes: class names whose submodules are not hooked (their weights are
            loaded with the instance's own).
        tied_params_map: shared tied-weight map (see :class:`AlignDevicesHook`).
    """
    options = _AttachOptions(
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    _attach_execution(module, execution_device, options)


def _attach_execution(
    module: nn.Module, execution_device: HookDevice | None, options: _AttachOptions
) -> None:
    if hook_of(module) is None and _has_state(module):
        hook = AlignDevicesHook(
            execution_device,
            skip_keys=options.skip_keys,
            tied_params_map=options.tied_params_map,
        )
        add_hook_to_module(module, hook)
    if options.preloads(module):
        return
    for child in module.children():
        _attach_execution(child, execution_device, options)


def attach_align_device_hook(  # noqa: PLR0913 - Accelerate's signature
    module: nn.Module,
    execution_device: HookDevice | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach an :class:`AlignDevicesHook` to every submodule that has tensors of its own.

    Each hook sees ``weights_map`` through the module's dotted prefix. An instance of a class in
    ``preload_module_classes`` gets one hook for all its submodules' tensors (loaded together at
    the start of its forward) and the recursion stops there.

    Args:
        module: the root module.
        execution_device: where the forwards run.
        offload: keep weights on ``meta`` between calls.
        weights_map: name -> tensor map for the whole of ``module`` (names relative to it).
        offload_buffers: offload buffers too.
        module_name: the dotted name of ``module`` in ``weights_map``.
        skip_keys: keyword-argument keys whose values are not moved.
        preload_module_classes: class names whose instances load all their weights at once.
        tied_params_map: shared tied-weight map (see :class:`AlignDevicesHook`).
    """
    options = _AttachOptions(
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    _attach_align(module, module_name, execution_device, offload, options)


def _attach_align(
    module: nn.Module,
    module_name: str,
    execution_device: HookDevice | None,
    offload: bool,
    options: _AttachOptions,
) -> None:
    has_direct = next(iter(named_module_tensors(module)), None) is not None
    full_offload = offload and options.preloads(module)
    if has_direct or full_offload:
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=options.weights_under(module_name),
            offload_buffers=options.offload_buffers,
            place_submodules=full_offload,
            skip_keys=options.skip_keys,
            tied_params_map=options.tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for child_name, child in module.named_children():
        _attach_align(
            child, _child_name(module_name, child_name), execution_device, offload, options
        )


def attach_align_device_hook_on_blocks(  # noqa: PLR0913 - Accelerate's signature
    module: nn.Module,
    execution_device: HookDevice | Mapping[str, HookDevice] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach hooks per block of a device map (dicts keyed by the device map's module names).

    A block kept on its device gets one hook placing all its tensors there (and hooks moving
    inputs on its submodules); an offloaded block gets offloading hooks on every submodule with
    tensors. The root module always gets a hook giving outputs back on the caller's device.
    Each block's top hook becomes its *block hook*, chained to the next block in execution
    order (see :mod:`accel_bigmodel.hooks`).

    Args:
        module: the model.
        execution_device: one device, or ``{module name: device}`` (``dispatch_model`` passes
            the :class:`~accel_bigmodel.device_plan.ExecutionDevice` values of its device plan).
        offload: one flag, or ``{module name: whether that block is offloaded}``.
        weights_map: name -> tensor map for the offloaded weights (names relative to ``module``).
        offload_buffers: offload buffers too.
        module_name: the dotted name of ``module`` (``""`` for the model).
        skip_keys: keyword-argument keys whose values are not moved.
        preload_module_classes: class names whose instances load all their weights at once.
        tied_params_map: shared tied-weight map (see :class:`AlignDevicesHook`).
    """
    options = _AttachOptions(
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    if isinstance(execution_device, Mapping):
        devices: dict[str, HookDevice | None] = dict(execution_device)
    elif isinstance(offload, Mapping):
        devices = dict.fromkeys(offload, execution_device)
    else:
        _attach_on_one_device(module, module_name, execution_device, offload, options)
        return
    flags = dict(offload) if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    attacher = _BlockAttacher(devices, flags, options)
    attacher.attach(module, module_name)
    attacher.link_blocks()


def _attach_on_one_device(
    module: nn.Module,
    module_name: str,
    execution_device: HookDevice | None,
    offload: bool,
    options: _AttachOptions,
) -> None:
    """The whole model is one block: placed on its device, or offloaded module by module."""
    if offload:
        _attach_align(module, module_name, execution_device, True, options)
        return
    hook = AlignDevicesHook(
        execution_device=execution_device,
        io_same_device=True,
        skip_keys=options.skip_keys,
        place_submodules=True,
        tied_params_map=options.tied_params_map,
    )
    add_hook_to_module(module, hook)


class _BlockAttacher:
    """One walk of ``attach_align_device_hook_on_blocks`` over a model with a device map.

    Args:
        devices: ``{block name: execution device}``.
        flags: ``{block name: whether the block is offloaded}``.
        options: what every hook of the walk shares.
    """

    def __init__(
        self,
        devices: dict[str, HookDevice | None],
        flags: dict[str, bool],
        options: _AttachOptions,
    ) -> None:
        self.devices = devices
        self.flags = flags
        self.options = options
        # Block hooks in the order the walk meets them.
        self.blocks: list[_MarkedBlock] = []

    def attach(self, module: nn.Module, name: str) -> None:
        """Hook ``module`` (a block, the root or neither), then walk its children."""
        if name in self.devices and name in self.flags:
            if self.flags[name]:
                self._offloaded_block(module, name)
            else:
                self._kept_block(module, name)
        elif name == "":
            self._root(module)
        for child_name, child in module.named_children():
            self.attach(child, _child_name(name, child_name))

    def link_blocks(self) -> None:
        """Chain the block hooks met by :meth:`attach` in that order."""
        chain = tuple(hook for hook, _, _ in self.blocks)
        for index, (hook, name, offloading) in enumerate(self.blocks):
            hook.set_block(BlockLink(name, tuple(offloading), chain, index))

    def _kept_block(self, module: nn.Module, name: str) -> None:
        device = self.devices[name]
        options = self.options
        hook = AlignDevicesHook(
            execution_device=device,
            offload_buffers=options.offload_buffers,
            io_same_device=name == "",
            place_submodules=True,
            skip_keys=options.skip_keys,
            tied_params_map=options.tied_params_map,
        )
        add_hook_to_module(module, hook)
        # Accelerate hooks every submodule of a kept block, preload classes included.
        _attach_execution(module, device, dataclasses.replace(options, preload_module_classes=None))
        self._mark(module, name, hook)

    def _offloaded_block(self, module: nn.Module, name: str) -> None:
        device = self.devices[name]
        options = self.options
        _attach_align(module, name, device, True, options)
        if hook_of(module) is None:
            hook = AlignDevicesHook(
                execution_device=device,
                io_same_device=name == "",
                skip_keys=options.skip_keys,
                tied_params_map=options.tied_params_map,
            )
            add_hook_to_module(module, hook)
        _attach_execution(module, device, options)
        top = find_align_devices_hook(module)
        assert top is not None
        if name == "":
            top.io_same_device = True
        self._mark(module, name, top)

    def _root(self, module: nn.Module) -> None:
        hook = AlignDevicesHook(
            execution_device=self.devices.get(""),
            io_same_device=True,
            skip_keys=self.options.skip_keys,
            tied_params_map=self.options.tied_params_map,
        )
        add_hook_to_module(module, hook)

    def _mark(self, module: nn.Module, name: str, hook: AlignDevicesHook) -> None:
        offloading = [
            (submodule, found)
            for submodule in module.modules()
            if (found := offloading_hook(submodule)) is not None
        ]
        self.blocks.append((hook, name, offloading))
