"""The load plan: what the checkpoint holds, whether it fits the model, and where each tensor goes.

Everything here reads headers (or memory-mapped pickles) and the model's meta data only; the
model does not change. :func:`read_layouts` gives each tensor's dtype and shape,
:func:`validate` refuses a checkpoint that does not fit before anything is loaded, and
:class:`Planner` turns the device map and the load options into one :class:`Step` per tensor,
which :mod:`~accel_bigmodel.loading.stream` carries out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from accel_bigmodel.device_plan import DevicePlan
from accel_bigmodel.safetensors_files import SafetensorsFile
from accel_bigmodel.tensors import castable

from .files import check_safetensors_format, is_safetensors, torch_load

Action = Literal["device", "disk_inplace", "disk_write", "stage_defer", "stage_write", "inplace"]
"""What a :class:`Step` does with its tensor (see :class:`Step`)."""

#: Maps a checkpoint key to the model's name for it, or ``None`` to leave the key out silently.
Rename = Callable[[str], "str | None"]


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint: the arguments of ``load_checkpoint_in_model``, and two more.

    ``plan`` is the ``device_map`` argument, parsed once by the entry point (``None``: load
    into the model where it is). ``rename`` returns the model's name for a checkpoint key, or
    ``None`` for a key to leave out without a warning (a key the model's library ignores); it
    needs a ``plan``. ``refuse_missing``: a model tensor on the meta device that the checkpoint
    lacks (and that is not tied to a loaded one) is an error raised before the model changes.
    """

    plan: DevicePlan | None = None
    offload_folder: str | os.PathLike[str] | None = None
    dtype: str | torch.dtype | None = None
    offload_state_dict: bool = False
    offload_buffers: bool = False
    keep_in_fp32_modules: Sequence[str] | None = None
    strict: bool = False
    full_state_dict: bool = True
    broadcast_from_rank0: bool = False
    rename: Rename | None = None
    refuse_missing: bool = False


@dataclass(frozen=True)
class Step:
    """What to do with one checkpoint tensor.

    The actions: ``"inplace"`` copies into the model's tensor where it is (no device map);
    ``"device"`` reads a new tensor onto ``device``; ``"disk_inplace"`` leaves a safetensors
    tensor in its file and records where to read it later; ``"disk_write"`` writes it to the
    offload folder; with ``offload_state_dict`` a CPU tensor is read after all others
    (``"stage_defer"``, safetensors) or written to a temporary folder first
    (``"stage_write"``, pickles).

    Attributes:
        name: the model's name of the tensor.
        action: see above.
        device: where the tensor goes (``None`` for the disk actions).
        dtype: the dtype of the model's tensor once loaded (meta tensors of disk actions get
            the dtype they will be served in).
    """

    name: str
    action: Action
    device: torch.device | None
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorLayout:
    """Dtype and shape of one checkpoint tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    """Every tensor of a checkpoint, file by file, under the model's names.

    Attributes:
        files: the checkpoint's files.
        tensors: per file, ``{model name: layout}``.
        renamed: per file, ``{model name: checkpoint key}`` for the names a rename changed.
        owner: ``{model name: position in files}`` of the tensors to load.
        no_metadata: some safetensors file had no metadata.
    """

    files: list[str]
    tensors: list[dict[str, TensorLayout]]
    renamed: list[dict[str, str]]
    owner: dict[str, int]
    no_metadata: bool


def read_layouts(files: Sequence[str], rename: Rename | None = None) -> CheckpointLayout:
    """Dtype and shape of every tensor of every file, read from headers (or mapped pickles)."""
    tensors: list[dict[str, TensorLayout]] = []
    renamed: list[dict[str, str]] = []
    no_metadata = False
    for path in files:
        layout, missing_metadata = _file_layout(path)
        no_metadata |= missing_metadata
        names: dict[str, str] = {}
        if rename is not None:
            layout = _renamed(layout, rename, names)
        tensors.append(layout)
        renamed.append(names)
    owner: dict[str, int] = {}
    for position, layout in enumerate(tensors):
        for name in layout:
            # bitsandbytes int8 checkpoints hold each weight's quantisation statistics as
            # "<weight>.SCB"; Accelerate skips them, and so does accel (it does not quantise):
            # they are neither loaded nor reported as unexpected.
            if "SCB" not in name:
                owner[name] = position
    return CheckpointLayout(list(files), tensors, renamed, owner, no_metadata)


def _file_layout(path: str) -> tuple[dict[str, TensorLayout], bool]:
    """One file's layouts by checkpoint key, and whether it is safetensors without metadata."""
    layout: dict[str, TensorLayout] = {}
    if is_safetensors(path):
        with SafetensorsFile(path) as handle:
            no_metadata = check_safetensors_format(handle, warn=False)
            for name in handle.keys():
                layout[name] = TensorLayout(handle.dtype(name), handle.shape(name))
        return layout, no_metadata
    loaded = torch_load(path)
    for name, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"checkpoint entry {name!r} in {path} is a {type(value).__name__}, not a "
                "tensor: accel loads state dicts of tensors only."
            )
        layout[name] = TensorLayout(value.dtype, tuple(value.shape))
    return layout, False


