"""Units of prefetching and their plans: which hooks load together, which bytes they read.

Worked out on the main thread from the hooks and their weights maps; the background thread
only follows a plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from accel_bigmodel.hooks import AlignDevicesHook, align_hooks, hook_of
from accel_bigmodel.offload import WeightLocation
from accel_bigmodel.tensors import module_tensor

from .cuda_staging import aligned
from .paging import FileNeed, Span, merge_spans, missing_file


class Unit:
    """A unit of prefetching: one device-map block, or one offloading hook outside blocks.

    Args:
        trigger: the hook whose start starts the unit (the block hook, or the offloading hook).
        members: ``(module, offloading hook)`` pairs whose weights the unit holds.
        name: the block (or module) name, for logs and introspection.
        is_block: started by ``block_started`` (else by the trigger hook's ``materialize``).

    Attributes:
        dtypes: ``{hook: {tensor name: the model's dtype}}`` of the offloaded tensors.
        nbytes: the bytes of its offloaded tensors (aligned as in a staging buffer).
    """

    __slots__ = ("dtypes", "is_block", "members", "name", "nbytes", "trigger")

    def __init__(
        self,
        trigger: AlignDevicesHook,
        members: Sequence[tuple[nn.Module, AlignDevicesHook]],
        name: str,
        is_block: bool,
    ) -> None:
        self.trigger = trigger
        self.members = tuple(members)
        self.name = name
        self.is_block = is_block
        self.dtypes: dict[AlignDevicesHook, dict[str, torch.dtype]] = {}
        self.nbytes = 0
        for module, hook in self.members:
            table: dict[str, torch.dtype] = {}
            for tensor_name in hook.offloaded_names:
                try:
                    tensor = module_tensor(module, tensor_name)
                except (KeyError, AttributeError):
                    continue
                table[tensor_name] = tensor.dtype
                self.nbytes += aligned(tensor.numel() * tensor.element_size())
            self.dtypes[hook] = table

    def __repr__(self) -> str:
        return f"Unit({self.name!r})"


def find_units(model: nn.Module) -> list[Unit]:
    """The model's prefetch units in the device map's (module registration) order."""
    ordered: list[tuple[int, Unit]] = []
    in_blocks: set[AlignDevicesHook] = set()
    free: list[tuple[int, str, nn.Module, AlignDevicesHook]] = []
    for position, (name, module) in enumerate(model.named_modules()):
        for hook in align_hooks(hook_of(module)):
            if hook.block_index is not None and hook.block_offload_hooks:
                block = Unit(hook, hook.block_offload_hooks, hook.block_name or name, True)
                ordered.append((position, block))
                in_blocks.update(member for _, member in hook.block_offload_hooks)
            if hook.offload and hook.offloaded_names:
                free.append((position, name, module, hook))
    for position, name, module, hook in free:
        if hook not in in_blocks:
            ordered.append((position, Unit(hook, [(module, hook)], name, False)))
    ordered.sort(key=lambda item: item[0])
    return [unit for _, unit in ordered]


def has_offloaded_weights(model: nn.Module) -> bool:
    """Whether any hook of ``model`` offloads weights."""
    return any(hook.offload for module in model.modules() for hook in align_hooks(hook_of(module)))


class Plan:
    """What loading some offloaded weights ahead involves.

    Args:
        files: the files to check, with the bytes each must have.
        spans: the unaligned memory-map spans of the weights.
        keep: the mapped byte views behind the spans (they keep the maps alive).

    Attributes:
        ranges: the spans, page-aligned and merged: what is paged in.
        populated: the background thread paged the ranges in once (it then skips ranges
            that are still resident).
    """

    __slots__ = ("files", "keep", "populated", "ranges", "spans")

    def __init__(
        self, files: Iterable[FileNeed], spans: Iterable[Span], keep: Iterable[torch.Tensor]
    ) -> None:
        self.files = _largest_needs(files)
        self.spans = tuple(spans)
        self.ranges = merge_spans(self.spans)
        self.keep = tuple(keep)
        self.populated = False

    @property
    def empty(self) -> bool:
        """Whether there is nothing on disk to check or page in."""
        return not self.files and not self.ranges


def _largest_needs(needs: Iterable[FileNeed]) -> tuple[FileNeed, ...]:
    """One need per file: the one needing the most bytes (the first of equals)."""
    largest: dict[str, FileNeed] = {}
    for need in needs:
        known = largest.get(need.path)
        if known is None or need.needed > known.needed:
            largest[need.path] = need
    return tuple(largest.values())


def hook_plan(hook: AlignDevicesHook) -> Plan:
    """The files and mapped spans behind the offloaded weights of one hook.

    Raises:
        FileNotFoundError: a file holding one of the weights is gone (the message names it).
    """
    weights = hook.weights_map
    locate = getattr(weights, "weight_location", None)
    if weights is None or locate is None:
        return Plan((), (), ())
    mapped_bytes = getattr(weights, "mapped_bytes", None)
    files: list[FileNeed] = []
    spans: list[Span] = []
    keep: list[torch.Tensor] = []
    for name in hook.offloaded_names:
        try:
            location: WeightLocation | None = locate(name)
            view = None if location is None or mapped_bytes is None else mapped_bytes(name)
        except KeyError:
            continue  # the synchronous path reports the missing entry with its context
        except FileNotFoundError as error:
            raise missing_file(str(error.filename), name) from None
        if location is None:
            continue
        files.append(FileNeed(location.path, location.offset + location.length, name))
        if view is not None:
            keep.append(view)
            spans.append(Span(view.data_ptr(), view.numel(), location.path))
    return Plan(files, spans, keep)


def combine_plans(plans: Sequence[Plan]) -> Plan:
    """One plan doing what all of ``plans`` do (a unit's, from its hooks' plans)."""
    return Plan(
        [need for plan in plans for need in plan.files],
        [span for plan in plans for span in plan.spans],
        [view for plan in plans for view in plan.keep],
    )


def unit_plan(unit: Unit) -> Plan:
    """The plan of a unit, worked out afresh from its hooks."""
    return combine_plans([hook_plan(hook) for _, hook in unit.members])
