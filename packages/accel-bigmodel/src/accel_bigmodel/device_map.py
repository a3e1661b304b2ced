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
:func:`parse_device_map` is the one place where a device map written by a user is validated (its
type, keys and devices, a module placed twice, and optionally whether this machine has the
devices): every entry point that takes a ``device_map`` parses it through it once, before
anything is changed, by building a :class:`~accel_bigmodel.device_plan.DevicePlan` that it then
hands on (``check_device_map`` only validates).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from .memory import MaxMemory, get_max_memory, normalise_no_split
from .sizes import (
    DtypeLike,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    get_max_layer_size,
    get_module_size_with_ties,
)
from .tensors import (
    Placement,
    check_device_available,
    check_tied_parameters_in_config,
    find_tied_parameters,
    parse_device,
    placement_key,
)

__all__ = [
    "DeviceMap",
    "check_device_map",
    "check_device_map_covers",
    "clean_device_map",
    "fallback_allocate",
    "get_module_leaves",
    "infer_auto_device_map",
    "parse_device_map",
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


def infer_auto_device_map(  # noqa: PLR0913 - Accelerate's signature
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
            even when ``"disk"`` is not a key (no warning is given). Loading such weights
            from a safetensors checkpoint reads them in place, with no offload folder; one
            is needed only for a ``.bin`` (pickled) checkpoint or a dtype change.
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
    no_split = normalise_no_split(no_split_module_classes)
    devices: list[int | str] = list(budget)
    if "disk" not in devices:
        devices.append("disk")
    accelerators = [device for device in devices if device not in ("cpu", "disk")]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied_parameters = find_tied_parameters(model)
    if not tied_parameters and check_tied_parameters_in_config(model):
        logger.warning(
            "The model's configuration says some weights are tied but none are: call "
            "model.tie_weights() before infer_auto_device_map so tied weights are placed together."
        )
    options = _PlanOptions(
        budget=budget,
        devices=devices,
        main_devices=_main_devices(accelerators),
        sizes=sizes,
        tied_parameters=tied_parameters,
        no_split=no_split,
        dtype=dtype,
        special_dtypes=special_dtypes,
        verbose=verbose,
        offload_buffers=offload_buffers,
        fallback_allocation=fallback_allocation,
    )
    planner = _Planner(model, options)
    device_map = planner.run()

    used = {device: amount for device, amount in planner.used.items() if amount > 0}
    if clean_result:
        clean_device_map(device_map)
    _warn_about_offloaded_buffers(planner.buffer_sizes, budget, used, accelerators, offload_buffers)
    _report_unused_devices(planner.minimum_needed)
    return device_map


def _main_devices(accelerators: Sequence[int | str]) -> list[int | str]:
    """Where offloaded layers are brought to run, so room is kept there for the largest one."""
    if "mps" in accelerators:
        return ["mps"]
    if accelerators:
        return [accelerators[0], "cpu"]
    return ["cpu"]


@dataclasses.dataclass(frozen=True)
class _PlanOptions:
    """What :func:`infer_auto_device_map` plans with; fixed for the whole plan."""

    budget: Mapping[int | str, Any]
    """``{device: bytes}`` from ``get_max_memory``."""
    devices: Sequence[int | str]
    """The devices in the order they are filled, ``"disk"`` last."""
    main_devices: Sequence[int | str]
    """The devices where room is kept for the largest layer still to place."""
    sizes: Mapping[str, Any]
    tied_parameters: Sequence[Sequence[str]]
    no_split: Sequence[str]
    dtype: DtypeLike | None
    special_dtypes: Mapping[str, DtypeLike] | None
    verbose: bool
    offload_buffers: bool
    fallback_allocation: bool


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """One try at placing an entry on the current device."""

    name: str
    item: Any
    device: int | str
    limit: Any
    """The room on ``device`` once the reserve is kept (``None``: unbounded)."""
    reserved: Any
    """The room kept on ``device`` for the largest layer (0 off the main devices)."""
    size: Any
    size_with_ties: Any
    """``size`` plus the modules holding the entry's tied partners."""
    tied: list[str]
    tied_names: list[str]
    tied_holders: list[Any]


class _Planner:
    """The greedy placement loop of :func:`infer_auto_device_map`, one method per action."""

    def __init__(self, model: nn.Module, options: _PlanOptions) -> None:
        self.options = options
        self.queue = _direct_entries(model)
        self.device_map: OrderedDict[str, int | str] = OrderedDict()
        self.current = 0
        self.used: dict[int | str, Any] = dict.fromkeys(options.devices, 0)
        self.buffer_sizes: dict[int | str, Any] = {}
        self.minimum_needed: dict[int | str, Any] = {}
        self.largest_layer, self.largest_names = get_max_layer_size(
            self.queue, options.sizes, options.no_split
        )

    def _say(self, message: str) -> None:
        if self.options.verbose:
            print(message)

    def run(self) -> OrderedDict[str, int | str]:
        """Place every entry; returns the device map (not cleaned)."""
        while self.queue:
            name, item = self.queue.pop(0)
            self._step(self._attempt(name, item))
        return self.device_map

    def _attempt(self, name: str, item: Any) -> _Attempt:
        options = self.options
        self._say(f"\nTreating {name}.")
        # The largest layer left may have changed now that this entry is taken.
        self.largest_names = [n for n in self.largest_names if not _inside(n, name)]
        if not self.largest_names:
            self._measure_largest()
        size = options.sizes.get(name, 0)
        tied = _ties_outside(name, options.tied_parameters)
        if tied:
            self._say(f"  Tied to parameters outside it: {tied}")
        device = options.devices[self.current]
        limit: Any = None if device == "disk" else options.budget[device]
        reserved: Any = 0
        if device in options.main_devices:
            limit -= self.largest_layer
            reserved = self.largest_layer
        size_with_ties, tied_names, tied_holders = get_module_size_with_ties(
            tied, size, options.sizes, self.queue
        )
        return _Attempt(
            name,
            item,
            device,
            limit,
            reserved,
            size,
            size_with_ties,
            tied,
            tied_names,
            tied_holders,
        )

    def _measure_largest(self) -> None:
        self.largest_layer, self.largest_names = get_max_layer_size(
            _modules_only(self.queue), self.options.sizes, self.options.no_split
        )

    def _step(self, attempt: _Attempt) -> None:
        """Place the entry, split it or a tied holder, take a fallback, or try the next device."""
        used = self.used[attempt.device]
        if attempt.limit is None or used + attempt.size_with_ties <= attempt.limit:
            self._place(attempt)
            return
        if attempt.tied and used + attempt.size <= attempt.limit and self._split_tied(attempt):
            return
        if used + attempt.size >= attempt.limit and self._split(attempt):
            return
        if used == 0 and self.options.fallback_allocation and self._fallback(attempt):
            return
        self._next_device(attempt)

    def _place(self, attempt: _Attempt) -> None:
        device = attempt.device
        if self.options.verbose:
            together = f" with {attempt.tied_names}" if attempt.tied_names else ""
            room = (
                "" if attempt.limit is None else f", room left {attempt.limit - self.used[device]}"
            )
            print(
                f"  Placing {attempt.name}{together} on {device!r} "
                f"(size {attempt.size_with_ties}{room})."
            )
        self.used[device] += attempt.size_with_ties
        self.device_map[attempt.name] = device
        for holder_name in attempt.tied_names:
            at = next((i for i, (n, _) in enumerate(self.queue) if n == holder_name), None)
            if at is not None:
                self.queue.pop(at)
            self.device_map[holder_name] = device
        if not self.options.offload_buffers and isinstance(attempt.item, nn.Module):
            self.buffer_sizes[device] = self.buffer_sizes.get(device, 0) + (
                compute_module_total_buffer_size(
                    attempt.item,
                    dtype=self.options.dtype,
                    special_dtypes=self.options.special_dtypes,
                )
            )

    def _split_tied(self, attempt: _Attempt) -> bool:
        """The entry fits alone: split the first splittable module holding a tied partner."""
        self._say(
            f"  {attempt.name} with {attempt.tied_names} needs {attempt.size_with_ties} but "
            f"{attempt.device!r} has {attempt.limit - self.used[attempt.device]} left."
        )
        for holder_name, holder in zip(attempt.tied_names, attempt.tied_holders, strict=True):
            if not _splittable(holder, self.options.no_split):
                continue
            self._say(f"  Splitting the tied module {holder_name}.")
            queue = self.queue
            at = next(i for i, (n, _) in enumerate(queue) if n == holder_name)
            self.queue = (
                [(attempt.name, attempt.item)]
                + queue[:at]
                + _direct_entries(holder, holder_name)
                + queue[at + 1 :]
            )
            self._measure_largest()
            return True
        self._say("  No tied module can be split; moving to the next device.")
        return False

    def _split(self, attempt: _Attempt) -> bool:
        """The entry does not fit: replace it by its parts when it may be split."""
        self._say(
            f"  {attempt.name} (size {attempt.size}) does not fit on {attempt.device!r} "
            f"({attempt.limit - self.used[attempt.device]} left)."
        )
        if not _splittable(attempt.item, self.options.no_split):
            self._say("  It cannot be split; moving to the next device.")
            return False
        self._say(f"  Splitting {attempt.name}.")
        self.queue = _direct_entries(attempt.item, attempt.name) + self.queue
        self._measure_largest()
        return True

    def _fallback(self, attempt: _Attempt) -> bool:
        """Nothing is on this device yet: place first a smaller entry further on that fits."""
        options = self.options
        room = options.budget[attempt.device] - max(self.largest_layer, attempt.size_with_ties)
        found = _fallback_candidate(
            self.queue, options.sizes, room, options.no_split, options.tied_parameters
        )
        if found is None:
            return False
        fallback_name, fallback_item, queue = found
        self._say(f"  Fallback: {fallback_name} fits on {attempt.device!r} instead.")
        self.queue = [(fallback_name, fallback_item), (attempt.name, attempt.item), *queue]
        return True

    def _next_device(self, attempt: _Attempt) -> None:
        """Close the current device (keeping its reserve) and retry the entry on the next."""
        device = attempt.device
        if self.used[device] == 0:
            self.minimum_needed[device] = attempt.size_with_ties + attempt.reserved
        self.used[device] += attempt.reserved
        self.current += 1
        self.queue.insert(0, (attempt.name, attempt.item))


def _report_unused_devices(minimum_needed: Mapping[int | str, Any]) -> None:
    if not minimum_needed:
        return
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


_MAP_EXAMPLE = "{'': 0} or {'encoder': 0, 'decoder': 'cpu'}"


def parse_device_map(
    device_map: Any, model: nn.Module | None = None, *, on_this_machine: bool = True
) -> dict[str, Placement]:
    """Validate a device map written by a user and return ``{name: torch.device or "disk"}``.

    The one check of a map's form, shared by every entry point that takes a ``device_map``:
    a mapping from module (or tensor) names to devices and, given the model, no part of it
    placed twice (an entry inside another entry must name the same device; keys naming nothing
    in the model only get a warning elsewhere). ``"meta"`` is a device, as in Accelerate
    (transformers' ``device_map="meta"`` builds the model without its weights).

    Args:
        device_map: ``{module or tensor name: device}``.
        model: the model the map is for (to refuse a module placed twice).
        on_this_machine: also refuse accelerators this machine does not have.

    Raises:
        TypeError: ``device_map`` is not a mapping, or a key is not a string.
        ValueError: a value is not a device, names a device this machine lacks (with
            ``on_this_machine``), or an entry lies inside another one with a different device.
            The message names the entry and says how to fix it.
    """
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"device_map={device_map!r} has type {type(device_map).__name__}: use a dict from "
            f"module names to devices, e.g. {_MAP_EXAMPLE}."
        )
    parsed: dict[str, Placement] = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise TypeError(
                f"device_map has the key {key!r} of type {type(key).__name__}: use module names "
                f"as in model.named_modules() ('' for the whole model), e.g. {_MAP_EXAMPLE}."
            )
        parsed[key] = parse_device(value, f"device_map[{key!r}]")
    if model is not None:
        _refuse_placed_twice(device_map, parsed, _tensor_and_module_names(model))
    if on_this_machine:
        for key, device in parsed.items():
            check_device_available(device, f"device_map[{key!r}]")
    return parsed


def _tensor_and_module_names(model: nn.Module) -> set[str]:
    """Every name a device map key may give: modules, parameters and buffers (tied included)."""
    known = {name for name, _ in model.named_modules()}
    known.update(name for name, _ in model.named_parameters(remove_duplicate=False))
    known.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return known


def _refuse_placed_twice(
    device_map: Mapping[str, Any], parsed: Mapping[str, Placement], known: set[str]
) -> None:
    """Refuse an entry of the model that lies inside another entry with a different device."""
    for key, device in parsed.items():
        if key not in known:
            continue
        parent = key
        while parent:
            parent = parent.rpartition(".")[0]
            if parent in parsed and placement_key(parsed[parent]) != placement_key(device):
                raise ValueError(
                    f"device_map places {key!r} on {device_map[key]!r} and the module holding "
                    f"it, {parent!r}, on {device_map[parent]!r}: each module is placed once. "
                    f"Remove one of the two entries, or give {key!r} the device of {parent!r}."
                )


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Check that ``device_map`` names real devices and gives one to every tensor of ``model``.

    Only the form of the map is checked (see :func:`parse_device_map`), not whether this
    machine has its devices, so maps can be written and checked on another machine. Keys that
    name no submodule, parameter or buffer of the model give a warning.

    Args:
        model: the model the map is for.
        device_map: ``{module or tensor name: device}``.

    Raises:
        TypeError: ``device_map`` is not a mapping, or a key is not a string.
        ValueError: a value is not a device (the message lists the accepted forms), a module
            is placed twice on different devices, or some tensors of ``model.state_dict()``
            are under no key (the message names them).
    """
    parse_device_map(device_map, model, on_this_machine=False)
    check_device_map_covers(model, device_map)


def check_device_map_covers(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Warn about keys naming nothing in ``model``; refuse tensors that no key places.

    Raises:
        ValueError: some tensors of ``model.state_dict()`` are under no key (named).
    """
    known = _tensor_and_module_names(model)
    unknown = [key for key in device_map if key != "" and key not in known]
    if unknown:
        warnings.warn(
            f"device_map keys do not match any submodules, parameters or buffers of the model: "
            f"{unknown}",
            UserWarning,
            stacklevel=3,
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
