"""Dispatch: run a model whose parts live on different devices, on the CPU or on disk.

This module owns the user-facing entry points that attach the hooks of :mod:`.hooks` to a
whole model: :func:`dispatch_model` (follow a device map), :func:`load_checkpoint_and_dispatch`
(plan, load and dispatch in one call), :func:`cpu_offload` / :func:`disk_offload` (every weight
offloaded, brought in module by module), :func:`cpu_offload_with_hook` (whole-model offload for
pipelines) and :func:`get_state_dict_offloaded_model`.

Where offloaded weights are read from
-------------------------------------
The weights map of a dispatched model serves, by priority: the ``state_dict`` argument (or the
CPU-mapped weights taken from the model when the main device is an accelerator), the explicit
``offload_index``, the entries that ``load_checkpoint_in_model`` registered for the model
(weights read in place from the user's safetensors files: nothing is copied), then
``offload_dir/index.json``. A disk-mapped weight found in none of them is written to
``offload_dir`` when the model holds its value; a tied weight absent from all of them is read
under the name of a tied partner. Everything is checked before the model is changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .checkpoint_files import _checkpoint_files
from .device_map import check_device_map, infer_auto_device_map
from .hooks import (
    GUARDED_METHODS,
    AlignDevicesHook,
    CpuOffload,
    TiedParamsMap,
    UserCpuOffloadHook,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    find_align_devices_hook,
    has_offloaded_params,
)
from .loading import load_checkpoint_in_model
from .memory import get_balanced_memory
from .offload import (
    OffloadedWeightsLoader,
    WeightLocation,
    extract_submodules_state_dict,
    offload_state_dict,
    registered_offload_index,
)
from .prefetch import _install_prefetch, resolve_prefetch_depth
from .sizes import compute_module_sizes
from .tensors import (
    DeviceLike,
    Placement,
    check_device_available,
    find_tied_parameters,
    longest_prefix,
    module_tensor,
    named_module_tensors,
    parse_device,
    retie_parameters,
    set_module_tensor_to_device,
)

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "load_checkpoint_and_dispatch",
]

logger = logging.getLogger(__name__)

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The strings :func:`load_checkpoint_and_dispatch` accepts as ``device_map``."""

_INDEX_FILE = "index.json"
_CPU = torch.device("cpu")


# -- weights maps -------------------------------------------------------------------------


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


def _has_index(folder: str | os.PathLike[str] | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, _INDEX_FILE))


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


def _tied_aliases(
    tied: Sequence[Sequence[str]], available: Mapping[str, Any] | set[str]
) -> dict[str, str]:
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


