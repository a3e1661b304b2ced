""":class:`AlignDevicesHook`, the block chain of a device map, and finding a model's hooks.

An :class:`AlignDevicesHook` puts its module's weights and inputs on one execution device. An
offloading one keeps the module's tensors on ``meta`` between calls and has its
``materializer`` bring them in for each call (see :mod:`.materialize`). Hooks attached per
device-map block carry a :class:`BlockLink`: the block's name, the offloading hooks inside it
and the hook of the block that runs next, which is what a prefetching materialiser follows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accel_bigmodel.device_plan import ExecutionDevice
from accel_bigmodel.tensors import (
    DeviceLike,
    get_non_persistent_buffers,
    module_tensor,
    named_module_tensors,
    parse_device,
    set_module_tensor_to_device,
)
from accel_state.structures import device_mover, find_device, send_to_device

from .materialize import SYNCHRONOUS_MATERIALIZER, WeightMaterializer, forget_meta_slots
from .protocol import (
    BOUND_MATERIALIZER_ATTR,
    ModelHook,
    SequentialHook,
    close_materializer,
    hook_of,
)

__all__ = [
    "AlignDevicesHook",
    "BlockLink",
    "TiedParamsMap",
    "align_hooks",
    "align_module_device",
    "find_align_devices_hook",
    "get_block_hooks",
    "has_offloaded_params",
    "offloading_hook",
    "parse_execution_device",
    "set_weight_materializer",
]

TiedParamsMap = dict[int, dict[Any, torch.Tensor]]
"""``{data_ptr of a tied weight: {device: copy already made there}}``, shared by the hooks."""


def parse_execution_device(value: DeviceLike | None) -> torch.device | None:
    """Parse an ``execution_device`` argument (``None`` stays ``None``).

    Raises:
        ValueError: ``value`` is not a device, or is ``"disk"``.
    """
    if value is None:
        return None
    parsed = parse_device(value, "execution_device")
    if parsed == "disk":
        raise ValueError(
            "execution_device='disk': a forward cannot run on disk; use the device the "
            "weights should be brought to ('cpu', 0, 'cuda:1', ...) and offload to disk with "
            "a weights map."
        )
    return parsed


@dataclass(frozen=True, eq=False)
class BlockLink:
    """Where a block hook stands in its model's chain of device-map blocks.

    Attributes:
        name: the block's name in the device map (``""`` for the whole model).
        offload_hooks: ``(module, hook)`` for the offloading hooks inside the block.
        chain: the block hooks of the model, in execution order.
        index: the position of this block in ``chain``.
    """

    name: str
    offload_hooks: tuple[tuple[nn.Module, AlignDevicesHook], ...] = field(repr=False)
    chain: tuple[AlignDevicesHook, ...] = field(repr=False)
    index: int

    @property
    def next_hook(self) -> AlignDevicesHook | None:
        """The hook of the block that runs next (``None`` for the last block)."""
        following = self.index + 1
        return self.chain[following] if following < len(self.chain) else None


class AlignDevicesHook(ModelHook):
    """Put a module's weights and inputs on one execution device; optionally offload weights.

    Without ``offload`` the module's tensors are moved to ``execution_device`` once, when the
    hook is attached, and each call moves the inputs there. With ``offload`` the tensors stay on
    ``meta`` between calls and are brought in from ``weights_map`` for each call (through
    ``self.materializer``, see :class:`~accel_bigmodel.hooks.WeightMaterializer`).

    Args:
        execution_device: where the forward runs (``None``: leave weights and inputs where they
            are); an :class:`~accel_bigmodel.device_plan.ExecutionDevice` is taken as already
            parsed (the hooks of ``dispatch_model`` get theirs from its device plan).
        offload: keep the weights on ``meta`` between calls.
        io_same_device: give the output back on the device of the first input tensor.
        weights_map: name -> tensor map of this module's weights (names relative to the
            module) used when offloading; default: a CPU copy of the module's tensors made when
            the hook is attached (no copy for tensors already on the CPU).
        offload_buffers: offload the (persistent) buffers too, not only the parameters.
        place_submodules: handle the tensors of all submodules, not only the module's own.
        skip_keys: keyword-argument keys (at any nesting level) whose values are not moved.
        tied_params_map: shared map that lets tied weights be copied once per device.

    Raises:
        ValueError: ``execution_device`` is not a device (or is ``"disk"``).
    """

    def __init__(
        self,
        execution_device: DeviceLike | ExecutionDevice | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: TiedParamsMap | None = None,
    ) -> None:
        self._skip_keys = skip_keys
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.tied_params_map = tied_params_map

        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self.tied_params_names: set[str] = set()
        self.tied_pointers_to_remove: set[tuple[int, torch.device]] = set()
        self.offloaded_names: tuple[str, ...] = ()
        self.materializer: WeightMaterializer = SYNCHRONOUS_MATERIALIZER
        self._block: BlockLink | None = None

    @property
    def execution_device(self) -> DeviceLike | None:
        """The execution device as given (``target_device`` is the parsed ``torch.device``)."""
        return self._execution_device

    @execution_device.setter
    def execution_device(self, value: DeviceLike | ExecutionDevice | None) -> None:
        if isinstance(value, ExecutionDevice):
            # Parsed once where the device map or argument came in: nothing to parse again.
            self.target_device: torch.device | None = value.device
            self._execution_device: DeviceLike | None = value.given
        else:
            self.target_device = parse_execution_device(value)
            self._execution_device = value
        self._set_movers()

    @property
    def execution(self) -> ExecutionDevice | None:
        """The execution device as given and parsed (``None`` when there is none)."""
        if self.target_device is None or self._execution_device is None:
            return None
        return ExecutionDevice(self._execution_device, self.target_device)

    @property
    def skip_keys(self) -> str | list[str] | None:
        """Keyword-argument keys whose values are not moved to the execution device."""
        return self._skip_keys

    @skip_keys.setter
    def skip_keys(self, value: str | list[str] | None) -> None:
        self._skip_keys = value
        self._set_movers()

    def _set_movers(self) -> None:
        # Built once: moving a batch then costs a few attribute reads per call.
        self._move_args: Callable[[Any], Any] | None = None
        self._move_kwargs: Callable[[Any], Any] | None = None
        if self.target_device is not None:
            self._move_args = device_mover(self.target_device)
            self._move_kwargs = device_mover(self.target_device, skip_keys=self._skip_keys)

    # The movers are closures (made once for speed): a copy or an unpickled hook makes its own.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_move_args", None)
        state.pop("_move_kwargs", None)
        return state

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)
        self._set_movers()

    @property
    def block(self) -> BlockLink | None:
        """This hook's place in the block chain when it is a block hook, else ``None``."""
        return self._block

    def set_block(self, link: BlockLink | None) -> None:
        """Make this hook a block hook (``None``: an ordinary hook again)."""
        self._block = link

    @property
    def block_name(self) -> str | None:
        """The device-map name of the block this hook starts, if it is a block hook."""
        return self._block.name if self._block is not None else None

    @property
    def block_index(self) -> int | None:
        """The position of this block in execution order, if it is a block hook."""
        return self._block.index if self._block is not None else None

    @property
    def next_block_hook(self) -> AlignDevicesHook | None:
        """The block hook that runs after this one (``None`` for the last or no block)."""
        return self._block.next_hook if self._block is not None else None

    @property
    def block_offload_hooks(self) -> list[tuple[nn.Module, AlignDevicesHook]]:
        """``(module, hook)`` for the offloading hooks inside this hook's block."""
        return list(self._block.offload_hooks) if self._block is not None else []

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Move the module's tensors to the execution device, or offload them to ``meta``.

        Raises:
            ValueError: offloading without ``weights_map`` a module whose tensors are already on
                ``meta`` (there is nothing to bring back), or a tensor on ``meta`` that is not
                offloaded.
        """
        if self.target_device is not None and self.target_device.type == "meta":
            # meta tensors all have data_ptr() == 0: tied-weight bookkeeping would merge them.
            self.tied_params_map = None
        recurse = self.place_submodules
        if not self.offload:
            self._place(module, [name for name, _ in named_module_tensors(module, recurse=recurse)])
            return module
        self._offload_to_meta(module)
        if not self.offload_buffers:
            staying = [name for name, _ in module.named_buffers(recurse=recurse)]
        else:
            staying = sorted(get_non_persistent_buffers(module, recurse=recurse, fqns=recurse))
        self._place(module, staying)
        return module

    def _place(self, module: nn.Module, names: list[str]) -> None:
        """Move the named tensors of ``module`` to the execution device, if there is one."""
        if self.target_device is None:
            return
        for name in names:
            set_module_tensor_to_device(
                module,
                name,
                self.target_device,
                tied_params_map=self.tied_params_map,
                clear_cache=False,
            )

    def _offload_to_meta(self, module: nn.Module) -> None:
        """Record what ``materialize`` will bring back, then put those tensors on ``meta``."""
        recurse = self.place_submodules
        self.original_devices = {
            name: tensor.device for name, tensor in named_module_tensors(module, recurse=recurse)
        }
        if self.weights_map is None:
            self.weights_map = self._snapshot(module)
        self.offloaded_names = tuple(
            name
            for name, _ in named_module_tensors(
                module,
                include_buffers=self.offload_buffers,
                recurse=recurse,
                remove_non_persistent=True,
            )
        )
        self.tied_params_names = set()
        tied = self.tied_params_map
        for name in self.offloaded_names:
            current = module_tensor(module, name)
            if tied is not None and current.device.type != "meta" and current.data_ptr() in tied:
                # A weights map read from disk may give a new pointer at each access, so tied
                # disk weights are recognised by name and registered at forward time.
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)

    def _snapshot(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A CPU copy of the tensors to offload, the default weights map."""
        own = dict(
            named_module_tensors(
                module, include_buffers=self.offload_buffers, recurse=self.place_submodules
            )
        )
        empty = [name for name, tensor in own.items() if tensor.device.type == "meta"]
        if empty:
            raise ValueError(
                f"Cannot offload {type(module).__name__}: {empty} are on the meta device and "
                "no weights_map was given, so there is nothing to bring back at forward. "
                "Load the weights first (load_checkpoint_in_model) or pass weights_map."
            )
        return {name: tensor.to("cpu") for name, tensor in own.items()}

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Bring the weights in (when offloading) and move the inputs to the execution device."""
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self._block is not None:
            self.materializer.block_started(self, module)
        if self.offload:
            self.materializer.materialize(self, module)
        if self._move_args is None or self._move_kwargs is None:
            return args, kwargs
        return self._move_args(args), self._move_kwargs(kwargs)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Drop the weights again (when offloading); send the output to the input's device."""
        if self.offload:
            self.materializer.release(self, module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Put offloaded tensors back on the devices they had when the hook was attached."""
        forget_meta_slots(module)
        if self.offload:
            weights = self.weights_map if self.weights_map is not None else {}
            for name, device in self.original_devices.items():
                if device.type == "meta":
                    continue
                value = weights[name] if name in self.offloaded_names else None
                set_module_tensor_to_device(module, name, device, value=value, clear_cache=False)
        return module


def find_align_devices_hook(module: nn.Module) -> AlignDevicesHook | None:
    """The :class:`AlignDevicesHook` attached to ``module`` (the last one in a chain), if any."""
    hook = hook_of(module)
    if isinstance(hook, AlignDevicesHook):
        return hook
    if isinstance(hook, SequentialHook):
        for member in reversed(hook.hooks):
            if isinstance(member, AlignDevicesHook):
                return member
    return None


def align_hooks(hook: ModelHook | None) -> Iterator[AlignDevicesHook]:
    """The :class:`AlignDevicesHook` instances in ``hook`` (itself, or inside a chain)."""
    if isinstance(hook, AlignDevicesHook):
        yield hook
    elif isinstance(hook, SequentialHook):
        for member in hook.hooks:
            yield from align_hooks(member)


def offloading_hook(module: nn.Module) -> AlignDevicesHook | None:
    """The first hook of ``module`` that offloads its weights, if any."""
    for hook in align_hooks(hook_of(module)):
        if hook.offload:
            return hook
    return None


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an :class:`AlignDevicesHook` that offloads its weights."""
    return offloading_hook(module) is not None


def get_block_hooks(model: nn.Module) -> list[AlignDevicesHook]:
    """The block hooks set by ``attach_align_device_hook_on_blocks``, in execution order."""
    found = [
        (link.index, hook)
        for module in model.modules()
        for hook in align_hooks(hook_of(module))
        if (link := hook.block) is not None
    ]
    found.sort(key=lambda pair: pair[0])
    return [hook for _, hook in found]


def set_weight_materializer(model: nn.Module, materializer: WeightMaterializer) -> None:
    """Make every :class:`AlignDevicesHook` in ``model`` load its weights through ``materializer``.

    A materialiser with a ``bind(model)`` method is bound to the model first (see
    :class:`~accel_bigmodel.hooks.WeightMaterializer`); the one bound before, if any, is closed.

    Args:
        model: a model with hooks (from ``dispatch_model``, ``cpu_offload``, ...).
        materializer: the implementation; ``SYNCHRONOUS_MATERIALIZER`` restores the default.

    Raises:
        TypeError: ``materializer`` lacks ``block_started``/``materialize``/``release``.
    """
    if not isinstance(materializer, WeightMaterializer):
        raise TypeError(
            f"materializer={materializer!r} is not a WeightMaterializer: it needs "
            "block_started(hook, module), materialize(hook, module) and release(hook, module)."
        )
    bind = getattr(materializer, "bind", None)
    if callable(bind):
        bind(model)
    for module in model.modules():
        for hook in align_hooks(hook_of(module)):
            hook.materializer = materializer
    previous = model.__dict__.pop(BOUND_MATERIALIZER_ATTR, None)
    if previous is not None and previous is not materializer:
        close_materializer(previous)
    if callable(bind):
        model.__dict__[BOUND_MATERIALIZER_ATTR] = materializer


@contextlib.contextmanager
def align_module_device(
    module: nn.Module, execution_device: DeviceLike | None = None
) -> Iterator[None]:
    """Give ``module``'s own weights real values on a device for the duration of the block.

    For a module with offloaded weights, they are loaded through the hook's materialiser (on
    ``execution_device`` if given, else on the hook's execution device) and dropped again on
    exit; the hook's forward callbacks are not run (no block event, no input device recorded).
    Otherwise, with ``execution_device`` the module's direct parameters are moved there and
    back; without it nothing happens.

    Args:
        module: the module.
        execution_device: where to put the weights inside the block.
    """
    hook = offloading_hook(module)
    if hook is not None:
        original = hook.execution
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.materializer.materialize(hook, module)
            yield
        finally:
            hook.materializer.release(hook, module)
            if execution_device is not None:
                hook.execution_device = original
        return
    if execution_device is None:
        yield
        return
    devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
    try:
        for name in devices:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device)
