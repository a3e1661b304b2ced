"""Bringing offloaded weights in and dropping them: the materialiser interface and its default.

An offloading :class:`~accel_bigmodel.hooks.AlignDevicesHook` asks its ``materializer`` (a
:class:`WeightMaterializer`) to set its module's offloaded tensors before the forward and to put
them back on ``meta`` after it. :data:`SYNCHRONOUS_MATERIALIZER` reads each tensor when the
module starts; :func:`materialize_weights` and :func:`release_weights` are its two halves, which
a prefetching materialiser reuses for what it has not loaded ahead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from accel_bigmodel.tensors import set_module_tensor_to_device

from .protocol import META_SLOTS_ATTR

if TYPE_CHECKING:
    from .align import AlignDevicesHook

__all__ = [
    "SYNCHRONOUS_MATERIALIZER",
    "SynchronousMaterializer",
    "WeightMaterializer",
    "forget_meta_slots",
    "materialize_weights",
    "release_weights",
]


@runtime_checkable
class WeightMaterializer(Protocol):
    """How an offloading :class:`AlignDevicesHook` brings its weights in and drops them again.

    Every hook has a ``materializer`` attribute (default :data:`SYNCHRONOUS_MATERIALIZER`);
    :func:`~accel_bigmodel.hooks.set_weight_materializer` installs another one on every hook of a
    model. An implementation reads what to load from the hook: ``hook.offloaded_names`` (tensor
    names relative to ``module``), ``hook.weights_map`` (name -> tensor, possibly lazy),
    ``hook.target_device`` and ``hook.tied_params_map``; it sets tensors with
    :func:`~accel_bigmodel.tensors.set_module_tensor_to_device`.

    An implementation that keeps per-model state may also define ``bind(model)`` and
    ``close()``: ``set_weight_materializer`` calls ``bind(model)`` before installing it (a
    ``bind`` that raises leaves the model unchanged), and ``close()`` is called on the
    materialiser bound to a model when another one is installed or when
    :func:`~accel_bigmodel.hooks.remove_hook_from_module` removes the model's hook. Hooks still
    pointing at a closed materialiser must keep working (loading synchronously).
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
        materialize_weights(hook, module)

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Put the offloaded tensors of ``module`` back on ``meta``."""
        release_weights(hook, module)


SYNCHRONOUS_MATERIALIZER = SynchronousMaterializer()
"""The default :class:`WeightMaterializer` of every :class:`AlignDevicesHook`."""


def materialize_weights(
    hook: AlignDevicesHook, module: nn.Module, ready: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Set every offloaded tensor of ``module``: from ``ready`` when it has it, else read it.

    ``ready`` holds values already on ``hook.target_device`` in the tensor's dtype (a
    prefetching materialiser's copies); every other name is read from ``hook.weights_map``
    exactly as :class:`SynchronousMaterializer` does, tied weights included.

    Args:
        hook: the offloading hook of ``module`` (attached, so its ``init_hook`` has run).
        module: the hooked module.
        ready: values loaded ahead, by tensor name.

    Raises:
        RuntimeError: the hook has no weights map or execution device.
        KeyError: the weights map has no entry for one of the tensors.
    """
    weights = hook.weights_map
    device = hook.target_device
    if weights is None or device is None:
        raise RuntimeError(
            f"{hook!r} offloads its weights but has no weights map or execution device; "
            "attach it with add_hook_to_module() so its init_hook runs."
        )
    if hook.tied_pointers_to_remove:
        # A previous forward raised before post_forward: forget its tied copies first.
        _forget_tied_copies(hook)
    for name in hook.offloaded_names:
        staged = ready.get(name) if ready is not None else None
        if staged is not None:
            _set(module, name, staged, device)
            continue
        value = _read(weights, name, module)
        if not _set_tied(hook, module, name, value):
            _set(module, name, value, device)


