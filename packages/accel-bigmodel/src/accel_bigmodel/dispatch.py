"""Dispatch: run a model whose parts live on different devices, on the CPU or on disk.

This module owns the user-facing entry points that attach the hooks of :mod:`.hooks` to a
model following a device map: :func:`dispatch_model` (follow a device map) and
:func:`load_checkpoint_and_dispatch` (plan, load and dispatch in one call), with
:func:`plan_device_map` behind its ``device_map`` strategies. Where offloaded weights are read
from is decided by :mod:`.weight_sources` (everything is checked before the model is changed).
Each entry point turns its ``device_map`` into a :class:`~accel_bigmodel.device_plan.DevicePlan`
first (:func:`plan_devices` for ``load_checkpoint_and_dispatch``: a strategy is planned, then the
map is parsed once) and hands the plan to loading, weight planning and the hooks.
The whole-model entry points (:func:`cpu_offload`, :func:`disk_offload`,
:func:`cpu_offload_with_hook`, :func:`get_state_dict_offloaded_model`) live in
:mod:`.whole_model` and are importable from here too.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .device_map import check_device_map_covers, infer_auto_device_map
from .device_plan import DevicePlan, ExecutionDevice
from .hooks import GUARDED_METHODS, TiedParamsMap, attach_align_device_hook_on_blocks
from .loading import load_checkpoint
from .loading.files import checkpoint_files
from .loading.plan import LoadOptions
from .memory import get_balanced_memory, get_max_memory
from .offload_format import INDEX_FILE
from .prefetch import install_prefetch, resolve_prefetch_depth
from .sizes import compute_module_sizes
from .tensors import (
    DeviceLike,
    check_device_available,
    find_tied_parameters,
    parse_device,
    retie_parameters,
)
from .weight_sources import plan_weights, preview_names
from .whole_model import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
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


# -- dispatch_model -----------------------------------------------------------------------


class _MoveGuard:
    """``model.<name>`` on a dispatched model: warns about moving it and refuses meta weights.

    A plain object rather than a closure, so that a dispatched model can be deep-copied (the
    copy's guard follows the copied model) and pickled.

    Args:
        model: the dispatched model.
        name: the guarded method (one of ``GUARDED_METHODS``).
        method: the instance's own override of that method, if it had one (else the class's
            method is called).
    """

    __slots__ = ("method", "model", "name")

    def __init__(self, model: nn.Module, name: str, method: Callable[..., Any] | None) -> None:
        self.model = model
        self.name = name
        self.method = method

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The method this guard calls."""
        if self.method is not None:
            return self.method
        return functools.partial(getattr(type(self.model), self.name), self.model)

    def __repr__(self) -> str:
        return f"<guarded {type(self.model).__name__}.{self.name} of a dispatched model>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, name = self.model, self.name
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
        if self.method is not None:
            return self.method(*args, **kwargs)
        return getattr(type(model), name)(model, *args, **kwargs)


