"""Weight sources: where each weight of a model about to be dispatched will be read from.

:func:`plan_weights` checks, before the model or any file is changed, that every tensor of a
model can be found once its blocks are offloaded, and returns a :class:`WeightsPlan`;
:meth:`WeightsPlan.apply` then writes what must be written, builds the weights map the hooks
read from and places the tensors that stay in the model.

The weights map serves, by priority: the ``state_dict`` argument (or the CPU-mapped weights
taken from the model when the main device is an accelerator), the explicit ``offload_index``,
the entries that ``load_checkpoint_in_model`` registered for the model (weights read in place
from the user's safetensors files: nothing is copied), then ``offload_dir/index.json``. A
disk-mapped weight found in none of them is written to ``offload_dir`` when the model holds
its value; a tied weight absent from all of them is read under the name of a tied partner.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .device_plan import DevicePlan
from .offload import (
    OffloadedWeightsLoader,
    WeightLocation,
    extract_submodules_state_dict,
    offload_state_dict,
    registered_offload_index,
)
from .tensors import (
    DeviceLike,
    find_tied_parameters,
    module_tensor,
    set_module_tensor_to_device,
)

__all__ = ["WeightsPlan", "plan_weights", "preview_names"]

_INDEX_FILE = "index.json"

_Fill = tuple[str | None, DeviceLike]
"""How a tensor kept in the model is placed: ``(name to read it under or None, device)``."""


def preview_names(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` names, quoted, for an error message (``... and N more``)."""
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class _LayeredWeights(Mapping[str, torch.Tensor]):
    """Several weight maps seen as one: each name is served by the first layer holding it.

    ``aliases`` sends a name that no layer holds to another name (a tied partner).
    """

    def __init__(
        self, layers: Sequence[Mapping[str, torch.Tensor]], aliases: Mapping[str, str]
    ) -> None:
        self.layers = tuple(layers)
        self._source: dict[str, Mapping[str, torch.Tensor]] = {}
        for layer in reversed(self.layers):
            for key in layer:
                self._source[key] = layer
        self.aliases = {key: target for key, target in aliases.items() if key not in self._source}

    def __getitem__(self, key: str) -> torch.Tensor:
        layer, name = self._layer_of(key)
        return layer[name]

    def __contains__(self, key: object) -> bool:
        return key in self._source or key in self.aliases

    def _layer_of(self, key: str) -> tuple[Mapping[str, torch.Tensor], str]:
        name = self.aliases.get(key, key)
        layer = self._source.get(name)
        if layer is None:
            raise KeyError(key)
        return layer, name

    def weight_location(self, key: str) -> WeightLocation | None:
        """The file bytes behind ``key``, from the layer serving it (``None`` if in memory)."""
        layer, name = self._layer_of(key)
        locate = getattr(layer, "weight_location", None)
        return None if locate is None else locate(name)

    def mapped_bytes(self, key: str) -> torch.Tensor | None:
        """The mapped file bytes behind ``key``, from the layer serving it (or ``None``)."""
        layer, name = self._layer_of(key)
        mapped = getattr(layer, "mapped_bytes", None)
        return None if mapped is None else mapped(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._source
        yield from self.aliases

    def __len__(self) -> int:
        return len(self._source) + len(self.aliases)


@dataclasses.dataclass(frozen=True)
class WeightsPlan:
    """Where each offloaded weight will be read from, decided before anything changes.

    Attributes:
        loader: serves the ``state_dict`` argument (or the CPU-mapped weights taken from the
            model) and the index entries (explicit ``offload_index`` and those registered by
            ``load_checkpoint_in_model``); ``None`` when there are none.
        from_model: offloaded weights that no source holds, served from the tensors the model
            holds now (CPU-mapped ones, or disk-mapped ones tied to a weight kept in memory).
        to_write: disk-mapped weights that no source holds, written to ``offload_dir`` once.
        offload_dir: the offload folder (``None``: there is none).
        folder_has_index: ``offload_dir`` already has an ``index.json`` to read weights from.
        aliases: ``{tied weight no source holds: the tied partner it is read under}``.
        resident_fills: tensors kept in the model that must be placed: ``{name: (the name
            the weights map serves its value under, or ``None`` to move the tensor the model
            holds; device)}``.
    """

    loader: OffloadedWeightsLoader | None
    from_model: dict[str, torch.Tensor]
    to_write: dict[str, torch.Tensor]
    offload_dir: str | os.PathLike[str] | None
    folder_has_index: bool
    aliases: dict[str, str]
    resident_fills: dict[str, _Fill]

    def apply(self, model: nn.Module) -> Mapping[str, torch.Tensor] | None:
        """Write what must be written, build the weights map, place the resident weights."""
        weights = self._weights_map()
        for name, (source, device) in self.resident_fills.items():
            value = weights[source] if weights is not None and source is not None else None
            set_module_tensor_to_device(model, name, device, value=value, clear_cache=False)
        return weights

    def _weights_map(self) -> Mapping[str, torch.Tensor] | None:
        layers: list[Mapping[str, torch.Tensor]] = []
        if self.from_model:
            layers.append(self.from_model)
        if self.loader is not None:
            layers.append(self.loader)
        if self.to_write:
            assert self.offload_dir is not None
            offload_state_dict(self.offload_dir, self.to_write)
        if self.folder_has_index or self.to_write:
            assert self.offload_dir is not None
            layers.append(OffloadedWeightsLoader(save_folder=self.offload_dir))
        if not layers:
            return None
        if len(layers) == 1 and not self.aliases:
            return layers[0]
        return _LayeredWeights(layers, self.aliases)


def plan_weights(
    model: nn.Module,
    *,
    plan: DevicePlan,
    offload_flags: Mapping[str, bool],
    main: DeviceLike,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Mapping[str, Any]] | None = None,
    offload_buffers: bool = False,
) -> WeightsPlan:
    """Check that every weight of ``model`` can be found once dispatched; change nothing.

    A device-map key naming a single tensor (not a module) cannot be offloaded per forward (no
    hook owns it alone): when mapped to an offloaded device it is placed on ``main`` instead.

    Args:
        model: the model about to be dispatched.
        plan: the device plan (the parsed device map).
        offload_flags: ``{device-map key: whether its block is offloaded}`` (from
            :meth:`~accel_bigmodel.device_plan.DevicePlan.offload_flags`).
        main: where offloaded blocks run.
        state_dict: the CPU weights of the offloaded blocks; default: taken from the model.
        offload_dir: the offload folder (read from its ``index.json``, written when needed).
        offload_index: ``{name: entry}`` index of offloaded weights.
        offload_buffers: offload the buffers of offloaded blocks too.

    Raises:
        ValueError: an offloaded weight has no source, a disk weight must be written without
            ``offload_dir``, a weight kept in memory is on ``meta``, ``offload_dir`` is a file,
            or a source does not fit the model (a damaged or stale offload folder: a file
            shorter or longer than its entry, another shape, a float weight for an integer
            tensor; see :meth:`OffloadedWeightsLoader.check_serves`).
        FileNotFoundError: a file an offload index entry points to does not exist.
        TypeError: ``offload_index`` or one of its entries is not a mapping, or a
            ``state_dict`` value is not a tensor.
    """
    _check_offload_dir(offload_dir)
    planner = _Planner(model, plan, offload_flags)
    split = planner.classify(offload_buffers=offload_buffers)
    sources = planner.collect_sources(state_dict, offload_index, offload_dir)
    try:
        from_model, to_write = planner.resolve_offloaded(split, sources, offload_dir)
        fills = planner.resolve_resident(split, sources, main)
        planner.check_sources(split, sources, fills)
    finally:
        if sources.folder_loader is not None:
            sources.folder_loader.close()
    return WeightsPlan(
        loader=sources.loader,
        from_model=from_model,
        to_write=to_write,
        offload_dir=offload_dir,
        folder_has_index=sources.folder_has_index,
        aliases=sources.aliases,
        resident_fills=fills,
    )


