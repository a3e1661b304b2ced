"""Module hooks: code that runs around a module's ``forward`` and moves weights where it runs.

This module owns the hook protocol (:class:`ModelHook`, :func:`add_hook_to_module`,
:func:`remove_hook_from_module`), the hook that aligns a module's weights and inputs with its
execution device (:class:`AlignDevicesHook`, attached per module or per device-map block), the
whole-model CPU offload hook (:class:`CpuOffload`) and the weight materialisation interface
(:class:`WeightMaterializer`).

How offloaded weights reach the execution device
------------------------------------------------
An offloading :class:`AlignDevicesHook` keeps its module's tensors on the ``meta`` device between
calls. Its ``pre_forward`` asks ``hook.materializer.materialize(hook, module)`` to put every
tensor named in ``hook.offloaded_names`` on ``hook.target_device`` (reading ``hook.weights_map``),
and its ``post_forward`` calls ``hook.materializer.release(hook, module)`` to drop them again.
The default, :data:`SYNCHRONOUS_MATERIALIZER`, reads each tensor when the module starts; on CPU
execution a weight that the weights map returns as a CPU tensor of the right dtype (for example a
view of a memory-mapped safetensors file) becomes the parameter as it is, without a copy.

:func:`attach_align_device_hook_on_blocks` marks one hook per device-map entry as that block's
*block hook* (``hook.block_name``, ``hook.block_index``); block hooks are chained in execution
order through ``hook.next_block_hook`` and list the offloading hooks inside their block in
``hook.block_offload_hooks``. A block hook calls ``materializer.block_started(hook, module)``
when its block starts, before anything of the block is materialised, so a prefetching
materialiser (installed with :func:`set_weight_materializer`) can start loading block k+1 while
block k runs. :func:`get_block_hooks` lists a model's block hooks in order. The offload engine,
:class:`~accel_bigmodel.prefetch.PrefetchingMaterializer`, is that materialiser; the dispatch
functions install it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from accel_state.devices import default_device_type
from accel_state.structures import device_mover, find_device, send_to_device

from .offload import PrefixedDataset
from .tensors import (
    DeviceLike,
    clear_device_cache,
    get_non_persistent_buffers,
    module_tensor,
    named_module_tensors,
    parse_device,
    same_device,
    set_module_tensor_to_device,
)

__all__ = [
    "SYNCHRONOUS_MATERIALIZER",
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "SynchronousMaterializer",
    "TiedParamsMap",
    "UserCpuOffloadHook",
    "WeightMaterializer",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "find_align_devices_hook",
    "get_block_hooks",
    "has_offloaded_params",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "set_weight_materializer",
]

logger = logging.getLogger(__name__)

TiedParamsMap = dict[int, dict[Any, torch.Tensor]]
"""``{data_ptr of a tied weight: {device: copy already made there}}``, shared by the hooks."""

# Attributes that dispatch_model sets on a model instance (guards around moving it); removing
# the hooks removes them too.
GUARDED_METHODS = ("to", "cuda", "cpu", "xpu", "npu", "mlu", "musa", "sdaa")
# The materialiser bound to a model by set_weight_materializer (closed when replaced or removed).
_BOUND_MATERIALIZER = "_accel_bound_materializer"


class ModelHook:
    """Callbacks run just before and after a module's ``forward``, with its args and kwargs.

    Subclass it and attach an instance with :func:`add_hook_to_module`. Unlike PyTorch's forward
    hooks, ``pre_forward`` receives (and may replace) the keyword arguments too, and the hook
    can replace the module when attached.

    Attributes:
        no_grad: run the module's original ``forward`` under ``torch.no_grad()``.
    """

    no_grad: bool = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is attached; returns the module to use (usually ``module``)."""
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run before ``forward``; returns the ``(args, kwargs)`` that ``forward`` receives."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Run after ``forward``; returns the output given back to the caller."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is removed; undoes what ``init_hook`` did where that matters."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order at each event (``post_forward`` in the same order too).

    ``no_grad`` is true when any of the hooks asks for it.

    Args:
        *hooks: the hooks, first to run first.
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks
        self.no_grad = any(hook.no_grad for hook in hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Run every hook's ``init_hook``, each on the module the previous one returned."""
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Thread ``(args, kwargs)`` through every hook's ``pre_forward``."""
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Thread the output through every hook's ``post_forward``."""
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Run every hook's ``detach_hook``."""
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def __repr__(self) -> str:
        return f"SequentialHook({', '.join(repr(hook) for hook in self.hooks)})"


def _is_graph_module(module: nn.Module) -> bool:
    # torch.fx gives each GraphModule its own class; its forward must be patched on that class
    # (an instance attribute would freeze the graph's code).
    return "GraphModuleImpl" in str(type(module))


def _hook_of(module: nn.Module) -> ModelHook | None:
    """The hook attached to ``module`` (kept in its ``__dict__`` as ``_hf_hook``), if any."""
    hook: ModelHook | None = module.__dict__.get("_hf_hook")
    return hook


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    attributes = module.__dict__
    hook: ModelHook = attributes["_hf_hook"]
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = attributes["_old_forward"](*args, **kwargs)
    else:
        output = attributes["_old_forward"](*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its ``forward`` now runs the hook's callbacks around it.

    The original ``forward`` is kept in ``module._old_forward`` (across any number of
    re-hookings) and the hook in ``module._hf_hook``; ``forward`` is replaced on the instance
    only, so other instances of the class are unaffected. :func:`remove_hook_from_module`
    restores the original.

    Args:
        module: the module to hook.
        hook: the hook; its ``init_hook`` runs now.
        append: chain ``hook`` after the module's current hook (as a :class:`SequentialHook`)
            instead of replacing it.

    Returns:
        The module returned by ``hook.init_hook`` (the same module unless the hook replaced it).
    """
    previous = _hook_of(module)
    if append and previous is not None:
        _detach(module, remove_guards=False)
        hook = SequentialHook(previous, hook)

    original: Callable[..., Any]
    if _hook_of(module) is not None and "_old_forward" in module.__dict__:
        original = module.__dict__["_old_forward"]
    else:
        original = module.forward
        module.__dict__["_old_forward"] = original

    module = hook.init_hook(module)
    module.__dict__["_hf_hook"] = hook
    module.__dict__["_old_forward"] = original

    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if _is_graph_module(module):
        type(module).forward = forward
    else:
        module.__dict__["forward"] = forward
    return module


def _detach(module: nn.Module, remove_guards: bool) -> None:
    hook = _hook_of(module)
    if hook is not None:
        hook.detach_hook(module)
    module.__dict__.pop("_hf_hook", None)
    original = module.__dict__.pop("_old_forward", None)
    if original is not None:
        bound_here = getattr(original, "__self__", None) is module
        func = getattr(original, "__func__", None)
        if _is_graph_module(module):
            restored = func if bound_here and func is not None else original
            type(module).forward = restored
        elif bound_here and func is getattr(type(module), "forward", None):
            # The original was the class's own forward: drop the instance attribute so the
            # module is exactly as it was before hooking.
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = original
    if remove_guards:
        for name in GUARDED_METHODS:
            module.__dict__.pop(name, None)
        bound = module.__dict__.pop(_BOUND_MATERIALIZER, None)
        if bound is not None:
            _close_materializer(bound)


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (running its ``detach_hook``) and restore its ``forward``.

    Also removes the guards that :func:`~accel_bigmodel.dispatch.dispatch_model` puts on
    ``model.to`` / ``model.cuda``, and closes the weight materialiser bound to ``module`` by
    :func:`set_weight_materializer` (its background work stops).

    Args:
        module: the hooked module (a module without hook is returned unchanged).
        recurse: do the same for every submodule.

    Returns:
        The same module.
    """
    _detach(module, remove_guards=True)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and of all its submodules."""
    remove_hook_from_module(module, recurse=True)


@runtime_checkable
class WeightMaterializer(Protocol):
    """How an offloading :class:`AlignDevicesHook` brings its weights in and drops them again.

    Every hook has a ``materializer`` attribute (default :data:`SYNCHRONOUS_MATERIALIZER`);
    :func:`set_weight_materializer` installs another one on every hook of a model. An
    implementation reads what to load from the hook: ``hook.offloaded_names`` (tensor names
    relative to ``module``), ``hook.weights_map`` (name -> tensor, possibly lazy),
    ``hook.target_device`` and ``hook.tied_params_map``; it sets tensors with
    :func:`~accel_bigmodel.tensors.set_module_tensor_to_device`.

    An implementation that keeps per-model state may also define ``bind(model)`` and
    ``close()``: :func:`set_weight_materializer` calls ``bind(model)`` before installing it
    (a ``bind`` that raises leaves the model unchanged), and ``close()`` is called on the
    materialiser bound to a model when another one is installed or when
    :func:`remove_hook_from_module` removes the model's hook. Hooks still pointing at a closed
    materialiser must keep working (loading synchronously).
    """

    def block_started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Called by a block hook when its block's forward starts, before ``materialize``.

        ``hook.next_block_hook`` is the block that runs next (``None`` for the last block) and
        ``hook.block_offload_hooks`` lists ``(module, hook)`` for the offloading hooks inside a
        block, so this is where a prefetching implementation starts loading ahead.
        """

    def materialize(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Put the tensors in ``hook.offloaded_names`` on ``hook.target_device``."""

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Drop what ``materialize`` loaded (back to ``meta``) after ``module``'s forward."""


class SynchronousMaterializer:
    """Load each offloaded weight when its module starts and drop it when the module ends.

    This is Accelerate's behaviour: ``materialize`` reads every tensor from the hook's weights
    map and sets it on the execution device (re-using a tied copy already there), ``release``
    puts them back on ``meta`` and forgets the tied copies made by this call. It keeps no state
    of its own, so one instance serves every hook.
    """

    def block_started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Nothing to do when a block starts: each module loads its own weights."""

    def materialize(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Set every offloaded tensor of ``module`` from ``hook.weights_map``.

        Raises:
            KeyError: the weights map has no entry for one of the tensors.
        """
        _materialize_weights(hook, module)

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Put the offloaded tensors of ``module`` back on ``meta``."""
        _release_weights(hook, module)


def _materialize_weights(
    hook: AlignDevicesHook, module: nn.Module, ready: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Set every offloaded tensor of ``module``: from ``ready`` when it has it, else read it.

    ``ready`` holds values already on ``hook.target_device`` in the tensor's dtype (a
    prefetching materialiser's copies); every other name is read from ``hook.weights_map``
    exactly as :class:`SynchronousMaterializer` does, tied weights included.
    """
    weights = hook.weights_map
    device = hook.target_device
    if weights is None or device is None:
        raise RuntimeError(
            f"{hook!r} offloads its weights but has no weights map or execution device; "
            "attach it with add_hook_to_module() so its init_hook runs."
        )
    tied = hook.tied_params_map
    if hook.tied_pointers_to_remove:
        # A previous forward raised before post_forward: forget its tied copies first.
        _forget_tied_copies(hook)
    for name in hook.offloaded_names:
        if ready is not None:
            staged = ready.get(name)
            if staged is not None:
                if not _fast_set(module, name, staged, device):
                    set_module_tensor_to_device(
                        module, name, device, value=staged, clear_cache=False
                    )
                continue
        try:
            value = weights[name]
        except KeyError:
            raise KeyError(
                f"The weights map of {type(module).__name__} has no entry for {name!r} "
                f"(prefix {getattr(weights, 'prefix', '')!r}): the offloaded weights do not "
                "match this model. Re-create the offload folder or pass the index that "
                "belongs to this checkpoint."
            ) from None
        if tied is not None:
            pointer = value.data_ptr()
            if name in hook.tied_params_names and pointer not in tied:
                tied[pointer] = {}
            entry = tied.get(pointer)
            if entry is not None and device not in entry:
                hook.tied_pointers_to_remove.add((pointer, device))
            if entry is not None:
                set_module_tensor_to_device(
                    module, name, device, value=value, tied_params_map=tied, clear_cache=False
                )
                continue
        if not _fast_set(module, name, value, device):
            set_module_tensor_to_device(module, name, device, value=value, clear_cache=False)


def _release_weights(hook: AlignDevicesHook, module: nn.Module) -> None:
    """Put the offloaded tensors of ``module`` back on ``meta`` and forget its tied copies."""
    for name in hook.offloaded_names:
        if not _fast_release(module, name):
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)
    _forget_tied_copies(hook)


# The common case of an offloaded forward -- a plain nn.Parameter (or buffer) whose value has
# the model's dtype -- skips set_module_tensor_to_device's general path (name walk, device
# parsing, checks): per call it is a dict lookup and one Parameter. ``_MetaSlot`` remembers the
# meta tensor a slot held before materialising, so that releasing puts that very object back.
class _MetaSlot:
    __slots__ = ("owner", "leaf", "is_buffer", "meta", "loaded")

    def __init__(self, owner: nn.Module, leaf: str, is_buffer: bool, meta: torch.Tensor) -> None:
        self.owner = owner
        self.leaf = leaf
        self.is_buffer = is_buffer
        self.meta = meta
        self.loaded: torch.Tensor | None = None


def _slot(module: nn.Module, name: str) -> _MetaSlot | None:
    slots: dict[str, _MetaSlot] = module.__dict__.setdefault("_accel_meta_slots", {})
    slot = slots.get(name)
    if slot is not None:
        return slot
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    is_buffer = leaf in owner._buffers
    current = owner._buffers.get(leaf) if is_buffer else owner._parameters.get(leaf)
    if current is None or current.device.type != "meta":
        return None
    if not is_buffer and (type(current) is not nn.Parameter or current.__dict__):
        return None  # a Parameter subclass or one with attributes: the general path keeps them
    slot = _MetaSlot(owner, leaf, is_buffer, current)
    slots[name] = slot
    return slot


def _fast_set(module: nn.Module, name: str, value: torch.Tensor, device: torch.device) -> bool:
    """Set an offloaded tensor from ``value`` directly; ``False`` when the general path must."""
    slot = _slot(module, name)
    if slot is None:
        return False
    table = slot.owner._buffers if slot.is_buffer else slot.owner._parameters
    if table.get(slot.leaf) is not slot.meta:
        module.__dict__["_accel_meta_slots"].pop(name, None)  # replaced by someone else
        return False
    meta = slot.meta
    if value.dtype != meta.dtype or value.shape != meta.shape:
        return False
    if value.device != device:
        value = value.to(device)
    if slot.is_buffer:
        slot.owner._buffers[slot.leaf] = value
        slot.loaded = value
    else:
        param = nn.Parameter(value, requires_grad=meta.requires_grad)
        slot.owner._parameters[slot.leaf] = param
        slot.loaded = param
    return True


def _fast_release(module: nn.Module, name: str) -> bool:
    slot = module.__dict__.get("_accel_meta_slots", {}).get(name)
    if slot is None or slot.loaded is None:
        return False
    if slot.is_buffer:
        if slot.owner._buffers.get(slot.leaf) is not slot.loaded:
            return False
        slot.owner._buffers[slot.leaf] = slot.meta
    else:
        if slot.owner._parameters.get(slot.leaf) is not slot.loaded:
            return False
        slot.owner._parameters[slot.leaf] = slot.meta
    slot.loaded = None
    return True


def _forget_tied_copies(hook: AlignDevicesHook) -> None:
    tied = hook.tied_params_map
    if tied is not None:
        for pointer, device in hook.tied_pointers_to_remove:
            entry = tied.get(pointer)
            if entry is not None:
                entry.pop(device, None)
    hook.tied_pointers_to_remove.clear()


SYNCHRONOUS_MATERIALIZER = SynchronousMaterializer()
"""The default :class:`WeightMaterializer` of every :class:`AlignDevicesHook`."""


def _parse_execution_device(value: DeviceLike | None) -> torch.device | None:
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


class AlignDevicesHook(ModelHook):
    """Put a module's weights and inputs on one execution device; optionally offload weights.

    Without ``offload`` the module's tensors are moved to ``execution_device`` once, when the
    hook is attached, and each call moves the inputs there. With ``offload`` the tensors stay on
    ``meta`` between calls and are brought in from ``weights_map`` for each call (through
    ``self.materializer``, see :class:`WeightMaterializer`).

    Args:
        execution_device: where the forward runs (``None``: leave weights and inputs where they
            are).
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
        execution_device: DeviceLike | None = None,
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
        self.block_name: str | None = None
        self.block_index: int | None = None
        self.next_block_hook: AlignDevicesHook | None = None
        self.block_offload_hooks: list[tuple[nn.Module, AlignDevicesHook]] = []

    @property
    def execution_device(self) -> DeviceLike | None:
        """The execution device as given (``target_device`` is the parsed ``torch.device``)."""
        return self._execution_device

    @execution_device.setter
    def execution_device(self, value: DeviceLike | None) -> None:
        self.target_device = _parse_execution_device(value)
        self._execution_device = value
        self._set_movers()

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
            if self.target_device is not None:
                for name, _ in list(named_module_tensors(module, recurse=recurse)):
                    set_module_tensor_to_device(
                        module,
                        name,
                        self.target_device,
                        tied_params_map=self.tied_params_map,
                        clear_cache=False,
                    )
            return module

        self.original_devices = {
            name: tensor.device for name, tensor in named_module_tensors(module, recurse=recurse)
        }
        if self.weights_map is None:
            own = dict(
                named_module_tensors(module, include_buffers=self.offload_buffers, recurse=recurse)
            )
            empty = [name for name, tensor in own.items() if tensor.device.type == "meta"]
            if empty:
                raise ValueError(
                    f"Cannot offload {type(module).__name__}: {empty} are on the meta device and "
                    "no weights_map was given, so there is nothing to bring back at forward. "
                    "Load the weights first (load_checkpoint_in_model) or pass weights_map."
                )
            self.weights_map = {name: tensor.to("cpu") for name, tensor in own.items()}
        names = [
            name
            for name, _ in named_module_tensors(
                module,
                include_buffers=self.offload_buffers,
                recurse=recurse,
                remove_non_persistent=True,
            )
        ]
        self.offloaded_names = tuple(names)
        self.tied_params_names = set()
        for name in names:
            current = module_tensor(module, name)
            if (
                self.tied_params_map is not None
                and current.device.type != "meta"
                and current.data_ptr() in self.tied_params_map
            ):
                # A weights map read from disk may give a new pointer at each access, so tied
                # disk weights are recognised by name and registered at forward time.
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)

        if self.target_device is not None:
            if not self.offload_buffers:
                staying = [name for name, _ in module.named_buffers(recurse=recurse)]
            else:
                staying = sorted(get_non_persistent_buffers(module, recurse=recurse, fqns=recurse))
            for name in staying:
                set_module_tensor_to_device(
                    module,
                    name,
                    self.target_device,
                    tied_params_map=self.tied_params_map,
                    clear_cache=False,
                )
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Bring the weights in (when offloading) and move the inputs to the execution device."""
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.block_name is not None:
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
        module.__dict__.pop("_accel_meta_slots", None)
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
    hook = _hook_of(module)
    if isinstance(hook, AlignDevicesHook):
        return hook
    if isinstance(hook, SequentialHook):
        for member in reversed(hook.hooks):
            if isinstance(member, AlignDevicesHook):
                return member
    return None


def _align_hooks(hook: ModelHook | None) -> Iterator[AlignDevicesHook]:
    if isinstance(hook, AlignDevicesHook):
        yield hook
    elif isinstance(hook, SequentialHook):
        for member in hook.hooks:
            yield from _align_hooks(member)


def _offloading_hook(module: nn.Module) -> AlignDevicesHook | None:
    for hook in _align_hooks(_hook_of(module)):
        if hook.offload:
            return hook
    return None


def set_weight_materializer(model: nn.Module, materializer: WeightMaterializer) -> None:
    """Make every :class:`AlignDevicesHook` in ``model`` load its weights through ``materializer``.

    A materialiser with a ``bind(model)`` method is bound to the model first (see
    :class:`WeightMaterializer`); the one bound before, if any, is closed.

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
        for hook in _align_hooks(_hook_of(module)):
            hook.materializer = materializer
    previous = model.__dict__.pop(_BOUND_MATERIALIZER, None)
    if previous is not None and previous is not materializer:
        _close_materializer(previous)
    if callable(bind):
        model.__dict__[_BOUND_MATERIALIZER] = materializer


def _close_materializer(materializer: object) -> None:
    close = getattr(materializer, "close", None)
    if callable(close):
        close()


def get_block_hooks(model: nn.Module) -> list[AlignDevicesHook]:
    """The block hooks set by :func:`attach_align_device_hook_on_blocks`, in execution order."""
    found = [
        hook
        for module in model.modules()
        for hook in _align_hooks(_hook_of(module))
        if hook.block_index is not None
    ]
    return sorted(found, key=lambda hook: hook.block_index if hook.block_index is not None else 0)


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
    execution_device: DeviceLike | None,
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
    if _hook_of(module) is None and _has_state(module):
        add_hook_to_module(
            module,
            AlignDevicesHook(
                execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map
            ),
        )
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(
            child,
            execution_device,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def attach_align_device_hook(
    module: nn.Module,
    execution_device: DeviceLike | None = None,
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
    has_direct = next(iter(named_module_tensors(module)), None) is not None
    full_offload = (
        offload
        and preload_module_classes is not None
        and type(module).__name__ in preload_module_classes
    )
    if has_direct or full_offload:
        prefixed: Mapping[str, torch.Tensor] | None = None
        if weights_map is not None:
            prefixed = (
                PrefixedDataset(weights_map, f"{module_name}.") if module_name else weights_map
            )
        add_hook_to_module(
            module,
            AlignDevicesHook(
                execution_device=execution_device,
                offload=offload,
                weights_map=prefixed,
                offload_buffers=offload_buffers,
                place_submodules=full_offload,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
            ),
            append=True,
        )
    if full_offload:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: DeviceLike | Mapping[str, DeviceLike] | None = None,
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
    order (see the module docstring).

    Args:
        module: the model.
        execution_device: one device, or ``{module name: device}``.
        offload: one flag, or ``{module name: whether that block is offloaded}``.
        weights_map: name -> tensor map for the offloaded weights (names relative to ``module``).
        offload_buffers: offload buffers too.
        module_name: the dotted name of ``module`` (``""`` for the model).
        skip_keys: keyword-argument keys whose values are not moved.
        preload_module_classes: class names whose instances load all their weights at once.
        tied_params_map: shared tied-weight map (see :class:`AlignDevicesHook`).
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if not offload:
            add_hook_to_module(
                module,
                AlignDevicesHook(
                    execution_device=execution_device,
                    io_same_device=True,
                    skip_keys=skip_keys,
                    place_submodules=True,
                    tied_params_map=tied_params_map,
                ),
            )
        else:
            attach_align_device_hook(
                module,
                execution_device=execution_device,
                offload=True,
                weights_map=weights_map,
                offload_buffers=offload_buffers,
                module_name=module_name,
                skip_keys=skip_keys,
                preload_module_classes=preload_module_classes,
                tied_params_map=tied_params_map,
            )
        return

    if isinstance(execution_device, Mapping):
        devices: dict[str, DeviceLike | None] = dict(execution_device)
    else:
        assert isinstance(offload, Mapping)
        devices = dict.fromkeys(offload, execution_device)
    flags: dict[str, bool] = (
        dict(offload) if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    )
    blocks: list[AlignDevicesHook] = []
    _attach_on_blocks(
        module,
        devices,
        flags,
        weights_map,
        offload_buffers,
        module_name,
        skip_keys,
        preload_module_classes,
        tied_params_map,
        blocks,
    )
    for index, hook in enumerate(blocks):
        hook.block_index = index
        hook.next_block_hook = blocks[index + 1] if index + 1 < len(blocks) else None


def _attach_on_blocks(
    module: nn.Module,
    devices: dict[str, DeviceLike | None],
    flags: dict[str, bool],
    weights_map: Mapping[str, torch.Tensor] | None,
    offload_buffers: bool,
    module_name: str,
    skip_keys: str | list[str] | None,
    preload_module_classes: list[str] | None,
    tied_params_map: TiedParamsMap | None,
    blocks: list[AlignDevicesHook],
) -> None:
    is_block = module_name in devices and module_name in flags
    if is_block and not flags[module_name]:
        hook = AlignDevicesHook(
            execution_device=devices[module_name],
            offload_buffers=offload_buffers,
            io_same_device=module_name == "",
            place_submodules=True,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook)
        attach_execution_device_hook(
            module, devices[module_name], skip_keys=skip_keys, tied_params_map=tied_params_map
        )
        _mark_block(module, module_name, hook, blocks)
    elif is_block:
        attach_align_device_hook(
            module,
            execution_device=devices[module_name],
            offload=True,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=module_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )
        if _hook_of(module) is None:
            add_hook_to_module(
                module,
                AlignDevicesHook(
                    execution_device=devices[module_name],
                    io_same_device=module_name == "",
                    skip_keys=skip_keys,
                    tied_params_map=tied_params_map,
                ),
            )
        attach_execution_device_hook(
            module,
            devices[module_name],
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )
        top = find_align_devices_hook(module)
        assert top is not None
        if module_name == "":
            top.io_same_device = True
        _mark_block(module, module_name, top, blocks)
    elif module_name == "":
        add_hook_to_module(
            module,
            AlignDevicesHook(
                execution_device=devices.get(""),
                io_same_device=True,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
            ),
        )
    for child_name, child in module.named_children():
        _attach_on_blocks(
            child,
            devices,
            flags,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
            blocks,
        )


def _mark_block(
    module: nn.Module, name: str, hook: AlignDevicesHook, blocks: list[AlignDevicesHook]
) -> None:
    hook.block_name = name
    hook.block_offload_hooks = [
        (submodule, offloading)
        for submodule in module.modules()
        if (offloading := _offloading_hook(submodule)) is not None
    ]
    blocks.append(hook)


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
        parsed = _parse_execution_device(execution_device)
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


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an :class:`AlignDevicesHook` that offloads its weights."""
    return _offloading_hook(module) is not None


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
    hook = _offloading_hook(module)
    if hook is not None:
        original = hook.execution_device
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