def dispatch_model(  # noqa: PLR0913 - Accelerate's signature
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
        TypeError: ``device_map`` is not a mapping or has a key that is not a string;
            ``offload_index`` (or one of its entries) is not a mapping.
        ValueError: a device that is not one or that this machine lacks, a module placed twice
            on different devices, a tensor the map does not place (named), weights mapped to
            disk with nowhere to read them from (no ``offload_dir``, or the model holds no data
            for them), weights of non-offloaded blocks on ``meta``, an ``offload_dir`` that is
            a file, an offload index or file that does not fit the model (a ``.dat`` file
            shorter or longer than its entry, another shape, a float weight for an integer
            tensor, a safetensors file without the weight or damaged), or a ``prefetch_depth``
            that is not an int >= 0.
        FileNotFoundError: a file an offload index entry reads from does not exist. After
            any of these errors the model is as it was and nothing was written.
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    plan = DevicePlan.from_device_map(device_map, model)
    return dispatch_planned(
        model,
        plan,
        main_device=main_device,
        state_dict=state_dict,
        offload_dir=offload_dir,
        offload_index=offload_index,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
        prefetch_depth=depth,
    )


def dispatch_planned(  # noqa: PLR0913 - dispatch_model's options, the map already parsed
    model: nn.Module,
    plan: DevicePlan,
    *,
    main_device: DeviceLike | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Mapping[str, Any]] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    prefetch_depth: int,
) -> nn.Module:
    """:func:`dispatch_model` once its ``device_map`` is a plan (and its depth resolved).

    The entry points that parsed the map already (``load_checkpoint_and_dispatch``,
    ``load_pretrained``) dispatch through this, so the map is not parsed again.

    Args:
        model: the model, its weights loaded (disk-mapped ones may be on ``meta``).
        plan: the device map, parsed once by the entry point.
        main_device: where offloaded blocks run; default: the plan's
            :meth:`~accel_bigmodel.device_plan.DevicePlan.default_main_device`.
        state_dict: see :func:`dispatch_model`.
        offload_dir: see :func:`dispatch_model`.
        offload_index: see :func:`dispatch_model`.
        offload_buffers: see :func:`dispatch_model`.
        skip_keys: see :func:`dispatch_model`.
        preload_module_classes: see :func:`dispatch_model`.
        force_hooks: see :func:`dispatch_model`.
        prefetch_depth: the resolved prefetch depth (an int >= 0).

    Returns:
        The model (changed in place).

    Raises:
        ValueError, TypeError, FileNotFoundError: as :func:`dispatch_model`, less the errors
            of parsing the map.
    """
    check_device_map_covers(model, plan.device_map)
    if not plan.needs_hooks and not force_hooks:
        return _dispatch_to_one_device(model, plan, prefetch_depth)

    main = _main_device(plan, main_device)
    offload_flags = plan.offload_flags(main.device)
    weights = plan_weights(
        model,
        plan=plan,
        offload_flags=offload_flags,
        main=main.device,
        state_dict=state_dict,
        offload_dir=offload_dir,
        offload_index=offload_index,
        offload_buffers=offload_buffers,
    )
    # Nothing above changed the model or wrote a file; from here on they are changed.
    weights_map = weights.apply(model)

    tied = find_tied_parameters(model)
    attach_align_device_hook_on_blocks(
        model,
        execution_device=plan.execution_devices(main),
        offload=offload_flags,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=_tied_params_map(model, tied),
    )
    _log_offloaded(plan)
    retie_parameters(model, tied)
    install_prefetch(model, prefetch_depth, "dispatch_model")
    _guard_methods(model)
    model.__dict__["hf_device_map"] = dict(plan.device_map)
    return model


def _dispatch_to_one_device(model: nn.Module, plan: DevicePlan, depth: int) -> nn.Module:
    """Move the whole model to the one device of its map: no hooks are needed."""
    target = plan.one_device
    if target is not None:
        _move_whole_model(model, plan.device_map, target)
    model.__dict__["hf_device_map"] = dict(plan.device_map)
    logger.debug(
        "dispatch_model(prefetch_depth=%d): the whole model is on one device, so there is "
        "nothing to prefetch.",
        depth,
    )
    return model


def _move_whole_model(
    model: nn.Module, device_map: Mapping[str, DeviceLike], target: torch.device
) -> None:
    """``model.to(target)``, refused while some weights were never loaded."""
    empty = [
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if tensor.device.type == "meta"
    ]
    if empty and target.type != "meta":
        raise ValueError(
            f"dispatch_model(device_map={dict(device_map)!r}): {preview_names(empty)} are on "
            "the meta device (never loaded), so the model cannot be moved to "
            f"{target}. Load the checkpoint first (load_checkpoint_in_model), or map the "
            "missing weights to 'disk' with their offload folder."
        )
    model.to(target)


def _main_device(plan: DevicePlan, main_device: DeviceLike | None) -> ExecutionDevice:
    """Where offloaded blocks run: ``main_device`` parsed, else the plan's default.

    The hooks show the device as written (``0`` stays ``0``, as in Accelerate); the parsed one
    decides which blocks are offloaded.
    """
    if main_device is None:
        return plan.default_main_device()
    parsed = parse_device(main_device, "main_device")
    check_device_available(parsed, "main_device")
    if not isinstance(parsed, torch.device):
        raise ValueError(
            "main_device='disk': offloaded blocks must run on a device; pass 'cpu', an "
            "accelerator index such as 0, or leave main_device=None."
        )
    return ExecutionDevice(main_device, parsed)