def _preview(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# -- dispatch_model -----------------------------------------------------------------------


def _device_key(device: Placement) -> tuple[str, int | None]:
    if device == "disk":
        return ("disk", None)
    if device.type in ("cpu", "meta", "mps"):
        return (device.type, None)
    return (device.type, 0 if device.index is None else device.index)


def _guard(model: nn.Module, method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Wrap ``model.<name>`` to warn about moving a dispatched model and refuse meta weights."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        moves = True
        if name == "to":
            try:
                moves = torch._C._nn._parse_to(*args, **kwargs)[0] is not None
            except (TypeError, RuntimeError):
                moves = True
        if moves:
            logger.warning(
                "You are moving a model dispatched with a device map (model.%s): its hooks "
                "still send each block's inputs to the devices of hf_device_map.",
                name,
            )
        for param_name, param in model.named_parameters():
            if param.device.type == "meta":
                raise RuntimeError(
                    f"model.{name}() cannot move this dispatched model: {param_name!r} (and "
                    "possibly others) is on the meta device because its block is offloaded to "
                    "the CPU or disk and is only brought in during its forward. Run the model "
                    "as it is, or load it without offloading (a device_map without 'cpu'/'disk' "
                    "entries, or load_checkpoint_in_model without device_map) before moving it."
                )
        return method(*args, **kwargs)

    return guarded


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, DeviceLike],
    main_device: DeviceLike | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Mapping[str, Any]] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    *,
    prefetch_depth: int | None = None,
) -> nn.Module:
    """Make ``model`` run with its parts placed as ``device_map`` says.

    With a single device (and no ``force_hooks``) the model is simply moved there. Otherwise
    hooks are attached: blocks on an accelerator stay there, ``"cpu"`` and ``"disk"`` blocks
    run on the main device with their weights brought in for each forward (``"cpu"`` blocks
    are not offloaded when the main device is the CPU or MPS), and the outputs come back on the
    device of the inputs. ``model.hf_device_map`` is set to ``dict(device_map)`` in both cases.
    ``model.to()`` / ``.cuda()`` then warn, and raise while weights are offloaded. Offloaded
    blocks are loaded ahead of use by a
    :class:`~accel_bigmodel.prefetch.PrefetchingMaterializer` (``prefetch_depth``).

    Args:
        model: the model, its weights loaded (disk-mapped ones may be on ``meta``).
        device_map: ``{module name: device}``; every tensor of the state dict must be under
            some key (``""`` is the whole model).
        main_device: where offloaded blocks run; default: the first accelerator of the map,
            else the CPU.
        state_dict: the CPU weights of the offloaded blocks; default: taken from the model.
        offload_dir: folder of disk-offloaded weights (read from its ``index.json``; written
            there when the model holds weights that are mapped to disk and not yet offloaded).
        offload_index: ``{name: entry}`` index of offloaded weights (``dtype``/``shape`` of
            ``.dat`` files in ``offload_dir``, or ``safetensors_file``/``weight_name``).
        offload_buffers: offload the buffers of offloaded blocks too.
        skip_keys: keyword-argument keys whose values are not moved between devices.
        preload_module_classes: class names whose instances load all their weights (their
            submodules' too) at the start of their forward.
        force_hooks: attach hooks even when everything is on one device.
        prefetch_depth: how many offloaded blocks to load ahead of the running one (``0``:
            load each block when it starts, as Accelerate does); default
            ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1. Not an Accelerate argument.

    Returns:
        The model (changed in place).

    Raises:
        TypeError: ``device_map`` is not a mapping.
        ValueError: a device that is not one, a tensor the map does not place (named), weights
            mapped to disk with nowhere to read them from (no ``offload_dir``, or the model
            holds no data for them), weights of non-offloaded blocks on ``meta``, or a
            ``prefetch_depth`` that is not an int >= 0. The model is left unchanged.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    check_device_map(model, device_map)
    placements: dict[str, Placement] = {
        name: parse_device(device, f"device_map[{name!r}]") for name, device in device_map.items()
    }
    for name, placement in placements.items():
        check_device_available(placement, f"device_map[{name!r}]")
    keys = {_device_key(device) for device in placements.values()}
    if len(keys) <= 1 and ("disk", None) not in keys and not force_hooks:
        _dispatch_single(model, device_map, placements)
        model.__dict__["hf_device_map"] = dict(device_map)
        logger.debug(
            "dispatch_model(prefetch_depth=%d): the whole model is on one device, so there is "
            "nothing to prefetch.",
            depth,
        )
        return model

    main_raw, main = _main_device(device_map, placements, main_device)
    offloaded_kinds = ("disk",) if main.type in ("cpu", "mps") else ("cpu", "disk")

    def kind(device: Placement) -> str:
        return "disk" if device == "disk" else device.type

    offload_flags = {name: kind(device) in offloaded_kinds for name, device in placements.items()}
    execution = {
        name: main_raw if kind(placements[name]) in ("cpu", "disk") else device
        for name, device in device_map.items()
    }
    execution[""] = main_raw

    plan = _plan_weights(
        model,
        placements,
        offload_flags,
        state_dict,
        offload_dir,
        offload_index,
        offload_buffers,
        main_raw,
    )
    # Nothing above changed the model or wrote a file; from here on they are changed.
    weights_map = plan.apply(model, offload_dir)

    tied = find_tied_parameters(model)
    tied_params_map: TiedParamsMap = {}
    for group in tied:
        for name in group:
            param = model.get_parameter(name)
            if param.device.type != "meta":
                tied_params_map[param.data_ptr()] = {}

    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution,
        offload=offload_flags,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    offloaded_to = sorted(
        {kind(device) for device in placements.values()} & {"cpu", "disk"}, reverse=True
    )
    if offloaded_to:
        logger.info(
            "Some parameters are on the meta device because they were offloaded to the %s.",
            " and ".join(offloaded_to),
        )
    retie_parameters(model, tied)
    _install_prefetch(model, depth, "dispatch_model")
    for method_name in GUARDED_METHODS:
        method = getattr(model, method_name, None)
        if callable(method):
            model.__dict__[method_name] = _guard(model, method, method_name)
    model.__dict__["hf_device_map"] = dict(device_map)
    return model


def _dispatch_single(
    model: nn.Module, device_map: Mapping[str, DeviceLike], placements: Mapping[str, Placement]
) -> None:
    empty = [
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if tensor.device.type == "meta"
    ]
    target = next(iter(placements.values()), None)
    if target is None or target == "disk":
        return
    if empty and target.type != "meta":
        raise ValueError(
            f"dispatch_model(device_map={dict(device_map)!r}): {_preview(empty)} are on the "
            "meta device (never loaded), so the model cannot be moved to "
            f"{target}. Load the checkpoint first (load_checkpoint_in_model), or map the "
            "missing weights to 'disk' with their offload folder."
        )
    model.to(target)


def _main_device(
    device_map: Mapping[str, DeviceLike],
    placements: Mapping[str, Placement],
    main_device: DeviceLike | None,
) -> tuple[DeviceLike, torch.device]:
    if main_device is not None:
        parsed = parse_device(main_device, "main_device")
        check_device_available(parsed, "main_device")
        if parsed == "disk":
            raise ValueError(
                "main_device='disk': offloaded blocks must run on a device; pass 'cpu', an "
                "accelerator index such as 0, or leave main_device=None."
            )
        return main_device, parsed
    for name, device in placements.items():
        if device != "disk" and device.type != "cpu":
            return device_map[name], device
    return "cpu", _CPU


@dataclasses.dataclass
class _WeightsPlan:
    """Where each offloaded weight will be read from, decided before anything changes."""

    in_memory: OffloadedWeightsLoader | None
    extra: dict[str, torch.Tensor]
    writes: dict[str, torch.Tensor]
    folder: bool
    aliases: dict[str, str]
    fills: dict[str, tuple[str | None, DeviceLike]]

    def apply(
        self, model: nn.Module, offload_dir: str | os.PathLike[str] | None
    ) -> Mapping[str, torch.Tensor] | None:
        """Write what must be written, build the weights map, place the resident weights."""
        layers: list[Mapping[str, torch.Tensor]] = []
        if self.extra:
            layers.append(self.extra)
        if self.in_memory is not None:
            layers.append(self.in_memory)
        if self.writes:
            assert offload_dir is not None
            offload_state_dict(offload_dir, self.writes)
        if self.folder or self.writes:
            assert offload_dir is not None
            layers.append(OffloadedWeightsLoader(save_folder=offload_dir))
        weights: Mapping[str, torch.Tensor] | None = None
        if layers:
            weights = (
                layers[0]
                if len(layers) == 1 and not self.aliases
                else _LayeredWeights(layers, self.aliases)
            )
        for name, (source, device) in self.fills.items():
            value = weights[source] if weights is not None and source is not None else None
            set_module_tensor_to_device(model, name, device, value=value, clear_cache=False)
        return weights


def _plan_weights(
    model: nn.Module,
    placements: Mapping[str, Placement],
    offload_flags: Mapping[str, bool],
    state_dict: Mapping[str, torch.Tensor] | None,
    offload_dir: str | os.PathLike[str] | None,
    offload_index: Mapping[str, Mapping[str, Any]] | None,
    offload_buffers: bool,
    main: DeviceLike,
) -> _WeightsPlan:
    """Check that every weight of ``model`` can be found once dispatched; change nothing.

    A device-map key naming a single tensor (not a module) cannot be offloaded per forward (no
    hook owns it alone): when mapped to an offloaded device it is placed on ``main`` instead.

    Raises:
        ValueError: an offloaded weight has no source, a disk weight must be written without
            ``offload_dir``, or a weight kept in memory is on ``meta``.
    """
    names, buffers, non_persistent = _state_names(model)
    tensors = {name: module_tensor(model, name) for name in names}
    tied = find_tied_parameters(model)
    group_of = {name: group for group in tied for name in group}

    module_names = {name for name, _ in model.named_modules()}
    offloaded: list[str] = []  # served by the weights map
    resident: list[str] = []  # must hold data in the model
    pinned: set[str] = set()  # tensor-level keys of offloaded devices: placed on `main`
    for name in names:
        block = longest_prefix(name, placements)
        if block is None:
            # check_device_map covers the state dict, so only a non-persistent buffer can be
            # left out (a map naming the children of its module): it goes to the main device.
            pinned.add(name)
            resident.append(name)
            continue
        keeps_buffer = name in buffers and (not offload_buffers or name in non_persistent)
        if offload_flags[block] and block not in module_names:
            pinned.add(name)
            resident.append(name)
        elif offload_flags[block] and not keeps_buffer:
            offloaded.append(name)
        else:
            resident.append(name)

    cpu_blocks = [
        name
        for name, device in placements.items()
        if device != "disk" and device.type == "cpu" and offload_flags[name]
    ]
    if state_dict is None and cpu_blocks:
        state_dict = extract_submodules_state_dict(model.state_dict(), cpu_blocks)

    index: dict[str, dict[str, Any]] = {}
    registered = registered_offload_index(model)
    if registered:
        # Registered entries describe weights that loading left on meta; a weight the model
        # holds again (set since) is served from the model instead.
        index.update(
            {
                key: entry
                for key, entry in registered.items()
                if key not in tensors or tensors[key].device.type == "meta"
            }
        )
    if offload_index is not None:
        index.update({key: dict(entry) for key, entry in offload_index.items()})
    in_memory: OffloadedWeightsLoader | None = None
    if state_dict is not None or index:
        has_dat = any(entry.get("safetensors_file") is None for entry in index.values())
        in_memory = OffloadedWeightsLoader(
            state_dict=state_dict, index=index, save_folder=offload_dir if has_dat else None
        )
    folder = _has_index(offload_dir)
    available: set[str] = set(in_memory) if in_memory is not None else set()
    if folder:
        assert offload_dir is not None
        available.update(OffloadedWeightsLoader(save_folder=offload_dir))

    # A weight tied to one that stays in memory is served from memory, never written.
    resident_set = {name for name in resident if tensors[name].device.type != "meta"}
    aliases = _tied_aliases(tied, available)
    extra: dict[str, torch.Tensor] = {}
    writes: dict[str, torch.Tensor] = {}
    unreachable: list[str] = []
    for name in offloaded:
        if name in available or name in aliases:
            continue
        candidates = [name, *group_of.get(name, ())]
        value = next(
            (tensors[other] for other in candidates if tensors[other].device.type != "meta"), None
        )
        shared = any(other in resident_set for other in group_of.get(name, ()))
        if value is None:
            unreachable.append(name)
        elif placements[longest_prefix(name, placements) or ""] == "disk" and not shared:
            writes[name] = value.detach()
        else:
            extra[name] = value.detach()
    if unreachable:
        raise ValueError(
            f"dispatch_model: {_preview(unreachable)} are offloaded by device_map but are on "
            "the meta device and not found in offload_index, in the weights registered by "
            f"load_checkpoint_in_model, or in offload_dir={offload_dir!r}/{_INDEX_FILE}. Load "
            "the checkpoint with the same device_map (load_checkpoint_in_model) or pass the "
            "offload_dir it wrote."
        )
    if writes and offload_dir is None:
        raise ValueError(
            f"dispatch_model needs an offload_dir: device_map puts {_preview(sorted(writes))} "
            "on 'disk' and they are not offloaded yet. Pass offload_dir='path/to/folder' (they "
            "are written there once), or load the checkpoint with this device_map so that "
            "they are read in place."
        )

    fills: dict[str, tuple[str | None, DeviceLike]] = {}
    empty: list[str] = []
    for name in resident:
        target: DeviceLike = main if name in pinned else "cpu"
        if tensors[name].device.type != "meta":
            if name in pinned:
                fills[name] = (None, target)
            continue
        if name in available or name in aliases:
            fills[name] = (name, target)
            continue
        group = group_of.get(name, [])
        if any(tensors[other].device.type != "meta" for other in group):
            continue  # retie_parameters points it at the loaded partner
        if any(other in fills for other in group):
            continue  # a partner is filled and retied to it
        source = next((other for other in group if other in available), None)
        if source is None:
            source = next((aliases[other] for other in group if other in aliases), None)
        if source is None:
            empty.append(name)
        else:
            fills[name] = (source, target)
    if empty:
        raise ValueError(
            f"dispatch_model: {_preview(empty)} are on the meta device (never loaded) but the "
            "device_map keeps them in memory. Load the checkpoint first "
            "(load_checkpoint_in_model), or map them to 'disk' with their offload folder."
        )
    return _WeightsPlan(in_memory, extra, writes, folder, aliases, fills)


# -- whole-model offload ------------------------------------------------------------------


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
                f"cpu_offload: {_preview(empty)} are on the meta device, so there is no CPU "
                "copy to bring back at forward. Load the weights first, or pass state_dict=."
            )
        state_dict = {name: tensor.to("cpu") for name, tensor in own.items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=state_dict,
        preload_module_classes=preload_module_classes,
    )
    _install_prefetch(model, depth, "cpu_offload")
    return model


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
        ValueError: weights on ``meta`` that no index describes (named), or a
            ``prefetch_depth`` that is not an int >= 0.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    if execution_device is None:
        execution_device = _default_execution_device(model)
    placements: dict[str, Placement] = {"": "disk"}
    plan = _plan_weights(
        model, placements, {"": True}, None, offload_dir, None, offload_buffers, execution_device
    )
    weights_map = plan.apply(model, offload_dir)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        preload_module_classes=preload_module_classes,
    )
    _install_prefetch(model, depth, "disk_offload")
    return model


# -- load and dispatch --------------------------------------------------------------------


def _is_safetensors_checkpoint(checkpoint: str | os.PathLike[str]) -> bool | None:
    """Whether every file of ``checkpoint`` is safetensors (``None``: not a valid checkpoint)."""
    try:
        files = _checkpoint_files(os.fspath(checkpoint))
    except ValueError:
        return None
    return all(path.endswith(".safetensors") for path in files)


def plan_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, DeviceLike] | None,
    max_memory: Mapping[int | str, int | str] | None,
    no_split_module_classes: Sequence[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
) -> Mapping[str, DeviceLike] | None:
    """The device map a ``device_map`` argument stands for (a strategy name is planned).

    ``"auto"``, ``"balanced"`` and ``"balanced_low_0"`` first spread ``max_memory`` evenly
    over the GPUs (``get_balanced_memory``); ``"sequential"`` fills them in order. A mapping or
    ``None`` is returned as given.

    Raises:
        ValueError: an unknown strategy name (the message lists the accepted ones).
        TypeError: ``device_map`` is neither a string, a mapping nor ``None``.
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r} is not a placement strategy: use one of "
                f"{', '.join(repr(s) for s in DEVICE_MAP_STRATEGIES)}, or a dict such as "
                "{'': 0} or {'encoder': 0, 'decoder': 'cpu'}."
            )
        no_split = list(no_split_module_classes or [])
        budget: Any = max_memory
        if device_map != "sequential":
            budget = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        return infer_auto_device_map(
            model,
            max_memory=budget,
            no_split_module_classes=no_split,
            dtype=dtype,
            offload_buffers=offload_buffers,
        )
    if device_map is not None and not isinstance(device_map, Mapping):
        raise TypeError(
            f"device_map has type {type(device_map).__name__}: pass one of "
            f"{', '.join(repr(s) for s in DEVICE_MAP_STRATEGIES)}, a dict from module names "
            "to devices, or None."
        )
    return device_map


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, DeviceLike] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    prefetch_depth: int | None = None,
) -> nn.Module:
    """Load a checkpoint into ``model`` (usually built empty) and dispatch it over devices.

    A string ``device_map`` is planned with ``infer_auto_device_map`` under ``max_memory``
    (``"auto"``/``"balanced"``/``"balanced_low_0"`` first spread the budget evenly over the
    GPUs with ``get_balanced_memory``; ``"sequential"`` fills them in order). Weights then
    stream from the checkpoint to their devices (``load_checkpoint_in_model``) and hooks are
    attached (``dispatch_model``). Disk-mapped weights of a safetensors checkpoint are read in
    place: nothing is written unless the checkpoint is pickled or ``dtype`` converts them.

    Args:
        model: the model (e.g. built under ``init_empty_weights``).
        checkpoint: a checkpoint file, a sharded checkpoint's ``*.index.json``, or a folder
            holding ``model.safetensors``, ``pytorch_model.bin`` or one ``*.index.json``.
        device_map: one of ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``,
            or ``{module name: device}``; ``None`` only loads the weights.
        max_memory: ``{device: budget}`` (``{0: "10GiB", "cpu": "30GiB"}``); default: the free
            memory of this machine.
        no_split_module_classes: class names of modules kept whole on one device.
        offload_folder: where disk-mapped weights are written when they must be.
        offload_buffers: offload the buffers of offloaded blocks too.
        dtype: cast floating-point weights to this dtype while loading.
        offload_state_dict: stage CPU weights until every shard is read; default: ``True``
            when the map has ``"disk"`` entries.
        skip_keys: keyword-argument keys whose values are not moved between devices.
        preload_module_classes: class names whose instances load all their weights at once.
        force_hooks: attach hooks even when everything lands on one device.
        strict: the checkpoint's keys must match the model's exactly.
        full_state_dict: with DTensor models, the checkpoint holds full tensors.
        broadcast_from_rank0: rank 0 reads and broadcasts (needs a process group).
        prefetch_depth: how many offloaded blocks to load ahead of the running one (``0``:
            synchronous, as Accelerate); default ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1.
            Checked before anything is loaded.

    Returns:
        The model (changed in place).

    Raises:
        ValueError: an unknown ``device_map`` string (the message lists the accepted ones), a
            bad device map, or a budget too small for the model when weights would have to be
            written to disk and no ``offload_folder`` was given; plus the errors of
            ``load_checkpoint_in_model`` and ``dispatch_model``.
        TypeError: ``device_map`` is neither a string, a mapping nor ``None``.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    planned = isinstance(device_map, str)
    device_map = plan_device_map(
        model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers
    )
    if device_map is not None and "disk" in device_map.values() and offload_folder is None:
        # A pickled checkpoint must be copied to disk; a safetensors one is read in place (or,
        # with a dtype change, refused by load_checkpoint_in_model with its own message).
        if planned and _is_safetensors_checkpoint(checkpoint) is False:
            on_disk = [name for name, device in device_map.items() if device == "disk"]
            total = compute_module_sizes(model, dtype=dtype)[""]
            raise ValueError(
                f"The model ({total} bytes) does not fit in max_memory={max_memory!r}: "
                f"{_preview(on_disk)} would go to 'disk', and this checkpoint is not "
                "safetensors, so their weights must be copied to an offload folder, but "
                "offload_folder=None. Pass offload_folder='path/to/folder', give a larger "
                "max_memory, or convert the checkpoint to safetensors (read in place, no copy)."
            )
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=offload_state_dict,
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
        prefetch_depth=depth,
    )


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