@dataclasses.dataclass(frozen=True)
class _Split:
    """The model's tensor names by where their data will live."""

    offloaded: list[str]
    """Served by the weights map, brought in at each forward."""
    resident: list[str]
    """Must hold data in the model."""
    pinned: set[str]
    """Resident tensors placed on the main device: tensor-level keys of offloaded devices and
    non-persistent buffers the map does not place."""


@dataclasses.dataclass(frozen=True)
class _Sources:
    """What can serve a weight once the model is dispatched."""

    loader: OffloadedWeightsLoader | None
    folder_has_index: bool
    folder_loader: OffloadedWeightsLoader | None
    """Reads ``offload_dir/index.json`` for the checks (closed once the plan is made)."""
    available: set[str]
    """Names the loader or ``offload_dir/index.json`` holds."""
    aliases: dict[str, str]
    """Tied names not available, read under an available partner."""

    def serves(self, name: str) -> bool:
        return name in self.available or name in self.aliases


class _Planner:
    """The phases of :func:`plan_weights`, over one read of the model's tensors."""

    def __init__(
        self,
        model: nn.Module,
        plan: DevicePlan,
        offload_flags: Mapping[str, bool],
    ) -> None:
        self.model = model
        self.plan = plan
        self.offload_flags = offload_flags
        self.names, self.buffers, self.non_persistent = _state_names(model)
        self.tensors = {name: module_tensor(model, name) for name in self.names}
        self.tied = find_tied_parameters(model)
        self.group_of = {name: group for group in self.tied for name in group}

    def _loaded(self, name: str) -> bool:
        return self.tensors[name].device.type != "meta"

    def classify(self, *, offload_buffers: bool) -> _Split:
        """Sort the tensor names into offloaded and resident ones."""
        module_names = {name for name, _ in self.model.named_modules()}
        split = _Split(offloaded=[], resident=[], pinned=set())
        for name in self.names:
            block = self.plan.key_of(name)
            if block is None:
                # check_device_map covers the state dict, so only a non-persistent buffer can be
                # left out (a map naming the children of its module): it goes to the main device.
                split.pinned.add(name)
                split.resident.append(name)
                continue
            keeps_buffer = name in self.buffers and (
                not offload_buffers or name in self.non_persistent
            )
            if self.offload_flags[block] and block not in module_names:
                split.pinned.add(name)
                split.resident.append(name)
            elif self.offload_flags[block] and not keeps_buffer:
                split.offloaded.append(name)
            else:
                split.resident.append(name)
        return split

    def collect_sources(
        self,
        state_dict: Mapping[str, torch.Tensor] | None,
        offload_index: Mapping[str, Mapping[str, Any]] | None,
        offload_dir: str | os.PathLike[str] | None,
    ) -> _Sources:
        """The loader over the given and registered weights, and what it and the folder hold."""
        cpu_blocks = [name for name in self.plan.keys_on("cpu") if self.offload_flags[name]]
        if state_dict is None and cpu_blocks:
            state_dict = extract_submodules_state_dict(self.model.state_dict(), cpu_blocks)
        index = self._index(offload_index)
        loader: OffloadedWeightsLoader | None = None
        if state_dict is not None or index:
            has_dat = any(entry.get("safetensors_file") is None for entry in index.values())
            loader = OffloadedWeightsLoader(
                state_dict=state_dict, index=index, save_folder=offload_dir if has_dat else None
            )
        folder_has_index = offload_dir is not None and os.path.isfile(
            os.path.join(offload_dir, _INDEX_FILE)
        )
        available: set[str] = set(loader) if loader is not None else set()
        folder_loader: OffloadedWeightsLoader | None = None
        if folder_has_index:
            assert offload_dir is not None
            folder_loader = OffloadedWeightsLoader(save_folder=offload_dir)
            available.update(folder_loader)
        return _Sources(
            loader, folder_has_index, folder_loader, available, _tied_aliases(self.tied, available)
        )

    def _index(
        self, offload_index: Mapping[str, Mapping[str, Any]] | None
    ) -> dict[str, dict[str, Any]]:
        """The registered index entries still wanted, overridden by ``offload_index``."""
        index: dict[str, dict[str, Any]] = {}
        registered = registered_offload_index(self.model)
        if registered:
            # Registered entries describe weights that loading left on meta; a weight the model
            # holds again (set since) is served from the model instead.
            index.update(
                {
                    key: entry
                    for key, entry in registered.items()
                    if key not in self.tensors or not self._loaded(key)
                }
            )
        if offload_index is not None:
            if not isinstance(offload_index, Mapping):
                raise TypeError(
                    f"offload_index={offload_index!r} has type {type(offload_index).__name__}: "
                    "pass {weight name: {'dtype': ..., 'shape': [...]}} (an offload folder's "
                    "index.json), or None."
                )
            for key, entry in offload_index.items():
                if not isinstance(entry, Mapping):
                    raise TypeError(
                        f"offload_index[{key!r}]={entry!r} is not a mapping: use entries "
                        "{'dtype': ..., 'shape': [...]} (or 'safetensors_file'/'weight_name')."
                    )
                index[key] = dict(entry)
        return index

    def check_sources(self, split: _Split, sources: _Sources, fills: Mapping[str, _Fill]) -> None:
        """Check every source that will be read against the model's tensor it fills.

        Raises:
            FileNotFoundError, ValueError, TypeError: see
                :meth:`OffloadedWeightsLoader.check_serves`.
        """
        reads = [
            (name, name if name in sources.available else sources.aliases[name])
            for name in split.offloaded
            if sources.serves(name)
        ]
        reads.extend((name, source) for name, (source, _) in fills.items() if source is not None)
        for name, source in reads:
            for loader in (sources.loader, sources.folder_loader):
                if loader is not None and source in loader:
                    loader.check_serves(source, self.tensors[name], name)
                    break

    def resolve_offloaded(
        self,
        split: _Split,
        sources: _Sources,
        offload_dir: str | os.PathLike[str] | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The offloaded weights no source holds: ``(served from the model, to write)``."""
        # A weight tied to one that stays in memory is served from memory, never written.
        loaded_resident = {name for name in split.resident if self._loaded(name)}
        from_model: dict[str, torch.Tensor] = {}
        to_write: dict[str, torch.Tensor] = {}
        unreachable: list[str] = []
        for name in split.offloaded:
            if sources.serves(name):
                continue
            partners = self.group_of.get(name, ())
            value = next(
                (self.tensors[other] for other in (name, *partners) if self._loaded(other)), None
            )
            shared = any(other in loaded_resident for other in partners)
            if value is None:
                unreachable.append(name)
            elif self.plan.on_disk(name) and not shared:
                to_write[name] = value.detach()
            else:
                from_model[name] = value.detach()
        if unreachable:
            raise ValueError(
                f"dispatch_model: {preview_names(unreachable)} are offloaded by device_map but "
                "are on the meta device and not found in offload_index, in the weights "
                "registered by load_checkpoint_in_model, or in "
                f"offload_dir={offload_dir!r}/{_INDEX_FILE}. Load the checkpoint with the same "
                "device_map (load_checkpoint_in_model) or pass the offload_dir it wrote."
            )
        if to_write and offload_dir is None:
            raise ValueError(
                "dispatch_model needs an offload_dir: device_map puts "
                f"{preview_names(sorted(to_write))} on 'disk' and they are not offloaded yet. "
                "Pass offload_dir='path/to/folder' (they are written there once), or load the "
                "checkpoint with this device_map so that they are read in place."
            )
        return from_model, to_write

    def resolve_resident(
        self, split: _Split, sources: _Sources, main: DeviceLike
    ) -> dict[str, _Fill]:
        """How each tensor kept in the model is placed (a loaded partner is retied instead)."""
        fills: dict[str, _Fill] = {}
        empty: list[str] = []
        for name in split.resident:
            target: DeviceLike = main if name in split.pinned else "cpu"
            if self._loaded(name):
                if name in split.pinned:
                    fills[name] = (None, target)
                continue
            if sources.serves(name):
                fills[name] = (name, target)
                continue
            group = self.group_of.get(name, [])
            if any(self._loaded(other) or other in fills for other in group):
                continue  # retie_parameters points it at the loaded or filled partner
            source = _partner_source(group, sources)
            if source is None:
                empty.append(name)
            else:
                fills[name] = (source, target)
        if empty:
            raise ValueError(
                f"dispatch_model: {preview_names(empty)} are on the meta device (never loaded) "
                "but the device_map keeps them in memory. Load the checkpoint first "
                "(load_checkpoint_in_model), or map them to 'disk' with their offload folder."
            )
        return fills


def _check_offload_dir(offload_dir: str | os.PathLike[str] | None) -> None:
    """Refuse an ``offload_dir`` that exists but is not a folder."""
    if offload_dir is not None and os.path.exists(offload_dir) and not os.path.isdir(offload_dir):
        raise ValueError(
            f"offload_dir={os.fspath(offload_dir)!r} is a file, not a folder: pass the path of "
            "a folder (it is created when weights must be written there)."
        )


def _partner_source(group: Sequence[str], sources: _Sources) -> str | None:
    """The name a tied partner in ``group`` is served under, if any."""
    source = next((other for other in group if other in sources.available), None)
    if source is None:
        source = next((sources.aliases[other] for other in group if other in sources.aliases), None)
    return source


def _state_names(model: nn.Module) -> tuple[list[str], set[str], set[str]]:
    """(all tensor names incl. tied duplicates, buffer names, non-persistent buffer names)."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules(remove_duplicate=False)
        for name in module._non_persistent_buffers_set
    }
    return names + buffers, set(buffers), non_persistent


def _tied_aliases(tied: Sequence[Sequence[str]], available: set[str]) -> dict[str, str]:
    """For each tied name not available, the first available partner (if any)."""
    aliases: dict[str, str] = {}
    for group in tied:
        partner = next((name for name in group if name in available), None)
        if partner is None:
            continue
        for name in group:
            if name not in available:
                aliases[name] = partner
    return aliases