def _read(weights: Mapping[str, torch.Tensor], name: str, module: nn.Module) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise KeyError(
            f"The weights map of {type(module).__name__} has no entry for {name!r} "
            f"(prefix {getattr(weights, 'prefix', '')!r}): the offloaded weights do not "
            "match this model. Re-create the offload folder or pass the index that "
            "belongs to this checkpoint."
        ) from None


def _set(module: nn.Module, name: str, value: torch.Tensor, device: torch.device) -> None:
    if not _fast_set(module, name, value, device):
        set_module_tensor_to_device(module, name, device, value=value, clear_cache=False)


def _set_tied(hook: AlignDevicesHook, module: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Set a tied weight through the shared tied map; ``False`` when ``value`` is not tied."""
    tied = hook.tied_params_map
    device = hook.target_device
    if tied is None or device is None:
        return False
    pointer = value.data_ptr()
    if name in hook.tied_params_names and pointer not in tied:
        tied[pointer] = {}
    entry = tied.get(pointer)
    if entry is None:
        return False
    if device not in entry:
        hook.tied_pointers_to_remove.add((pointer, device))
    set_module_tensor_to_device(
        module, name, device, value=value, tied_params_map=tied, clear_cache=False
    )
    return True


def release_weights(hook: AlignDevicesHook, module: nn.Module) -> None:
    """Put the offloaded tensors of ``module`` back on ``meta`` and forget its tied copies."""
    for name in hook.offloaded_names:
        if not _fast_release(module, name):
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)
    _forget_tied_copies(hook)


def forget_meta_slots(module: nn.Module) -> None:
    """Drop the fast path's record of ``module``'s meta tensors (its hook is going away)."""
    module.__dict__.pop(META_SLOTS_ATTR, None)


def _forget_tied_copies(hook: AlignDevicesHook) -> None:
    tied = hook.tied_params_map
    if tied is not None:
        for pointer, device in hook.tied_pointers_to_remove:
            entry = tied.get(pointer)
            if entry is not None:
                entry.pop(device, None)
    hook.tied_pointers_to_remove.clear()


# The common case of an offloaded forward -- a plain nn.Parameter (or buffer) whose value has
# the model's dtype -- skips set_module_tensor_to_device's general path (name walk, device
# parsing, checks): per call it is a dict lookup and one Parameter. ``_MetaSlot`` remembers the
# meta tensor a slot held before materialising, so that releasing puts that very object back.
class _MetaSlot:
    __slots__ = ("is_buffer", "leaf", "loaded", "meta", "owner")

    def __init__(self, owner: nn.Module, leaf: str, is_buffer: bool, meta: torch.Tensor) -> None:
        self.owner = owner
        self.leaf = leaf
        self.is_buffer = is_buffer
        self.meta = meta
        self.loaded: torch.Tensor | None = None

    def table(self) -> dict[str, Any]:
        """The owner's buffers or parameters, whichever holds this slot."""
        return self.owner._buffers if self.is_buffer else self.owner._parameters


def _slot(module: nn.Module, name: str) -> _MetaSlot | None:
    slots: dict[str, _MetaSlot] = module.__dict__.setdefault(META_SLOTS_ATTR, {})
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
    if slot.table().get(slot.leaf) is not slot.meta:
        module.__dict__[META_SLOTS_ATTR].pop(name, None)  # replaced by someone else
        return False
    meta = slot.meta
    if value.dtype != meta.dtype or value.shape != meta.shape:
        return False
    if value.device != device:
        value = value.to(device)
    if not slot.is_buffer:
        value = nn.Parameter(value, requires_grad=meta.requires_grad)
    slot.table()[slot.leaf] = value
    slot.loaded = value
    return True


def _fast_release(module: nn.Module, name: str) -> bool:
    slot: _MetaSlot | None = module.__dict__.get(META_SLOTS_ATTR, {}).get(name)
    if slot is None or slot.loaded is None:
        return False
    table = slot.table()
    if table.get(slot.leaf) is not slot.loaded:
        return False
    table[slot.leaf] = slot.meta
    slot.loaded = None
    return True
