"""The offload folder format: names, dtypes and paths, the index, and checking an entry.

An offload folder holds one raw, C-ordered ``<dotted.name>.dat`` file per tensor and an
``index.json`` mapping each name to ``{"dtype": ..., "shape": [...]}`` (Accelerate's layout), or
to ``{"safetensors_file": ..., "weight_name": ..., "dtype": ..., "shape": [...]}`` for a weight
read in place from a safetensors file. This module owns what every reader and writer of that
format shares: the dtype names, the paths (confined to the folder), reading and validating an
on-disk ``index.json``, and :func:`check_dat_entry` / :func:`check_safetensors_entry` /
:func:`check_fits`, which check, reading headers and file sizes only, that an entry's file holds
what the entry says and that it can fill a given model tensor. :mod:`.offload` builds the
writers and the weight maps on it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .safetensors_files import SafetensorsFile
from .tensors import castable

__all__ = [
    "INDEX_FILE",
    "OffloadIndex",
    "WeightInfo",
    "check_dat_entry",
    "check_fits",
    "check_safetensors_entry",
    "check_weight_name",
    "dat_path",
    "dtype_from_index",
    "entry_layout",
    "index_dtype_name",
    "read_disk_index",
    "shape_from_index",
]

INDEX_FILE = "index.json"
"""Name of the index inside an offload folder."""

WeightInfo = dict[str, Any]
OffloadIndex = dict[str, WeightInfo]

# -- names, dtypes and paths --------------------------------------------------------------


def index_dtype_name(dtype: torch.dtype) -> str:
    """The dtype name written to ``index.json`` (numpy's name; ``bfloat16``/``float8_*`` as is)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_index(name: Any, entry: str) -> torch.dtype:
    """The torch dtype an index entry names (``"float16"``); ``ValueError`` naming the entry."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"offload index entry {entry!r} has dtype {name!r}, which is not a torch dtype name: "
            "use a name such as 'float32', 'bfloat16', 'int64' or 'bool'."
        )
    return dtype


def shape_from_index(shape: Any, entry: str) -> tuple[int, ...]:
    """The shape an index entry gives (a list of ints >= 0); ``ValueError`` naming the entry."""
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(
            f"offload index entry {entry!r} has shape {shape!r}: a shape is a list of "
            "integers >= 0 (e.g. [4096, 4096], or [] for a 0-d tensor)."
        )
    return tuple(shape)


def check_weight_name(weight_name: Any, folder: str | os.PathLike[str] | None) -> str:
    """Refuse a weight name that cannot be a file name inside the offload folder."""
    where = f" in the offload folder {os.fspath(folder)!r}" if folder is not None else ""
    if not isinstance(weight_name, str) or not weight_name:
        raise ValueError(
            f"weight_name={weight_name!r} is not a tensor name{where}: use the dotted name of "
            "the tensor, e.g. 'model.layers.0.mlp.weight'."
        )
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (
        any(sep in weight_name for sep in separators)
        or weight_name in (".", "..")
        or "\x00" in weight_name
    ):
        raise ValueError(
            f"weight name {weight_name!r}{where} would leave the folder (it contains a path "
            "separator, '..' or NUL): offloaded tensors are stored as '<dotted.name>.dat' inside "
            "the folder, so use the tensor's dotted name."
        )
    return weight_name


def _inside(folder: str, path: str) -> bool:
    root = os.path.realpath(folder)
    resolved = os.path.realpath(path)
    return resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep)


def dat_path(folder: str | os.PathLike[str], weight_name: str) -> str:
    """The ``.dat`` file of a weight in an offload folder."""
    return os.path.join(os.fspath(folder), f"{weight_name}.dat")


def _escape_error(entry: str, target: str, folder: str, index_file: str) -> ValueError:
    return ValueError(
        f"offload index {index_file}: entry {entry!r} points to {target!r}, which is outside the "
        f"offload folder {folder!r}. An offload index may only name files inside its folder "
        "(no absolute paths, '..' or symlinks leading out); regenerate the folder with "
        "offload_state_dict() or disk_offload(), or remove the entry from index.json."
    )


def _validate_disk_index(raw: Any, folder: str, index_file: str) -> OffloadIndex:
    """Check every entry of an on-disk index and return a copy with resolved file paths."""
    if not isinstance(raw, dict):
        raise ValueError(
            f"offload index {index_file} holds a JSON {type(raw).__name__}, not an object "
            "mapping tensor names to {'dtype', 'shape'}: regenerate the offload folder."
        )
    checked: OffloadIndex = {}
    for name, info in raw.items():
        if not isinstance(info, dict):
            raise ValueError(
                f"offload index {index_file}: entry {name!r} is {info!r}, not an object with "
                "'dtype' and 'shape': regenerate the offload folder."
            )
        entry = dict(info)
        target = entry.get("safetensors_file")
        if target is not None:
            if not isinstance(target, str) or not target:
                raise ValueError(
                    f"offload index {index_file}: entry {name!r} has safetensors_file "
                    f"{target!r}; it must be a file name relative to the folder."
                )
            candidate = os.path.normpath(target)
            if (
                os.path.isabs(target)
                or candidate == ".."
                or candidate.startswith(".." + os.sep)
                or not _inside(folder, os.path.join(folder, target))
            ):
                raise _escape_error(name, target, folder, index_file)
            entry["safetensors_file"] = os.path.join(os.path.realpath(folder), candidate)
        else:
            try:
                check_weight_name(name, folder)
            except ValueError:
                raise _escape_error(name, f"{name}.dat", folder, index_file) from None
            if not _inside(folder, dat_path(folder, name)):
                raise _escape_error(name, f"{name}.dat", folder, index_file)
            dtype_from_index(entry.get("dtype"), name)
            shape_from_index(entry.get("shape"), name)
        checked[name] = entry
    return checked


def read_disk_index(folder: str | os.PathLike[str]) -> OffloadIndex:
    """Read and validate ``folder/index.json`` (see the module docstring).

    Raises:
        FileNotFoundError: the folder has no ``index.json``.
        ValueError: it is not valid JSON, not an object, or an entry is malformed or would
            leave the folder.
    """
    folder = os.fspath(folder)
    index_file = os.path.join(folder, INDEX_FILE)
    try:
        with open(index_file, encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{index_file} does not exist: save_folder must be an offload folder written by "
            "offload_state_dict() / load_checkpoint_in_model(), or pass index= explicitly."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"offload index {index_file} is not valid JSON ({err}): regenerate the offload folder."
        ) from None
    return _validate_disk_index(raw, folder, index_file)


def entry_layout(weight_info: Any, entry: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape an index entry describes; a malformed entry is a ``ValueError``."""
    if not isinstance(weight_info, Mapping):
        raise ValueError(
            f"weight_info for {entry!r} is {weight_info!r}: expected "
            "{'dtype': ..., 'shape': [...]}."
        )
    return (
        dtype_from_index(weight_info.get("dtype"), entry),
        shape_from_index(weight_info.get("shape"), entry),
    )


# -- checking an entry before it is read ------------------------------------------------------

Layout = tuple[tuple[int, ...], torch.dtype, str]
"""``(shape, dtype, where it comes from)`` of a weight, as the checks below report it."""


def check_dat_entry(key: str, info: Mapping[str, Any], folder: str) -> Layout:
    """Check that ``folder/<key>.dat`` exists and holds exactly the bytes its entry describes.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a malformed entry, or a file shorter or longer than the entry needs.
    """
    dtype, shape = entry_layout(info, key)
    path = dat_path(folder, key)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"offload index entry {key!r} is read from {path}, which does not exist: the "
            f"offload folder {folder!r} is incomplete. Offload the weights again (or remove "
            "the entry from its index.json)."
        ) from None
    needed = math.prod(shape) * dtype.itemsize
    # Accelerate's writer leaves one byte for an empty tensor; anything else is exact.
    if needed and size != needed:
        raise ValueError(
            f"offloaded weight file {path} has {size} bytes but its index entry "
            f"({index_dtype_name(dtype)}, shape {list(shape)}) needs {needed}: the file or the "
            "index is truncated or stale. Offload the weights again."
        )
    return shape, dtype, f"offload index entry {key!r} ({path})"


