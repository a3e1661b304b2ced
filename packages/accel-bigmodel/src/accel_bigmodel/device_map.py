"""Device maps: planning where each part of a model goes, checking and simplifying a map.

A device map is an ordered ``{module or tensor name: device}`` dict; a name covers everything
under it and ``""`` is the whole model. :func:`infer_auto_device_map` plans one greedily under a
memory budget: accelerators in index order, then the CPU, then disk, keeping on the first
accelerator and the CPU room for the largest layer still to place (an offloaded layer is brought
there to run), never separating tied parameters, and splitting a module into its children only
when it does not fit and its class may be split. For the same inputs the plan is the one
Accelerate 1.15 makes (``docs/compat.md`` lists the cases where Accelerate fails or drops a
tensor and this module does not). :func:`check_device_map` verifies that a map covers every
tensor and names real devices; :func:`clean_device_map` merges siblings placed on one device.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from .memory import MaxMemory, _normalise_no_split, get_max_memory
from .sizes import (
    DtypeLike,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    get_max_layer_size,
    get_module_size_with_ties,
)
from .tensors import check_tied_parameters_in_config, find_tied_parameters, parse_device

__all__ = [
    "DeviceMap",
    "check_device_map",
    "clean_device_map",
    "fallback_allocate",
    "get_module_leaves",
    "infer_auto_device_map",
]

logger = logging.getLogger(__name__)

DeviceMap = dict[str, int | str | torch.device]
"""``{module or tensor name: device}``; ``""`` names the whole model."""

Entry = tuple[str, Any]
"""A ``(dotted name, module or tensor)`` pair still to be placed."""


def _inside(tensor_name: str, name: str) -> bool:
    """Whether ``tensor_name`` is ``name`` itself or lies under the module ``name``."""
    return tensor_name == name or tensor_name.startswith(name + ".")


def _direct_entries(module: nn.Module, prefix: str = "") -> list[Entry]:
    """A module's own parameters, then its children, then its own buffers, with dotted names."""
    entries: list[Entry] = [
        *module.named_parameters(recurse=False),
        *module.named_children(),
        *module.named_buffers(recurse=False),
    ]
    if not prefix:
        return entries
    return [(f"{prefix}.{name}", item) for name, item in entries]


def _modules_only(entries: Sequence[Entry]) -> list[Entry]:
    return [(name, item) for name, item in entries if isinstance(item, nn.Module)]


def _splittable(item: Any, no_split: Sequence[str]) -> bool:
    """Whether an entry can be replaced by its parts: a module with children, not in no_split."""
    if not isinstance(item, nn.Module):
        return False
    return bool(list(item.named_children())) and type(item).__name__ not in no_split


def _ties_outside(name: str, tied_parameters: Sequence[Sequence[str]]) -> list[str]:
    """Parameters outside ``name`` tied to a parameter inside it."""
    outside: list[str] = []
    for group in tied_parameters:
        inner = [_inside(member, name) for member in group]
        if any(inner) and not all(inner):
            outside.extend(member for member, is_in in zip(group, inner, strict=True) if not is_in)
    return outside


def _all_held(tied_params: Sequence[str], entries: Sequence[Entry]) -> bool:
    """Whether every tied parameter is, or lies inside, one of ``entries``."""
    return all(any(_inside(param, name) for name, _ in entries) for param in tied_params)


def _fallback_candidate(
    entries: list[Entry],
    module_sizes: Mapping[str, Any],
    size_limit: int | float,
    no_split: Sequence[str],
    tied_parameters: Sequence[Sequence[str]],
) -> tuple[str, Any, list[Entry]] | None:
    """The first module or tensor (depth first, splitting where allowed) that fits ``size_limit``.

    Its tied partners count toward its size; a candidate whose partner is not among
    ``entries`` (it is the module that just failed to fit) is not taken. Returns the candidate
    and ``entries`` with the candidate removed and its ancestors replaced by their parts, or
    ``None`` when nothing fits.
    """
    if size_limit < 0:
        return None
    pending = list(entries)
    chosen: Entry | None = None
    while pending:
        name, item = pending.pop(0)
        tied = _ties_outside(name, tied_parameters)
        if _all_held(tied, pending):
            size, _, _ = get_module_size_with_ties(
                tied, module_sizes.get(name, 0), module_sizes, pending
            )
            if size <= size_limit:
                chosen = (name, item)
                break
        if _splittable(item, no_split):
            pending = _direct_entries(item, name) + pending
    if chosen is None:
        return None

    name = chosen[0]
    remaining = list(entries)
    for position, character in enumerate(name):
        if character != ".":
            continue
        ancestor = name[:position]
        names = [entry_name for entry_name, _ in remaining]
        if ancestor in names:
            at = names.index(ancestor)
            remaining[at : at + 1] = _direct_entries(remaining[at][1], ancestor)
    at = [entry_name for entry_name, _ in remaining].index(name)
    found = remaining.pop(at)
    return found[0], found[1], remaining