def _tied_params_map(model: nn.Module, tied: Sequence[Sequence[str]]) -> TiedParamsMap:
    """An empty entry for the storage of each loaded tied parameter (filled by the hooks)."""
    tied_params_map: TiedParamsMap = {}
    for group in tied:
        for name in group:
            param = model.get_parameter(name)
            if param.device.type != "meta":
                tied_params_map[param.data_ptr()] = {}
    return tied_params_map


def _log_offloaded(plan: DevicePlan) -> None:
    if plan.offloaded_to:
        logger.info(
            "Some parameters are on the meta device because they were offloaded to the %s.",
            " and ".join(plan.offloaded_to),
        )


def _guard_methods(model: nn.Module) -> None:
    """Put a :class:`_MoveGuard` on each of the model's moving methods."""
    for method_name in GUARDED_METHODS:
        if not callable(getattr(model, method_name, None)):
            continue
        own = model.__dict__.get(method_name)
        if isinstance(own, _MoveGuard):
            continue  # dispatched again: one guard is enough
        model.__dict__[method_name] = _MoveGuard(model, method_name, own)


# -- load and dispatch --------------------------------------------------------------------


def _is_safetensors_checkpoint(checkpoint: str | os.PathLike[str]) -> bool | None:
    """Whether every file of ``checkpoint`` is safetensors (``None``: not a valid checkpoint)."""
    try:
        files = checkpoint_files(os.fspath(checkpoint))
    except ValueError:
        return None
    return all(path.endswith(".safetensors") for path in files)


def _check_planned_disk_needs_no_folder(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    plan: DevicePlan,
    max_memory: Mapping[int | str, int | str] | None,
    dtype: str | torch.dtype | None,
) -> None:
    """Refuse a planned map that sends a pickled checkpoint's weights to disk with no folder.

    A pickled checkpoint must be copied to disk; a safetensors one is read in place (or, with a
    dtype change, refused by ``load_checkpoint_in_model`` with its own message).
    """
    on_disk = plan.disk_keys
    if not on_disk or _is_safetensors_checkpoint(checkpoint) is not False:
        return
    total = compute_module_sizes(model, dtype=dtype)[""]
    raise ValueError(
        f"The model ({total} bytes) does not fit in max_memory={max_memory!r}: "
        f"{preview_names(on_disk)} would go to 'disk', and this checkpoint is not "
        "safetensors, so their weights must be copied to an offload folder, but "
        "offload_folder=None. Pass offload_folder='path/to/folder', give a larger "
        "max_memory, or convert the checkpoint to safetensors (read in place, no copy)."
    )


def _check_budget_devices_exist(max_memory: Mapping[int | str, int | str]) -> None:
    """Refuse a ``max_memory`` naming a device this machine lacks, when the plan is loaded now.

    (``infer_auto_device_map`` alone may plan for another machine: there it is a warning.)
    """
    for key in get_max_memory(max_memory):
        if key not in ("cpu", "disk"):
            check_device_available(
                parse_device(key, f"max_memory[{key!r}]"),
                f"max_memory[{key!r}]",
                fix=(
                    "remove it from max_memory, or pass max_memory=None to use the free memory "
                    "of the devices this machine has"
                ),
            )


def _refuse_meta_beside_devices(plan: DevicePlan) -> None:
    """Refuse a map that puts some blocks on ``meta`` and others on devices, before loading.

    Such blocks get no weights, so the dispatch that follows the load could not run them
    (``{"": "meta"}`` alone is transformers' ``device_map="meta"``: a model without weights).
    """
    on_meta = plan.keys_on("meta")
    if on_meta and len(on_meta) < len(plan.placements):
        key = on_meta[0]
        raise ValueError(
            f"device_map[{key!r}]={plan.device_map[key]!r}: weights placed on the meta device "
            "get no data, so load_checkpoint_and_dispatch could not run them beside the other "
            "blocks. Put them on 'cpu', 'disk' or an accelerator (or use {'': 'meta'} alone for "
            "a model without weights). The model was not changed."
        )


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
        ValueError: an unknown strategy name (the message lists the accepted ones), or a bad
            ``max_memory`` (see ``get_max_memory``), including a device this machine lacks.
        TypeError: ``device_map`` is neither a string, a mapping nor ``None``; a bad type in
            ``max_memory``.
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r} is not a placement strategy: use one of "
                f"{', '.join(repr(s) for s in DEVICE_MAP_STRATEGIES)}, or a dict such as "
                "{'': 0} or {'encoder': 0, 'decoder': 'cpu'}."
            )
        if max_memory is not None:
            _check_budget_devices_exist(max_memory)
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
            f"device_map has type {type(device_map).__name__} ({device_map!r}): pass one of "
            f"{', '.join(repr(s) for s in DEVICE_MAP_STRATEGIES)}, a dict from module names "
            "to devices, or None."
        )
    return device_map