def _renamed(
    layout: Mapping[str, TensorLayout], rename: Rename, names: dict[str, str]
) -> dict[str, TensorLayout]:
    """``layout`` under the model's names; records in ``names`` the keys ``rename`` changed."""
    kept: dict[str, TensorLayout] = {}
    for key, value in layout.items():
        target = rename(key)
        if target is None:
            continue
        if target != key:
            names[target] = key
        kept[target] = value
    return kept


class MissingWeightsError(RuntimeError):
    """The checkpoint lacks tensors the model has no value for (and nothing else is wrong)."""


def _tied_partner_loaded(name: str, tied: Sequence[Sequence[str]], present: set[str]) -> bool:
    return any(name in group and any(other in present for other in group) for group in tied)


def validate(
    model: nn.Module,
    layout: CheckpointLayout,
    model_tensors: Mapping[str, torch.Tensor],
    tied: Sequence[Sequence[str]],
    options: LoadOptions,
) -> tuple[set[str], list[str]]:
    """Check keys and shapes before anything changes; return (unexpected, missing) keys.

    Raises:
        RuntimeError: ``options.strict`` and keys are missing or unexpected.
        MissingWeightsError: ``options.refuse_missing`` and some model tensor would be left
            without a value (it is on the meta device and the checkpoint lacks it).
        ValueError: a checkpoint tensor's shape differs from the model's.
    """
    present = set(layout.owner)
    unexpected = present - set(model_tensors)
    missing = [
        name
        for name in model_tensors
        if name not in present and not _tied_partner_loaded(name, tied, present)
    ]
    _check_keys(model, model_tensors, unexpected, missing, options)
    _check_shapes(layout, model_tensors)
    return unexpected, missing


def _check_keys(
    model: nn.Module,
    model_tensors: Mapping[str, torch.Tensor],
    unexpected: set[str],
    missing: list[str],
    options: LoadOptions,
) -> None:
    strict = options.strict
    # Without strict, refuse_missing refuses only what would be left without a value.
    empty = [name for name in missing if model_tensors[name].device.type == "meta"]
    if not ((strict and (unexpected or missing)) or (options.refuse_missing and empty)):
        return
    parts = []
    if missing:
        parts.append(f"missing key(s): {sorted(missing if strict else empty)}")
    if unexpected and strict:
        parts.append(f"unexpected key(s): {sorted(unexpected)}")
    fix = "Pass strict=False to load the matching keys only, or use" if strict else "Use"
    raise (RuntimeError if strict else MissingWeightsError)(
        f"Error(s) in loading the checkpoint into {type(model).__name__}: "
        f"{'; '.join(parts)}. The model was not changed. {fix} the checkpoint that "
        "belongs to this model."
    )