def infer_auto_device_map(
    model: nn.Module,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: Sequence[str] | str | None = None,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict[str, int | str]:
    """Plan which device each part of ``model`` goes to under a memory budget.

    Devices are filled in order: accelerators by index, ``"mps"``, ``"cpu"``, then ``"disk"``
    (always available, unbounded). On the first accelerator and on the CPU (on ``"mps"``
    alone when it is used) room is kept for the largest layer still to place, because an
    offloaded layer is brought there to run. Entries are the model's own parameters, its
    children and its own buffers, in that order; an entry that does not fit is replaced by its
    parts when it has children and its class is not in ``no_split_module_classes``, otherwise
    the planner moves on to the next device. Tied parameters are always placed together (the
    modules holding them count toward one size). Only shapes and dtypes are read, so the
    model may be on the meta device.

    Args:
        model: the model to place.
        max_memory: the budget (see :func:`~accel_bigmodel.memory.get_max_memory`); the free
            memory of this machine when ``None``. Whatever fits nowhere goes to ``"disk"``
            even when ``"disk"`` is not a key (a warning says so; loading then needs an
            offload folder).
        no_split_module_classes: class names of modules that must stay on one device (for
            instance blocks with a residual connection).
        dtype: the dtype the weights will be loaded in (float tensors count at this size).
        special_dtypes: dtypes of particular tensors, by full name (win over ``dtype``).
        verbose: print each placement decision.
        clean_result: merge siblings placed on one device into their parent.
        offload_buffers: whether buffers of CPU/disk-placed modules will be offloaded too
            (otherwise a warning is given when they seem not to fit any GPU).
        fallback_allocation: when nothing has been placed on a device and the next entry does
            not fit, look for a smaller module further on that fits instead of leaving the
            device empty.

    Returns:
        An ``OrderedDict`` from names to devices (``int`` indexes, ``"mps"``, ``"cpu"``,
        ``"disk"``).

    Raises:
        ValueError, TypeError: a bad ``max_memory``, ``dtype`` or ``special_dtypes``.
    """
    budget = get_max_memory(max_memory)
    no_split = _normalise_no_split(no_split_module_classes)
    devices: list[int | str] = list(budget)
    if "disk" not in devices:
        devices.append("disk")
    accelerators = [device for device in devices if device not in ("cpu", "disk")]
    if "mps" in accelerators:
        main_devices: list[int | str] = ["mps"]
    elif accelerators:
        main_devices = [accelerators[0], "cpu"]
    else:
        main_devices = ["cpu"]

    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied_parameters = find_tied_parameters(model)
    if not tied_parameters and check_tied_parameters_in_config(model):
        logger.warning(
            "The model's configuration says some weights are tied but none are: call "
            "model.tie_weights() before infer_auto_device_map so tied weights are placed together."
        )

    queue = _direct_entries(model)
    device_map: OrderedDict[str, int | str] = OrderedDict()
    current = 0
    used: dict[int | str, Any] = dict.fromkeys(devices, 0)
    buffer_sizes: dict[int | str, Any] = {}
    minimum_needed: dict[int | str, Any] = {}
    largest_layer, largest_names = get_max_layer_size(queue, sizes, no_split)

    while queue:
        name, item = queue.pop(0)
        if verbose:
            print(f"\nTreating {name}.")
        # The largest layer left may have changed now that this entry is taken.
        largest_names = [n for n in largest_names if not _inside(n, name)]
        if not largest_names:
            largest_layer, largest_names = get_max_layer_size(_modules_only(queue), sizes, no_split)
        size = sizes.get(name, 0)
        tied = _ties_outside(name, tied_parameters)
        if verbose and tied:
            print(f"  Tied to parameters outside it: {tied}")

        device = devices[current]
        limit: Any = None if device == "disk" else budget[device]
        reserved: Any = 0
        if device in main_devices:
            limit -= largest_layer
            reserved = largest_layer
        size_with_ties, tied_names, tied_holders = get_module_size_with_ties(
            tied, size, sizes, queue
        )

        if limit is None or used[device] + size_with_ties <= limit:
            if verbose:
                together = f" with {tied_names}" if tied_names else ""
                room = "" if limit is None else f", room left {limit - used[device]}"
                print(f"  Placing {name}{together} on {device!r} (size {size_with_ties}{room}).")
            used[device] += size_with_ties
            device_map[name] = device
            for holder_name in tied_names:
                at = next((i for i, (n, _) in enumerate(queue) if n == holder_name), None)
                if at is not None:
                    queue.pop(at)
                device_map[holder_name] = device
            if not offload_buffers and isinstance(item, nn.Module):
                buffer_sizes[device] = buffer_sizes.get(device, 0) + (
                    compute_module_total_buffer_size(
                        item, dtype=dtype, special_dtypes=special_dtypes
                    )
                )
            continue

        if tied and used[device] + size <= limit:
            # The entry fits alone: try to make a tied holder smaller by splitting it.
            if verbose:
                print(
                    f"  {name} with {tied_names} needs {size_with_ties} but {device!r} has "
                    f"{limit - used[device]} left."
                )
            split_done = False
            for holder_name, holder in zip(tied_names, tied_holders, strict=True):
                if not _splittable(holder, no_split):
                    continue
                if verbose:
                    print(f"  Splitting the tied module {holder_name}.")
                at = next(i for i, (n, _) in enumerate(queue) if n == holder_name)
                queue = (
                    [(name, item)]
                    + queue[:at]
                    + _direct_entries(holder, holder_name)
                    + queue[at + 1 :]
                )
                largest_layer, largest_names = get_max_layer_size(
                    _modules_only(queue), sizes, no_split
                )
                split_done = True
                break
            if split_done:
                continue
            if verbose:
                print("  No tied module can be split; moving to the next device.")

        if used[device] + size >= limit:
            if verbose:
                print(
                    f"  {name} (size {size}) does not fit on {device!r} "
                    f"({limit - used[device]} left)."
                )
            if _splittable(item, no_split):
                if verbose:
                    print(f"  Splitting {name}.")
                queue = _direct_entries(item, name) + queue
                largest_layer, largest_names = get_max_layer_size(
                    _modules_only(queue), sizes, no_split
                )
                continue
            if verbose:
                print("  It cannot be split; moving to the next device.")

        if used[device] == 0 and fallback_allocation:
            room = budget[device] - max(largest_layer, size_with_ties)
            found = _fallback_candidate(queue, sizes, room, no_split, tied_parameters)
            if found is not None:
                fallback_name, fallback_item, queue = found
                if verbose:
                    print(f"  Fallback: {fallback_name} fits on {device!r} instead.")
                queue = [(fallback_name, fallback_item), (name, item), *queue]
                continue

        if used[device] == 0:
            minimum_needed[device] = size_with_ties + reserved
        used[device] += reserved
        current += 1
        queue.insert(0, (name, item))

    used = {device: amount for device, amount in used.items() if amount > 0}
    if clean_result:
        clean_device_map(device_map)

    _warn_about_offloaded_buffers(buffer_sizes, budget, used, accelerators, offload_buffers)
    if minimum_needed:
        details = "\n".join(
            f"  - {device}: {amount} bytes" for device, amount in minimum_needed.items()
        )
        logger.info(
            "No modules could be assigned to these devices due to insufficient memory (the "
            "first entry that tried needed, with the room kept for the largest layer):\n%s\n"
            "Give them at least that much memory to use them, let modules be split "
            "(no_split_module_classes), or pass fallback_allocation=True.",
            details,
        )
    return device_map


def _warn_about_offloaded_buffers(
    buffer_sizes: Mapping[int | str, Any],
    budget: Mapping[int | str, Any],
    used: Mapping[int | str, Any],
    accelerators: Sequence[int | str],
    offload_buffers: bool,
) -> None:
    """Warn when the buffers of CPU/disk-placed modules fit in no accelerator's leftover memory."""
    offloaded = buffer_sizes.get("cpu", 0) + buffer_sizes.get("disk", 0)
    if offloaded <= 0 or offload_buffers or not accelerators:
        return
    fits_somewhere = any(
        limit >= offloaded + used.get(device, 0)
        for device, limit in budget.items()
        if device not in ("cpu", "disk")
    )
    if not fits_somewhere:
        warnings.warn(
            f"The modules placed on cpu/disk have {offloaded} bytes of buffers, which do not "
            "seem to fit in any GPU's remaining memory; they move to the GPU at run time. If "
            "you run out of memory, pass offload_buffers=True.",
            stacklevel=3,
        )


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Check that ``device_map`` names real devices and gives one to every tensor of ``model``.

    Keys that name no submodule, parameter or buffer of the model give a warning.

    Args:
        model: the model the map is for.
        device_map: ``{module or tensor name: device}``.

    Raises:
        TypeError: ``device_map`` is not a mapping.
        ValueError: a value is not a device (the message lists the accepted forms), or some
            tensors of ``model.state_dict()`` are under no key (the message names them).
    """
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"device_map={device_map!r} has type {type(device_map).__name__}: use a dict from "
            "module names to devices, e.g. {'': 0} or {'encoder': 0, 'decoder': 'cpu'}."
        )
    for key, device in device_map.items():
        parse_device(device, f"device_map[{key!r}]")

    known = {name for name, _ in model.named_modules()}
    known.update(name for name, _ in model.named_parameters(remove_duplicate=False))
    known.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    unknown = [key for key in device_map if key != "" and key not in known]
    if unknown:
        warnings.warn(
            f"device_map keys do not match any submodules, parameters or buffers of the model: "
            f"{unknown}",
            UserWarning,
            stacklevel=2,
        )

    if "" in device_map:
        return
    keys = set(device_map)
    missing = [name for name in model.state_dict() if not _covered(name, keys)]
    if missing:
        raise ValueError(
            f"The device_map provided does not give any device for the following parameters: "
            f"{', '.join(missing)}. Add an entry for each of them or for a module holding them "
            "('' for the whole model)."
        )


def _covered(name: str, keys: set[str]) -> bool:
    """Whether ``name`` or one of its dotted prefixes is in ``keys``."""
    parts = name.split(".")
    return any(".".join(parts[:depth]) in keys for depth in range(len(parts), 0, -1))


def clean_device_map(
    device_map: MutableMapping[str, Any], module_name: str = ""
) -> MutableMapping[str, Any]:
    """Merge the entries under a module into one entry for the module when they share a device.

    Works from ``module_name`` (``""``: the whole model) down: the entries strictly under a
    module that all have one device (and are more than one) become a single entry for the
    module, placed where the first of them was. ``device_map`` is changed in place and returned.

    Args:
        device_map: the map to simplify.
        module_name: the module to start from.

    Returns:
        ``device_map`` itself.
    """
    items = list(device_map.items())
    merged = _merge(items, module_name)
    if merged != items:
        device_map.clear()
        device_map.update(merged)
    return device_map


def _merge(items: list[tuple[str, Any]], module_name: str) -> list[tuple[str, Any]]:
    """:func:`clean_device_map` on a list of items (recursive)."""
    prefix = f"{module_name}." if module_name else ""
    under = [i for i, (key, _) in enumerate(items) if key.startswith(prefix)]
    values = {items[i][1] for i in under}
    if len(under) > 1 and len(values) == 1:
        value = items[under[0]][1]
        drop = set(under)
        existing = next((i for i, (key, _) in enumerate(items) if key == module_name), None)
        merged: list[tuple[str, Any]] = []
        for i, (key, item_value) in enumerate(items):
            if i == existing:
                merged.append((key, value))
            elif i == under[0] and existing is None:
                merged.append((module_name, value))
            elif i not in drop:
                merged.append((key, item_value))
        items = merged

    depth = len(module_name.split(".")) + 1 if module_name else 1
    children: list[str] = []
    for key, _ in items:
        if key.startswith(prefix) and len(key) > len(module_name):
            child = ".".join(key.split(".")[:depth])
            if child not in children:
                children.append(child)
    for child in children:
        items = _merge(items, child)
    return items


def get_module_leaves(module_sizes: Mapping[str, Any]) -> list[str]:
    """The names in ``module_sizes`` (from ``compute_module_sizes``) that have no child entry.

    The root (``""``) is never a leaf.
    """
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if "." in name}
    return [name for name in module_sizes if name and name not in parents]


def fallback_allocate(
    modules: list[tuple[str, nn.Module]],
    module_sizes: Mapping[str, int],
    size_limit: int | str,
    no_split_module_classes: Sequence[str] | None = None,
    tied_parameters: Sequence[Sequence[str]] | None = None,
) -> tuple[str | None, nn.Module | None, list[tuple[str, nn.Module]]]:
    """The first module (depth first, splitting where allowed) that fits ``size_limit``.

    Accelerate's helper behind ``infer_auto_device_map(fallback_allocation=True)``: tied
    partners count toward a candidate's size.

    Returns:
        ``(name, module, remaining modules)``, or ``(None, None, modules)`` when none fits.
    """
    limit = convert_file_size_to_int(size_limit) if isinstance(size_limit, str) else size_limit
    found = _fallback_candidate(
        list(modules),
        module_sizes,
        limit,
        list(no_split_module_classes or ()),
        [list(group) for group in tied_parameters or ()],
    )
    if found is None:
        return None, None, list(modules)
    return found