def plan_devices(
    model: nn.Module,
    device_map: str | Mapping[str, DeviceLike] | None,
    max_memory: Mapping[int | str, int | str] | None,
    no_split_module_classes: Sequence[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
) -> DevicePlan | None:
    """The door of the ``device_map`` argument: planned if it names a strategy, parsed once.

    Args:
        model: the model the map is for.
        device_map: a strategy name (see :data:`DEVICE_MAP_STRATEGIES`), ``{module name:
            device}``, or ``None`` (load the weights only: no plan).
        max_memory: the budget a strategy plans under (default: this machine's free memory).
        no_split_module_classes: class names a strategy keeps whole on one device.
        dtype: the dtype the weights will be loaded in (sizes for a strategy).
        offload_buffers: whether buffers of offloaded blocks are offloaded too.

    Returns:
        The :class:`~accel_bigmodel.device_plan.DevicePlan`, or ``None`` for ``None``.

    Raises:
        ValueError, TypeError: see :func:`plan_device_map` and
            :meth:`~accel_bigmodel.device_plan.DevicePlan.from_device_map`.
    """
    planned = plan_device_map(
        model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers
    )
    if planned is None:
        return None
    strategy = device_map if isinstance(device_map, str) else None
    return DevicePlan.from_device_map(planned, model, strategy=strategy)


def load_checkpoint_and_dispatch(  # noqa: PLR0913 - Accelerate's signature
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
            bad device map (one placing some blocks on ``"meta"`` and others on devices too),
            a ``max_memory`` naming a device this machine lacks, or a budget too small for the
            model when weights would have to be written to disk and no ``offload_folder`` was
            given; plus the errors of ``load_checkpoint_in_model`` and ``dispatch_model``.
        TypeError: ``device_map`` is neither a string, a mapping nor ``None``.
        accel_bigmodel.loading.plan.MissingWeightsError: with a ``device_map``, the model has
            weights on the meta device that the checkpoint lacks (named; the model is left
            unchanged, where Accelerate would load the rest and fail in ``dispatch_model``).
    """
    depth = resolve_prefetch_depth(prefetch_depth)
    # The one parse of device_map: loading, weight planning and the hooks all get this plan.
    plan = plan_devices(
        model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers
    )
    if plan is not None and plan.strategy is not None and offload_folder is None:
        _check_planned_disk_needs_no_folder(model, checkpoint, plan, max_memory, dtype)
    if plan is not None:
        _refuse_meta_beside_devices(plan)
    if offload_state_dict is None:
        offload_state_dict = plan is not None and plan.has_disk
    # The model is dispatched right after: a weight it would still lack (on meta, absent from
    # the checkpoint and from an existing offload folder) is refused before anything is loaded,
    # rather than by dispatch_model once the rest is loaded.
    folder_index = offload_folder is not None and os.path.isfile(
        os.path.join(offload_folder, INDEX_FILE)
    )
    load_checkpoint(
        model,
        checkpoint,
        LoadOptions(
            plan=plan,
            offload_folder=offload_folder,
            dtype=dtype,
            offload_state_dict=offload_state_dict,
            offload_buffers=offload_buffers,
            strict=strict,
            full_state_dict=full_state_dict,
            broadcast_from_rank0=broadcast_from_rank0,
            refuse_missing=plan is not None and not folder_index,
        ),
    )
    if plan is None:
        return model
    return dispatch_planned(
        model,
        plan,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
        prefetch_depth=depth,
    )
