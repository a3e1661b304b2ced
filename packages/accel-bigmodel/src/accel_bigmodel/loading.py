"""Loading checkpoints into models, streamed tensor by tensor under a memory bound.

:func:`load_checkpoint_in_model` takes a single checkpoint file, a sharded checkpoint's
``*.index.json``, or a folder holding either, and puts every tensor where a device map says,
with Accelerate's semantics. Unlike Accelerate it never materialises a whole shard: for each
tensor it allocates the destination and reads the bytes straight into it (through
:class:`~accel_bigmodel.safetensors_files.SafetensorsFile`), so peak memory is the model's
resident part plus one tensor. Disk-mapped weights of a safetensors checkpoint are not copied
anywhere: they are recorded in the model's offload registry (see
:func:`~accel_bigmodel.offload.register_offload_index`) and read in place later. Everything that
can be checked before the model changes (keys under ``strict``, shapes, devices, whether an
offload folder is needed) is checked first, so a bad checkpoint leaves the model as it was.

Pickled checkpoints (``.bin``/``.pt``) are only ever read with ``torch.load(weights_only=True)``.
A progress bar over the tensors is shown on a terminal (:func:`accel_state.progress.progress_bar`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from accel_state.environment import ACCEL_DISABLE_PROGRESS_BAR
from accel_state.progress import progress_bar

from .checkpoint_files import (
    _check_safetensors_format,
    _checkpoint_files,
    _is_safetensors,
    _parse_device_map,
    _torch_load,
    load_state_dict,
)
from .offload import (
    OffloadIndex,
    _forget_offloaded,
    _index_dtype_name,
    load_offloaded_weights,
    offload_weight,
    register_offload_index,
    save_offload_index,
)
from .safetensors_files import SafetensorsFile
from .tensors import (
    DeviceLike,
    Placement,
    castable,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    longest_prefix,
    module_tensor,
    retie_parameters,
    set_module_tensor_to_device,
)

__all__ = ["DISABLE_PROGRESS_BAR_ENV", "load_checkpoint_in_model", "load_state_dict"]

logger = logging.getLogger(__name__)

DISABLE_PROGRESS_BAR_ENV = ACCEL_DISABLE_PROGRESS_BAR
"""Set this environment variable to a true value to hide the shard progress bar."""

# -- the plan -----------------------------------------------------------------------------

Action = Literal["device", "disk_inplace", "disk_write", "stage_defer", "stage_write", "inplace"]


@dataclass
class _Step:
    """What to do with one checkpoint tensor."""

    name: str
    action: Action
    device: torch.device | None
    final_dtype: torch.dtype
    dtype_arg: torch.dtype | None


@dataclass
class _Layout:
    dtype: torch.dtype
    shape: tuple[int, ...]


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        candidate = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ValueError(
        f"dtype={dtype!r} is not a torch dtype: use e.g. torch.float16, 'float16' or "
        "'torch.bfloat16'."
    )


def _keeps_fp32(name: str, keep_in_fp32_modules: Sequence[str] | None) -> bool:
    return any(name == key or f"{key}." in name for key in keep_in_fp32_modules or ())


#: Maps a checkpoint key to the model's name for it, or ``None`` to leave the key out silently.
Rename = Callable[[str], "str | None"]


def _read_layouts(
    files: Sequence[str], rename: Rename | None = None
) -> tuple[list[dict[str, _Layout]], list[dict[str, str]], bool]:
    """Dtype and shape of every tensor of every file, read from headers (or mapped pickles).

    The layouts are keyed by the model's names (``rename`` of the checkpoint's); the second
    list gives, per file, the checkpoint key of each model name that ``rename`` changed.
    """
    layouts: list[dict[str, _Layout]] = []
    renamed: list[dict[str, str]] = []
    no_metadata = False
    for path in files:
        layout: dict[str, _Layout] = {}
        if _is_safetensors(path):
            with SafetensorsFile(path) as handle:
                no_metadata |= _check_safetensors_format(handle, warn=False)
                for name in handle.keys():
                    layout[name] = _Layout(handle.dtype(name), handle.shape(name))
        else:
            loaded = _torch_load(path)
            for name, value in loaded.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"checkpoint entry {name!r} in {path} is a {type(value).__name__}, not a "
                        "tensor: accel loads state dicts of tensors only."
                    )
                layout[name] = _Layout(value.dtype, tuple(value.shape))
            del loaded
        names: dict[str, str] = {}
        if rename is not None:
            kept: dict[str, _Layout] = {}
            for key, value in layout.items():
                target = rename(key)
                if target is None:
                    continue
                if target != key:
                    names[target] = key
                kept[target] = value
            layout = kept
        layouts.append(layout)
        renamed.append(names)
    return layouts, renamed, no_metadata


def _tied_partner_loaded(name: str, tied: Sequence[Sequence[str]], present: set[str]) -> bool:
    return any(name in group and any(other in present for other in group) for group in tied)


class _MissingWeightsError(RuntimeError):
    """The checkpoint lacks tensors the model has no value for (and nothing else is wrong)."""


def _validate(
    model: nn.Module,
    files: Sequence[str],
    layouts: Sequence[dict[str, _Layout]],
    model_tensors: Mapping[str, torch.Tensor],
    tied: Sequence[Sequence[str]],
    strict: bool,
    refuse_missing: bool = False,
) -> tuple[dict[str, int], set[str], list[str]]:
    """Check keys and shapes before anything changes; return (key -> file, unexpected, missing).

    ``refuse_missing``: a model tensor that the checkpoint lacks and that holds no value (it is
    on the meta device) is an error; ``strict`` refuses every missing and unexpected key.
    """
    owner: dict[str, int] = {}
    for position, layout in enumerate(layouts):
        for name in layout:
            if "SCB" not in name:
                owner[name] = position
    present = set(owner)
    unexpected = present - set(model_tensors)
    missing = [
        name
        for name in model_tensors
        if name not in present and not _tied_partner_loaded(name, tied, present)
    ]
    # Without strict, refuse_missing refuses only what would be left without a value.
    empty = [name for name in missing if model_tensors[name].device.type == "meta"]
    if (strict and (unexpected or missing)) or (refuse_missing and empty):
        parts = []
        if missing:
            parts.append(f"missing key(s): {sorted(missing if strict else empty)}")
        if unexpected and strict:
            parts.append(f"unexpected key(s): {sorted(unexpected)}")
        fix = "Pass strict=False to load the matching keys only, or use" if strict else "Use"
        raise (RuntimeError if strict else _MissingWeightsError)(
            f"Error(s) in loading the checkpoint into {type(model).__name__}: "
            f"{'; '.join(parts)}. The model was not changed. {fix} the checkpoint that "
            "belongs to this model."
        )
    mismatched = []
    for name, position in owner.items():
        target = model_tensors.get(name)
        if target is None:
            continue
        shape = layouts[position][name].shape
        if tuple(target.shape) != shape:
            mismatched.append(
                f"{name!r}: checkpoint {files[position]} has shape {shape}, the model has "
                f"{tuple(target.shape)}"
            )
    if mismatched:
        raise ValueError(
            "The checkpoint does not fit the model (the model was not changed): "
            + "; ".join(mismatched)
            + ". Check that the checkpoint belongs to this model and its configuration."
        )
    return owner, unexpected, missing


def _plan(
    owner: Mapping[str, int],
    files: Sequence[str],
    layouts: Sequence[dict[str, _Layout]],
    model_tensors: Mapping[str, torch.Tensor],
    buffer_names: set[str],
    devices: Mapping[str, Placement] | None,
    dtype: torch.dtype | None,
    offload_state_dict: bool,
    offload_buffers: bool,
    keep_in_fp32_modules: Sequence[str] | None,
) -> dict[str, _Step]:
    steps: dict[str, _Step] = {}
    missing_device = []
    for name, position in owner.items():
        current = model_tensors.get(name)
        if current is None:
            continue
        file_dtype = layouts[position][name].dtype
        safetensors = _is_safetensors(files[position])
        if devices is None:
            if current.device.type == "meta":
                steps[name] = _Step(name, "device", torch.device("cpu"), file_dtype, file_dtype)
            else:
                steps[name] = _Step(name, "inplace", current.device, current.dtype, None)
            continue
        key = longest_prefix(name, devices)
        target = None if key is None else devices[key]
        if target is None:
            missing_device.append(name)
            continue
        new_dtype = dtype
        if (
            dtype == torch.float16
            and file_dtype.is_floating_point
            and _keeps_fp32(name, keep_in_fp32_modules)
        ):
            new_dtype = torch.float32
        on_disk = target == "disk" and (offload_buffers or name not in buffer_names)
        if not castable(file_dtype):
            final = file_dtype
        elif new_dtype is not None:
            final = new_dtype
        elif on_disk:
            final = file_dtype  # as Accelerate: the offloaded copy keeps the checkpoint's dtype
        else:
            final = current.dtype  # as torch's load_state_dict: the model's dtype
        if on_disk:
            action: Action = "disk_inplace" if safetensors and final == file_dtype else "disk_write"
            steps[name] = _Step(name, action, None, final, new_dtype)
        elif target == "disk":
            # A buffer of a disk-mapped module stays in memory (the hooks keep it there).
            steps[name] = _Step(name, "device", torch.device("cpu"), final, new_dtype)
        elif target.type == "cpu" and offload_state_dict:
            action = "stage_defer" if safetensors else "stage_write"
            steps[name] = _Step(name, action, target, final, new_dtype)
        else:
            steps[name] = _Step(name, "device", target, final, new_dtype)
    if missing_device:
        raise ValueError(
            f"device_map places no module holding {sorted(missing_device)}: add an entry for "
            "them or one of their parent modules (or '' for the whole model). The model was "
            "not changed."
        )
    return steps


# -- moving bytes -------------------------------------------------------------------------


class _Staging:
    """One reusable host buffer (pinned when CUDA is available) for copies to an accelerator."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_can_pin())
        return self._buffer[:nbytes].view(dtype).view(shape)