def _check_shapes(layout: CheckpointLayout, model_tensors: Mapping[str, torch.Tensor]) -> None:
    mismatched = []
    for name, position in layout.owner.items():
        target = model_tensors.get(name)
        if target is None:
            continue
        shape = layout.tensors[position][name].shape
        if tuple(target.shape) != shape:
            mismatched.append(
                f"{name!r}: checkpoint {layout.files[position]} has shape {shape}, the model "
                f"has {tuple(target.shape)}"
            )
    if mismatched:
        raise ValueError(
            "The checkpoint does not fit the model (the model was not changed): "
            + "; ".join(mismatched)
            + ". Check that the checkpoint belongs to this model and its configuration."
        )


def _keeps_fp32(name: str, keep_in_fp32_modules: Sequence[str] | None) -> bool:
    return any(name == key or f"{key}." in name for key in keep_in_fp32_modules or ())


@dataclass(frozen=True)
class Planner:
    """Turns the device plan and the load options into one :class:`Step` per tensor.

    Attributes:
        devices: the device plan (the parsed device map), or ``None`` to load into the model
            where it is.
        dtype: the parsed ``dtype`` option.
        options: the load options (``offload_*`` and ``keep_in_fp32_modules`` are read).
        buffer_names: the model's buffers (they stay in memory unless ``offload_buffers``).
    """

    devices: DevicePlan | None
    dtype: torch.dtype | None
    options: LoadOptions
    buffer_names: frozenset[str]

    def plan(
        self, layout: CheckpointLayout, model_tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, Step]:
        """A step for each checkpoint tensor the model has.

        Raises:
            ValueError: the device map places no module holding some tensor.
        """
        steps: dict[str, Step] = {}
        missing_device = []
        for name, position in layout.owner.items():
            current = model_tensors.get(name)
            if current is None:
                continue
            file_dtype = layout.tensors[position][name].dtype
            step = self.step(name, current, file_dtype, is_safetensors(layout.files[position]))
            if step is None:
                missing_device.append(name)
            else:
                steps[name] = step
        if missing_device:
            raise ValueError(
                f"device_map places no module holding {sorted(missing_device)}: add an entry "
                "for them or one of their parent modules (or '' for the whole model). The "
                "model was not changed."
            )
        return steps

    def step(
        self, name: str, current: torch.Tensor, file_dtype: torch.dtype, safetensors: bool
    ) -> Step | None:
        """The step for the model's ``name`` (now ``current``); ``None`` if nothing places it."""
        cpu = torch.device("cpu")
        if self.devices is None:
            if current.device.type == "meta":
                return Step(name, "device", cpu, file_dtype)
            return Step(name, "inplace", current.device, current.dtype)
        target = self.devices.placement_of(name)
        if target is None:
            return None
        if not isinstance(target, torch.device):  # its block goes to disk
            on_disk = self.options.offload_buffers or name not in self.buffer_names
            dtype = self._final_dtype(name, current, file_dtype, on_disk)
            if on_disk:
                action: Action = (
                    "disk_inplace" if safetensors and dtype == file_dtype else "disk_write"
                )
                return Step(name, action, None, dtype)
            # A buffer of a disk-mapped module stays in memory (the hooks keep it there).
            return Step(name, "device", cpu, dtype)
        dtype = self._final_dtype(name, current, file_dtype, False)
        if target.type == "cpu" and self.options.offload_state_dict:
            return Step(name, "stage_defer" if safetensors else "stage_write", target, dtype)
        return Step(name, "device", target, dtype)

    def _final_dtype(
        self, name: str, current: torch.Tensor, file_dtype: torch.dtype, on_disk: bool
    ) -> torch.dtype:
        if not castable(file_dtype):
            return file_dtype
        if (
            self.dtype == torch.float16
            and file_dtype.is_floating_point
            and _keeps_fp32(name, self.options.keep_in_fp32_modules)
        ):
            return torch.float32
        if self.dtype is not None:
            return self.dtype
        if on_disk:
            return file_dtype  # as Accelerate: the offloaded copy keeps the checkpoint's dtype
        return current.dtype  # as torch's load_state_dict: the model's dtype