def check_safetensors_entry(
    key: str, info: Mapping[str, Any], open_file: Callable[[str], SafetensorsFile]
) -> Layout:
    """Check that an in-place entry's safetensors file exists and holds its tensor and shape.

    Args:
        key: the entry's name.
        info: the entry (``safetensors_file``, optional ``weight_name``, ``dtype``, ``shape``).
        open_file: opens (or returns the already open) reader of a path.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a valid safetensors file, lacks the tensor, or holds it
            with another shape than the entry says.
    """
    path = os.fspath(info["safetensors_file"])
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"offload index entry {key!r} is read in place from {path}, which does not exist: "
            "put the checkpoint file back, or load the checkpoint again from where it is now."
        )
    handle = open_file(path)
    weight_name = info.get("weight_name", key)
    if not isinstance(weight_name, str) or weight_name not in handle:
        raise ValueError(
            f"offload index entry {key!r} reads the tensor {weight_name!r} of {path}, which that "
            "file does not hold: the index is stale; load the checkpoint again."
        )
    shape = handle.shape(weight_name)
    if "shape" in info and shape_from_index(info["shape"], key) != shape:
        raise ValueError(
            f"offload index entry {key!r} says shape {info['shape']!r} but {path} holds "
            f"{weight_name!r} with shape {list(shape)}: the index is stale; load the checkpoint "
            "again."
        )
    dtype = handle.dtype(weight_name)
    if info.get("dtype") is not None:
        dtype = dtype_from_index(info["dtype"], key)
    return shape, dtype, f"offload index entry {key!r} ({path})"


def check_fits(layout: Layout, name: str, target: torch.Tensor) -> None:
    """Refuse a weight whose shape, or kind of dtype, cannot fill the model's ``target``.

    Floating-point values are cast to the model's dtype on load; an integer value cannot fill
    a floating-point tensor, nor the other way round.

    Raises:
        ValueError: naming where the weight comes from, the model's ``name`` and both values.
    """
    shape, dtype, origin = layout
    if shape != tuple(target.shape):
        raise ValueError(
            f"{origin} has shape {list(shape)} but the model's {name!r} has shape "
            f"{list(target.shape)}: these offloaded weights belong to another model or "
            "configuration. Offload this model's weights again (or fix the entry)."
        )
    if castable(dtype) != castable(target.dtype):
        raise ValueError(
            f"{origin} holds {dtype} values but the model's {name!r} is {target.dtype}: a "
            "floating-point weight cannot fill an integer tensor or the other way round. "
            "Offload this model's weights again (or fix the entry's dtype)."
        )