def _can_pin() -> bool:
    return torch.cuda.is_available()


class _Source:
    """Reads the tensors of one checkpoint file into destinations chosen by the caller."""

    def __init__(
        self, path: str, staging: _Staging, renamed: Mapping[str, str] | None = None
    ) -> None:
        self.path = path
        self._staging = staging
        # model name -> checkpoint key, for the names a rename changed
        self._key = dict(renamed or {})
        self._name = {key: name for name, key in self._key.items()}
        self._safetensors: SafetensorsFile | None = None
        self._pickled: Mapping[str, Any] | None = None
        if _is_safetensors(path):
            self._safetensors = SafetensorsFile(path)
        else:
            self._pickled = _torch_load(path)

    def key(self, name: str) -> str:
        """The checkpoint key holding the model's ``name``."""
        return self._key.get(name, name)

    def order(self, names: Iterable[str]) -> list[str]:
        """``names`` (the model's) in the order their tensors lie in the file."""
        wanted = set(names)
        keys = (
            self._safetensors.keys_in_file_order()
            if self._safetensors is not None
            else list(self._pickled or ())
        )
        in_order = (self._name.get(key, key) for key in keys)
        return [name for name in in_order if name in wanted]

    def value(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on ``device`` in ``dtype`` holding the model's ``name``."""
        name = self.key(name)
        if self._safetensors is not None:
            handle = self._safetensors
            file_dtype, shape = handle.dtype(name), handle.shape(name)
            if device.type == "cpu":
                if dtype == file_dtype and handle.is_aligned(name):
                    # Zero-copy, like safetensors.torch.load_file: the weight is a
                    # copy-on-write view of the file, paged in when first used.
                    return handle.view(name)
                if dtype == file_dtype:
                    return handle.read_into(name, torch.empty(shape, dtype=dtype))
                return handle.read(name).to(dtype)
            staged = self._staging.take(file_dtype, shape)
            if staged.numel():
                handle.read_into(name, staged)
            return staged.to(device=device, dtype=dtype)
        assert self._pickled is not None
        mapped: torch.Tensor = self._pickled[name]
        if device.type == "cpu" and dtype == mapped.dtype:
            # Copy out of the file mapping so the model never depends on the checkpoint file.
            owned = torch.empty(mapped.shape, dtype=dtype)
            owned.copy_(mapped)
            return owned
        return mapped.to(device=device, dtype=dtype)

    def into(self, name: str, target: torch.Tensor) -> None:
        """Overwrite ``target`` in place with the model's ``name`` (cast and moved)."""
        name = self.key(name)
        if self._safetensors is not None:
            handle = self._safetensors
            if (
                target.device.type == "cpu"
                and target.dtype == handle.dtype(name)
                and target.is_contiguous()
            ):
                handle.read_into(name, target)
                return
            if target.device.type == "cpu":
                target.copy_(handle.read(name))
                return
            staged = self._staging.take(handle.dtype(name), handle.shape(name))
            if staged.numel():
                handle.read_into(name, staged)
            target.copy_(staged)
            return
        assert self._pickled is not None
        target.copy_(self._pickled[name])

    def close(self) -> None:
        if self._safetensors is not None:
            self._safetensors.close()
        self._pickled = None


# -- the loader ---------------------------------------------------------------------------


def _has_dtensor(model: nn.Module) -> bool:
    # A model cannot hold DTensors unless their module was imported; importing it just to
    # check would cost tens of MB.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return False
    return any(isinstance(t, dtensor) for t in model.state_dict(keep_vars=True).values())


def _load_with_dcp(
    model: nn.Module,
    files: Sequence[str],
    strict: bool,
    full_state_dict: bool,
    broadcast_from_rank0: bool,
) -> set[str]:
    """Accelerate's distributed path: per shard ``set_model_state_dict`` (DTensor / broadcast)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if broadcast_from_rank0 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "broadcast_from_rank0=True needs an initialised process group: start the processes "
            "with accel launch / torchrun and initialise PartialState() first, or pass "
            "broadcast_from_rank0=False."
        )
    model_keys = set(model.state_dict().keys())
    unexpected: set[str] = set()
    for path in files:
        reads = not broadcast_from_rank0 or dist.get_rank() == 0
        loaded: dict[str, Any] = load_state_dict(path) if reads else {}
        set_model_state_dict(
            model,
            loaded,
            options=StateDictOptions(
                full_state_dict=full_state_dict,
                strict=strict,
                broadcast_from_rank0=broadcast_from_rank0,
            ),
        )
        unexpected.update(set(loaded) - model_keys)
        del loaded
    return unexpected


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a (possibly sharded) checkpoint into ``model``, one tensor at a time.

    Without ``device_map`` the checkpoint is copied into the model's tensors where they are
    (tensors on the meta device are materialised on the CPU in the checkpoint's dtype). With
    ``device_map`` each tensor goes to the device of its longest matching module prefix, cast
    to ``dtype`` when given (floating-point tensors only; ``keep_in_fp32_modules`` stay in
    float32 when ``dtype`` is float16). ``"disk"`` tensors become meta: for a safetensors
    checkpoint without a dtype change they are read in place later (recorded with
    :func:`~accel_bigmodel.offload.register_offload_index`, nothing is written); otherwise they
    are written to ``offload_folder`` in Accelerate's format. Tied parameters are re-tied at the
    end. Call ``dispatch_model`` afterwards to run a model spread over several devices.

    Args:
        model: the model (typically built under ``init_empty_weights``).
        checkpoint: a checkpoint file, a sharded checkpoint's ``*.index.json``, or a folder with
            ``pytorch_model.bin``, ``model.safetensors`` or exactly one ``*.index.json``.
        device_map: ``{module name: device}`` (``int``, ``"cpu"``, ``"cuda:1"``, ``"disk"`` ...).
        offload_folder: where disk-mapped weights are written when they must be (``.bin``
            checkpoints, or a dtype change); not needed for safetensors checkpoints otherwise.
        dtype: cast floating-point weights to this dtype.
        offload_state_dict: keep CPU-mapped weights out of RAM until all shards are read
            (staged on disk for ``.bin`` or converted weights, read last for safetensors).
        offload_buffers: also treat buffers of disk-mapped modules as disk weights (by default
            they are loaded on the CPU).
        keep_in_fp32_modules: module names kept in float32 when ``dtype`` is float16.
        offload_8bit_bnb: bitsandbytes 8-bit offload; not supported (must be ``False``).
        strict: raise when checkpoint and model keys differ (checked before loading).
        full_state_dict: with DTensor (FSDP2) models, the checkpoint holds full tensors.
        broadcast_from_rank0: rank 0 reads the checkpoint and broadcasts it (needs a process
            group; no ``device_map``).

    Raises:
        NotImplementedError: ``offload_8bit_bnb=True``.
        ValueError: a bad checkpoint path or index, a device map that does not place some
            tensor or holds a non-device, a shape mismatch (naming the tensor and both shapes),
            disk weights that must be written without ``offload_folder``, or a bad ``dtype``.
        RuntimeError: ``strict=True`` and keys are missing or unexpected.
        pickle.UnpicklingError: a ``.bin`` file holds objects other than tensors.
    """
    if offload_8bit_bnb:
        raise NotImplementedError(
            "offload_8bit_bnb=True: accel-bigmodel does not quantise or offload bitsandbytes "
            "8-bit weights. Pass offload_8bit_bnb=False, or load the model with transformers' "
            "BitsAndBytesConfig."
        )
    _load_checkpoint(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=offload_state_dict,
        offload_buffers=offload_buffers,
        keep_in_fp32_modules=keep_in_fp32_modules,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )


def _load_checkpoint(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: Mapping[str, DeviceLike] | None,
    offload_folder: str | os.PathLike[str] | None,
    dtype: str | torch.dtype | None,
    offload_state_dict: bool,
    offload_buffers: bool,
    keep_in_fp32_modules: Sequence[str] | None,
    strict: bool,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    rename: Rename | None = None,
    refuse_missing: bool = False,
) -> None:
    """:func:`load_checkpoint_in_model`, plus ``rename`` and ``refuse_missing``.

    ``rename`` returns the model's name for a checkpoint key, or ``None`` for a key to leave
    out without a warning (a key the model's library ignores); it needs a ``device_map``.
    ``refuse_missing``: a model tensor on the meta device that the checkpoint lacks (and that
    is not tied to a loaded one) is a ``RuntimeError`` raised before the model changes.
    """
    target_dtype = _parse_dtype(dtype)
    devices = _parse_device_map(device_map) if device_map is not None else None
    if broadcast_from_rank0 and devices is not None:
        raise ValueError(
            "broadcast_from_rank0=True works without a device_map only (rank 0 reads and "
            "broadcasts a full state dict): pass device_map=None or broadcast_from_rank0=False."
        )
    tied = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied:
        logger.warning(
            "The model's configuration says some weights are tied but none are: call "
            "model.tie_weights() before loading."
        )
    if devices is not None:
        check_tied_parameters_on_same_device(tied, devices)
    checkpoint_path = os.fspath(checkpoint)
    files = _checkpoint_files(checkpoint_path)

    if devices is None and (broadcast_from_rank0 or _has_dtensor(model)):
        if rename is not None:
            raise ValueError("renaming checkpoint keys needs a device_map")
        unexpected = _load_with_dcp(model, files, strict, full_state_dict, broadcast_from_rank0)
        _warn_unexpected(unexpected, checkpoint_path, model, strict)
        return

    layouts, renamed, no_metadata = _read_layouts(files, rename)
    if no_metadata:
        logger.warning(
            "The safetensors checkpoint %s has no metadata; assuming it holds PyTorch ('pt') "
            "tensors. Save with metadata={'format': 'pt'} to silence this.",
            checkpoint_path,
        )
    model_tensors = model.state_dict(keep_vars=True)
    owner, unexpected, missing = _validate(
        model, files, layouts, model_tensors, tied, strict, refuse_missing
    )
    buffer_names = {name for name, _ in model.named_buffers()}
    steps = _plan(
        owner,
        files,
        layouts,
        model_tensors,
        buffer_names,
        devices,
        target_dtype,
        offload_state_dict,
        offload_buffers,
        keep_in_fp32_modules,
    )
    if offload_folder is None and any(s.action == "disk_write" for s in steps.values()):
        written = sorted(s.name for s in steps.values() if s.action == "disk_write")
        raise ValueError(
            "offload_folder=None, but device_map sends weights to 'disk' that must be written "
            f"to an offload folder ({written[:5]}{' ...' if len(written) > 5 else ''}: the "
            "checkpoint is not safetensors or dtype= converts them). Pass "
            "offload_folder='path/to/folder'. The model was not changed."
        )
    if offload_folder is not None and devices is not None and "disk" in devices.values():
        os.makedirs(offload_folder, exist_ok=True)
    del model_tensors

    _stream(model, files, renamed, owner, steps, offload_folder, tied)

    _warn_unexpected(unexpected, checkpoint_path, model, strict)
    if missing:
        logger.warning(
            "Some weights of %s were not in the checkpoint %s and keep their current values: %s",
            type(model).__name__,
            checkpoint_path,
            sorted(missing),
        )
    retie_parameters(model, tied)


def _warn_unexpected(unexpected: set[str], checkpoint: str, model: nn.Module, strict: bool) -> None:
    if unexpected and not strict:
        logger.warning(
            "Some weights of the checkpoint at %s were not used when initialising %s: %s. This "
            "may or may not be an issue: check that the checkpoint belongs to this model.",
            checkpoint,
            type(model).__name__,
            sorted(unexpected),
        )


def _stream(
    model: nn.Module,
    files: Sequence[str],
    renamed: Sequence[Mapping[str, str]],
    owner: Mapping[str, int],
    steps: Mapping[str, _Step],
    offload_folder: str | os.PathLike[str] | None,
    tied: Sequence[Sequence[str]],
) -> None:
    """Carry out ``steps`` shard by shard, each tensor read straight into its destination."""
    staging = _Staging()
    offload_index: OffloadIndex = {}
    registry: OffloadIndex = {}
    placed: list[str] = []
    deferred: list[_Step] = []
    stage_folder: str | None = None
    stage_index: OffloadIndex = {}
    per_file: dict[int, list[str]] = {}
    for name, position in owner.items():
        if name in steps:
            per_file.setdefault(position, []).append(name)
    try:
        with progress_bar(len(steps), "Loading checkpoint weights", "tensor") as bar:
            for position, path in enumerate(files):
                names = per_file.get(position, [])
                if names:
                    source = _Source(path, staging, renamed[position])
                    try:
                        for name in source.order(names):
                            step = steps[name]
                            if step.action == "stage_write" and stage_folder is None:
                                stage_folder = tempfile.mkdtemp(prefix="accel-stage-")
                            _apply(
                                model,
                                source,
                                step,
                                offload_folder,
                                stage_folder,
                                offload_index,
                                stage_index,
                                registry,
                                placed,
                                deferred,
                            )
                            bar.update(1)
                    finally:
                        source.close()
        _finish_deferred(model, files, renamed, owner, deferred, staging, placed)
        if stage_folder is not None:
            load_offloaded_weights(model, stage_index, stage_folder)
            placed.extend(stage_index)
    finally:
        if stage_folder is not None:
            shutil.rmtree(stage_folder, ignore_errors=True)
    if offload_index:
        assert offload_folder is not None
        save_offload_index(offload_index, offload_folder)
    resident = set(placed) | set(offload_index)
    # A tied name absent from the checkpoint follows its partner (it may have had an alias).
    resident.update(name for group in tied if resident.intersection(group) for name in group)
    _forget_offloaded(model, sorted(resident))
    if registry:
        _alias_tied_entries(registry, steps, tied)
        register_offload_index(model, registry)


def _apply(
    model: nn.Module,
    source: _Source,
    step: _Step,
    offload_folder: str | os.PathLike[str] | None,
    stage_folder: str | None,
    offload_index: OffloadIndex,
    stage_index: OffloadIndex,
    registry: OffloadIndex,
    placed: list[str],
    deferred: list[_Step],
) -> None:
    name = step.name
    cpu = torch.device("cpu")
    if step.action == "inplace":
        with torch.no_grad():
            source.into(name, module_tensor(model, name).detach())
        placed.append(name)
    elif step.action == "device":
        assert step.device is not None
        value = source.value(name, step.device, step.final_dtype)
        set_module_tensor_to_device(model, name, step.device, value=value, dtype=step.dtype_arg)
        placed.append(name)
    elif step.action == "disk_inplace":
        handle = source._safetensors
        assert handle is not None
        registry[name] = {
            "safetensors_file": os.path.abspath(source.path),
            "weight_name": source.key(name),
            "dtype": _index_dtype_name(handle.dtype(source.key(name))),
            "shape": list(handle.shape(source.key(name))),
        }
        set_module_tensor_to_device(model, name, "meta", dtype=step.final_dtype)
    elif step.action == "disk_write":
        assert offload_folder is not None
        value = source.value(name, cpu, step.final_dtype)
        offload_weight(value, name, offload_folder, index=offload_index)
        del value
        set_module_tensor_to_device(model, name, "meta", dtype=step.final_dtype)
    elif step.action == "stage_defer":
        set_module_tensor_to_device(model, name, "meta", dtype=step.final_dtype)
        deferred.append(step)
    else:
        assert stage_folder is not None
        value = source.value(name, cpu, step.final_dtype)
        offload_weight(value, name, stage_folder, index=stage_index)
        del value
        set_module_tensor_to_device(model, name, "meta", dtype=step.final_dtype)


def _finish_deferred(
    model: nn.Module,
    files: Sequence[str],
    renamed: Sequence[Mapping[str, str]],
    owner: Mapping[str, int],
    deferred: Sequence[_Step],
    staging: _Staging,
    placed: list[str],
) -> None:
    """Read the CPU weights whose loading ``offload_state_dict`` postponed to the end."""
    by_file: dict[int, list[_Step]] = {}
    for step in deferred:
        by_file.setdefault(owner[step.name], []).append(step)
    for position, file_steps in sorted(by_file.items()):
        source = _Source(files[position], staging, renamed[position])
        try:
            for step in file_steps:
                assert step.device is not None
                value = source.value(step.name, step.device, step.final_dtype)
                set_module_tensor_to_device(
                    model, step.name, step.device, value=value, dtype=step.dtype_arg
                )
                placed.append(step.name)
        finally:
            source.close()


def _alias_tied_entries(
    registry: OffloadIndex, steps: Mapping[str, _Step], tied: Sequence[Sequence[str]]
) -> None:
    """Give tied names absent from the checkpoint the in-place entry of their loaded partner."""
    for group in tied:
        source = next((registry[name] for name in group if name in registry), None)
        if source is None:
            continue
        for name in group:
            if name not in registry and name not in steps:
                registry[name] = dict(source)
