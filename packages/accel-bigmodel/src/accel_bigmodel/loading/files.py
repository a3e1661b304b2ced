"""Checkpoint files: which files make up a checkpoint, and reading one file.

A checkpoint is a single file (``.safetensors``, or a pickled ``.bin``/``.pt``), a sharded
checkpoint's ``*.index.json``, or a folder holding one of them; :func:`checkpoint_files`
resolves it to its files, checking that an index names shards inside its own folder. Pickled
files are only ever read with ``torch.load(weights_only=True)``; safetensors files go through
:class:`~accel_bigmodel.safetensors_files.SafetensorsFile`. :func:`load_state_dict` reads one
file into a dict (Accelerate's ``accelerate.utils.modeling.load_state_dict``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from accel_bigmodel.device_plan import DevicePlan
from accel_bigmodel.safetensors_files import SafetensorsFile
from accel_bigmodel.tensors import DeviceLike

__all__ = ["SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "load_state_dict"]

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "pytorch_model.bin"
"""File name of an unsharded pickled (``torch.save``) checkpoint."""
SAFE_WEIGHTS_NAME = "model.safetensors"
"""File name of an unsharded safetensors checkpoint."""


# -- reading single files -----------------------------------------------------------------


def is_safetensors(path: str) -> bool:
    """Whether ``path`` names a safetensors file (by its extension, as Accelerate decides)."""
    return path.endswith(".safetensors")


def torch_load(path: str) -> Mapping[str, Any]:
    """``torch.load`` a pickled checkpoint safely (weights only, memory-mapped when possible).

    Raises:
        pickle.UnpicklingError: the file holds objects other than tensors and containers.
        ValueError: the file is not a state dict, or is truncated, damaged or not a
            ``torch.save`` file at all (torch's own error, which names no file, is chained).
    """
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            # Files from the pre-zip serialisation cannot be memory-mapped.
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if any(sign in str(err) for sign in _DAMAGED_PICKLE):
            raise _damaged(path, err) from err
        raise pickle.UnpicklingError(
            f"{path} contains objects other than tensors and plain containers, and accel only "
            "loads pickled checkpoints with torch.load(weights_only=True). Convert the checkpoint "
            "to safetensors, or, if you trust its source, allow its classes with "
            f"torch.serialization.add_safe_globals([...]). torch said: {str(err).splitlines()[0]}"
        ) from err
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (EOFError, OSError, RuntimeError, UnicodeDecodeError) as err:
        raise _damaged(path, err) from err
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"{path} holds a {type(loaded).__name__}, not a state dict (a mapping of tensor names "
            "to tensors); save model.state_dict() instead."
        )
    return loaded


# What torch's weights-only unpickler says about bytes that are no pickle at all (a truncated or
# damaged file), as opposed to a well-formed pickle holding classes it refuses.
_DAMAGED_PICKLE = ("Unsupported operand", "truncated", "invalid load key")


def _damaged(path: str, err: BaseException) -> ValueError:
    """The error for a pickled checkpoint torch cannot read (torch's own names no file)."""
    lines = str(err).splitlines()
    # For weights-only reads torch's first line is generic; the unpickler's line says what broke.
    first = lines[0] if lines else ""
    said = next((line.strip() for line in lines if "Unsupported" in line), first)
    return ValueError(
        f"{path} is not a readable PyTorch checkpoint: torch.load failed "
        f"({type(err).__name__}: {said or 'the file ended early'}). The file is truncated or "
        "damaged: download or save it again, or convert the checkpoint to safetensors."
    )


def check_safetensors_format(handle: SafetensorsFile, warn: bool = True) -> bool:
    """Apply Accelerate's metadata rule; return whether the file had no metadata at all."""
    metadata = handle.metadata
    if metadata is None:
        if warn:
            logger.warning(
                "The safetensors file %s has no metadata; assuming it holds PyTorch ('pt') "
                "tensors. Save with metadata={'format': 'pt'} to silence this.",
                handle.path,
            )
        return True
    file_format = metadata.get("format")
    if file_format not in ("pt", "tf", "flax"):
        raise OSError(
            f"The safetensors file {handle.path} has metadata format={file_format!r}; expected "
            "'pt'. Save it with safetensors.torch.save_file(..., metadata={'format': 'pt'})."
        )
    if file_format != "pt":
        raise ValueError(
            f"The safetensors file {handle.path} was saved with format={file_format!r}; accel "
            "loads PyTorch checkpoints ('pt'). Convert it to PyTorch first."
        )
    return False


def load_state_dict(
    checkpoint_file: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
) -> dict[str, torch.Tensor]:
    """Load one checkpoint file into a dict of tensors.

    A safetensors file is read tensor by tensor; with a ``device_map`` each tensor goes to the
    device of its module (longest matching prefix; ``"disk"`` and unmapped tensors stay on
    the CPU). Any other file is read with ``torch.load(weights_only=True, mmap=True)`` onto the
    CPU.

    Args:
        checkpoint_file: the file.
        device_map: ``{module name: device}``; optional.

    Raises:
        OSError / ValueError: a safetensors file whose metadata says it is not a PyTorch file.
        TypeError: ``device_map`` is not a mapping of module names.
        ValueError: a device in ``device_map`` is not a device, or the file is malformed.
        pickle.UnpicklingError: a pickled file holds objects other than tensors.
    """
    path = os.fspath(checkpoint_file)
    if not is_safetensors(path):
        return dict(torch_load(path))
    plan = DevicePlan.from_device_map(device_map) if device_map is not None else None
    result: dict[str, torch.Tensor] = {}
    with SafetensorsFile(path) as handle:
        check_safetensors_format(handle)
        for name in handle.keys_in_file_order():
            value = handle.read(name)
            target = None if plan is None else plan.placement_of(name)
            if isinstance(target, torch.device) and target.type not in ("cpu", "meta"):
                value = value.to(target)
            result[name] = value
    return {name: result[name] for name in sorted(result)}


# -- resolving a checkpoint ---------------------------------------------------------------


def checkpoint_files(checkpoint: str) -> list[str]:
    """The files making up ``checkpoint`` (a file, an index, or a folder)."""
    index_file: str | None = None
    if os.path.isfile(checkpoint):
        if checkpoint.endswith(".json"):
            index_file = checkpoint
        else:
            return [checkpoint]
    elif os.path.isdir(checkpoint):
        entries = os.listdir(checkpoint)
        if WEIGHTS_NAME in entries:
            return [os.path.join(checkpoint, WEIGHTS_NAME)]
        if SAFE_WEIGHTS_NAME in entries:
            return [os.path.join(checkpoint, SAFE_WEIGHTS_NAME)]
        indexes = sorted(name for name in entries if name.endswith(".index.json"))
        if not indexes:
            raise ValueError(
                f"checkpoint={checkpoint!r} is a folder without {WEIGHTS_NAME}, "
                f"{SAFE_WEIGHTS_NAME} or a '*.index.json' file: pass the checkpoint file itself, "
                "a sharded checkpoint's index, or the folder that holds them."
            )
        if len(indexes) > 1:
            raise ValueError(
                f"checkpoint={checkpoint!r} holds more than one '.index.json' file ({indexes}): "
                "delete the irrelevant ones or pass the index file you mean."
            )
        index_file = os.path.join(checkpoint, indexes[0])
    else:
        raise ValueError(
            f"checkpoint={checkpoint!r} does not exist: pass a file holding a whole state dict, "
            "the '.index.json' of a sharded checkpoint, or a folder holding either."
        )
    return _files_of_index(index_file)


def _files_of_index(index_file: str) -> list[str]:
    try:
        with open(index_file, encoding="utf-8") as handle:
            index = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"checkpoint index {index_file} is not valid JSON ({err}): download it again, or "
            "pass the checkpoint's files instead."
        ) from None
    if isinstance(index, dict) and "weight_map" in index:
        index = index["weight_map"]
    if not isinstance(index, dict) or not all(isinstance(v, str) for v in index.values()):
        raise ValueError(
            f"checkpoint index {index_file} must map tensor names to shard file names (under "
            "'weight_map'), e.g. {'weight_map': {'lm.weight': 'model-00001-of-00002.safetensors'}}"
            ": fix the index or download it again."
        )
    folder = os.path.dirname(index_file)
    files = []
    for shard in sorted(set(index.values())):
        normal = os.path.normpath(shard)
        if os.path.isabs(shard) or normal == ".." or normal.startswith(".." + os.sep):
            raise ValueError(
                f"checkpoint index {index_file} names the shard {shard!r}, outside its folder: "
                "shard names must be relative to the index's folder; fix the index."
            )
        path = os.path.join(folder, normal)
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint index {index_file} names the shard {shard!r} but {path} does not "
                "exist: download the missing shard or fix the index."
            )
        files.append(path)
    return files
