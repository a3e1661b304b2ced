"""Model weight files: split a state dict into shards, write them safely, read them back.

This is the file-level half of ``Accelerator.save_model``: once the (unwrapped, gathered)
state dict is in hand, :func:`save_model_files` decides the shard layout with
:func:`split_state_dict_into_shards`, removes shards left over from an earlier, larger save,
and writes every file atomically (:mod:`accel_state.files`), so a crash never leaves a
half-written file under a final name. The layout is the one Accelerate and ``transformers``
use:

* one file: ``model.safetensors`` (or ``pytorch_model.bin``);
* several files: ``model-00001-of-00003.safetensors``, ... plus ``model.safetensors.index.json``
  (or ``pytorch_model-00001-of-00003.bin``, ... plus ``pytorch_model.bin.index.json``), whose
  ``weight_map`` says which file holds each tensor.

:func:`load_model_files` reads either layout back into one state dict, preferring safetensors,
and loads pickled ``.bin`` files only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from accel_bigmodel.loading.files import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from accel_state.files import atomic_path, atomic_write
from accel_state.progress import progress_bar
from accel_state.serialization import clean_state_dict_for_safetensors

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "ShardPlan",
    "load_model_files",
    "parse_size",
    "save_model_files",
    "split_state_dict_into_shards",
]

SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
"""Shard file name pattern of a safetensors save (``suffix`` is ``""`` or ``-0000i-of-0000n``)."""
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
"""Index file of a sharded safetensors save."""
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
"""Shard file name pattern of a pickled save."""
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
"""Index file of a sharded pickled save."""

_SAFETENSORS_INSTALL = 'pip install "accel-state[safetensors]"'

_SIZE_UNITS: dict[str, int] = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^(?P<number>.*?)\s*(?P<unit>[kmgt]i?b)$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


def _size_error(size: object) -> ValueError:
    return ValueError(
        f"max_shard_size={size!r} is not a valid size: pass a number of bytes (int >= 0) or a "
        "string with a unit, e.g. '10GB', '500MB', '1.5GB' (decimal units KB, MB, GB, TB) or "
        "'5GiB', '512MiB' (binary units KiB, MiB, GiB, TiB); units are case-insensitive"
    )


# Two size grammars on purpose. This one reads ``max_shard_size`` as huggingface_hub and
# ``save_pretrained`` do, where every unit counts bytes ("5Gb" is 5 GB). The other,
# ``accel_bigmodel.sizes.convert_file_size_to_int``, reads ``max_memory`` and friends as
# Accelerate does, where a lowercase final "b" counts bits ("8Gb" is 1 GB). Each keeps the
# meaning its callers' scripts were written for, so they must not be merged.
def parse_size(size: int | str) -> int:
    """Turn a shard size such as ``"10GB"`` or ``"5GiB"`` into a number of bytes.

    ``KB``/``MB``/``GB``/``TB`` are decimal (powers of 1000), ``KiB``/``MiB``/``GiB``/``TiB``
    binary (powers of 1024), as in huggingface_hub; units are case-insensitive and the number
    may have a fractional part (the byte count is rounded down). An ``int`` is returned
    unchanged.

    Args:
        size: A number of bytes, or a string made of a number and a unit.

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``size`` is a negative int, or a string that is not a non-negative number
            followed by a supported unit.
        TypeError: ``size`` is neither an int nor a string.

    Example:
        >>> parse_size("5MB"), parse_size("1GiB"), parse_size(1024)
        (5000000, 1073741824, 1024)
    """
    if isinstance(size, bool):
        raise _size_error(size)
    if isinstance(size, int):
        if size < 0:
            raise _size_error(size)
        return size
    if not isinstance(size, str):
        raise TypeError(
            f"max_shard_size must be an int (bytes) or a string such as '10GB', got "
            f"{type(size).__name__} {size!r}"
        )
    match = _SIZE_RE.match(size.strip())
    if match is None:
        raise _size_error(size)
    try:
        number = Decimal(match["number"])
    except InvalidOperation:
        raise _size_error(size) from None
    if not number.is_finite() or number < 0:
        raise _size_error(size)
    return int(number * _SIZE_UNITS[match["unit"].upper()])


# ---------------------------------------------------------------------------------------------
# Shard plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    """Which file each tensor of a state dict goes to.

    Attributes:
        filename_to_tensors: File name -> names of the tensors it holds, in file order.
        tensor_to_filename: Tensor name -> file name (the index's ``weight_map``).
        metadata: ``{"total_size": bytes}``, the index's ``metadata``; tensors that share
            storage are counted once.
        is_sharded: Whether the plan has more than one file (and so needs an index).
    """

    filename_to_tensors: dict[str, list[str]]
    tensor_to_filename: dict[str, str]
    metadata: dict[str, Any]
    is_sharded: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_sharded", len(self.filename_to_tensors) > 1)


def _storage_identity(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Identify the memory a tensor lives in, or None where sharing cannot be told."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        return (str(tensor.device), storage.data_ptr())
    except (RuntimeError, NotImplementedError, AttributeError):
        # Tensor subclasses without a plain storage (sparse, some wrappers): never grouped.
        return None


def _split_pattern(filename_pattern: str) -> tuple[str, str]:
    if filename_pattern.count("{suffix}") != 1:
        raise ValueError(
            f"filename_pattern={filename_pattern!r} must contain '{{suffix}}' exactly once, "
            "e.g. 'model{suffix}.safetensors'"
        )
    prefix, ext = filename_pattern.split("{suffix}")
    return prefix, ext


def _shard_name(filename_pattern: str, suffix: str) -> str:
    prefix, ext = _split_pattern(filename_pattern)
    return f"{prefix}{suffix}{ext}"


def split_state_dict_into_shards(
    state_dict: Mapping[str, Any],
    max_shard_size: int | str = "10GB",
    filename_pattern: str = SAFE_WEIGHTS_PATTERN_NAME,
) -> ShardPlan:
    """Plan how a state dict is split into files of at most ``max_shard_size`` bytes.

    Tensors are taken in state-dict order and added to the current shard until the next one
    would push it over ``max_shard_size``; then a new shard starts. There is no bin packing,
    so the output is the one huggingface_hub's ``split_torch_state_dict_into_shards`` gives:
    a tensor larger than ``max_shard_size`` gets a shard of its own, which is placed at once
    (before the shard still being filled); tensors that share storage (tied weights) are
    counted once and go to the shard of the first of them, after that shard's other tensors.
    A tensor's size is its own ``numel * element_size``. Values that are not tensors are left
    out of the plan.

    One shard is named ``filename_pattern`` with an empty suffix (``model.safetensors``);
    several are suffixed ``-{i:05d}-of-{n:05d}`` counting from 1
    (``model-00001-of-00003.safetensors``). An empty state dict gives one empty file.

    Args:
        state_dict: Tensor names to tensors.
        max_shard_size: Largest shard, in bytes or as a string such as ``"10GB"`` (see
            :func:`parse_size`).
        filename_pattern: File name with a ``{suffix}`` placeholder.

    Returns:
        The plan.

    Raises:
        ValueError: ``max_shard_size`` is not a valid size, or ``filename_pattern`` lacks
            ``{suffix}``.
    """
    limit = parse_size(max_shard_size)
    _split_pattern(filename_pattern)

    tied: dict[tuple[str, int], list[str]] = {}
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    total_size = 0
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        identity = _storage_identity(value)
        if identity is not None:
            if identity in tied:
                tied[identity].append(name)
                continue
            tied[identity] = [name]
        size = value.numel() * value.element_size()
        total_size += size
        if size > limit:
            shards.append([name])
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current = []
            current_size = 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)

    # Tensors that share storage with an earlier one join that one's shard.
    shard_of = {name: index for index, shard in enumerate(shards) for name in shard}
    for names in tied.values():
        shards[shard_of[names[0]]].extend(names[1:])

    count = len(shards)
    filename_to_tensors: dict[str, list[str]] = {}
    tensor_to_filename: dict[str, str] = {}
    for index, shard in enumerate(shards):
        suffix = "" if count == 1 else f"-{index + 1:05d}-of-{count:05d}"
        filename = _shard_name(filename_pattern, suffix)
        if count == 1:
            # One file holds everything: list it in state-dict order.
            in_plan = set(shard)
            shard = [name for name in state_dict if name in in_plan]
        filename_to_tensors[filename] = shard
        for name in shard:
            tensor_to_filename[name] = filename
    return ShardPlan(
        filename_to_tensors=filename_to_tensors,
        tensor_to_filename=tensor_to_filename,
        metadata={"total_size": total_size},
    )


# ---------------------------------------------------------------------------------------------
# save_model_files
# ---------------------------------------------------------------------------------------------


def _shard_regex(filename_pattern: str) -> re.Pattern[str]:
    prefix, ext = _split_pattern(filename_pattern)
    return re.compile(re.escape(prefix) + r"-\d{5}-of-\d{5}" + re.escape(ext))


def _remove_stale_files(directory: str, plan: ShardPlan, pattern: str, index_name: str) -> None:
    """Delete weight files of an earlier save that the new plan does not overwrite."""
    shard_re = _shard_regex(pattern)
    single_name = _shard_name(pattern, "")
    stale: list[str] = []
    for name in os.listdir(directory):
        if name in plan.filename_to_tensors:
            continue
        if shard_re.fullmatch(name) is not None:
            stale.append(name)
        elif name == index_name and not plan.is_sharded:
            stale.append(name)
        elif name == single_name and plan.is_sharded:
            stale.append(name)
    for name in stale:
        full = os.path.join(directory, name)
        if os.path.isfile(full) or os.path.islink(full):
            os.remove(full)


def _check_tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    on_meta = [
        name
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor) and value.device.type == "meta"
    ]
    if on_meta:
        shown = ", ".join(on_meta[:10]) + (
            f", ... ({len(on_meta)} in all)" if len(on_meta) > 10 else ""
        )
        raise ValueError(
            f"cannot save the model: tensors {shown} are on the meta device and hold no data. "
            "Load real weights first (e.g. load_checkpoint_in_model) or move the model off "
            "'meta' with model.to_empty(device=...) and initialise it."
        )
    skipped = [name for name, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    if skipped:
        warnings.warn(
            f"save_model_files: entries {skipped[:10]} of the state dict are not tensors and "
            "are not saved.",
            stacklevel=3,
        )
    return {name: value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}


def _shard_writer(safe_serialization: bool) -> Callable[[dict[str, torch.Tensor], str], None]:
    """How one shard file is written: safetensors with its ``format`` metadata, or torch.save.

    Raises:
        ImportError: ``safe_serialization`` is set and safetensors is not installed.
    """
    if not safe_serialization:

        def pickle(shard: dict[str, torch.Tensor], path: str) -> None:
            torch.save(shard, path)

        return pickle
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(
            f"save_model_files(safe_serialization=True) needs safetensors: "
            f"{_SAFETENSORS_INSTALL} (or pass safe_serialization=False to write pickles)"
        ) from None

    def safetensors(shard: dict[str, torch.Tensor], path: str) -> None:
        save_file(shard, path, metadata={"format": "pt"})

    return safetensors


def save_model_files(
    state_dict: Mapping[str, Any],
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    is_main_process: bool = True,
    materialize: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> list[str]:
    """Write a model's state dict to ``save_directory`` as one file or as shards plus an index.

    This is what ``Accelerator.save_model`` does once it holds the state dict. With
    ``safe_serialization`` the files are ``model.safetensors`` or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (tied weights are
    saved once; re-tie them after loading); otherwise ``pytorch_model.bin`` or
    ``pytorch_model-0000i-of-0000n.bin`` + ``pytorch_model.bin.index.json`` written with
    ``torch.save``. The index is ``{"metadata": {"total_size": N}, "weight_map": {tensor:
    file}}`` as JSON with sorted keys, indent 2 and a final newline.

    Only the main process touches the disk. It creates the directory, deletes shard files of
    the same format left by an earlier save that the new one does not replace (and the stale
    index when the new save is one file, or the stale single file when it is sharded), then
    writes each file atomically: a crash leaves no partial file under a final name. The index
    is written last. Other files in the directory are left alone. Checks run on every process,
    so all processes fail alike.

    Args:
        state_dict: Tensor names to tensors (entries that are not tensors are skipped with a
            warning).
        save_directory: Directory to write into; created if missing.
        max_shard_size: Largest shard, in bytes or as a string such as ``"10GB"`` or ``"5GiB"``.
        safe_serialization: Write safetensors (the default) instead of pickles.
        is_main_process: Whether this process writes; others only validate and return ``[]``.
        materialize: For sharded tensors (FSDP2 DTensors): called on every process with one
            shard file's tensors at a time (a collective), it returns their full CPU
            tensors on the main process, so no process ever holds more than one file's
            tensors in full. The plan is made from the tensors' global shapes.

    Returns:
        The names (not paths) of the files written, shards first, then the index if any;
        ``[]`` on other processes.

    Raises:
        ValueError: ``save_directory`` exists and is not a directory; some tensors are on the
            meta device; ``max_shard_size`` is not a valid size.
        ImportError: ``safe_serialization`` is set and safetensors is not installed.
    """
    directory = os.fspath(save_directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(
            f"save_directory={directory!r} exists and is not a directory: model files are "
            "written into a directory; pass a directory path"
        )
    tensors = _check_tensors(state_dict)
    parse_size(max_shard_size)
    write_shard = _shard_writer(safe_serialization)
    if not is_main_process and materialize is None:
        return []

    if safe_serialization:
        if materialize is None:
            tensors = clean_state_dict_for_safetensors(tensors)
        pattern, index_name = SAFE_WEIGHTS_PATTERN_NAME, SAFE_WEIGHTS_INDEX_NAME
    else:
        pattern, index_name = WEIGHTS_PATTERN_NAME, WEIGHTS_INDEX_NAME
    plan = split_state_dict_into_shards(tensors, max_shard_size, pattern)

    if is_main_process:
        os.makedirs(directory, exist_ok=True)
        _remove_stale_files(directory, plan, pattern, index_name)

    written: list[str] = []
    with progress_bar(len(plan.filename_to_tensors), "Saving model shards", "shard") as bar:
        for filename, names in plan.filename_to_tensors.items():
            shard = {name: tensors[name] for name in names}
            if materialize is not None:
                shard = materialize(shard)
                if not is_main_process:
                    continue
                if safe_serialization:
                    shard = clean_state_dict_for_safetensors(shard)
            with atomic_path(os.path.join(directory, filename)) as temporary:
                write_shard(shard, temporary)
            written.append(filename)
            bar.update(1)

    if not is_main_process:
        return []
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        atomic_write(os.path.join(directory, index_name), text)
        written.append(index_name)
    return written


# ---------------------------------------------------------------------------------------------
# load_model_files
# ---------------------------------------------------------------------------------------------


def _read_index(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as stream:
            index = json.load(stream)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"index file {index_path!r} is not valid JSON: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f"index file {index_path!r} has no valid 'weight_map' (a mapping of tensor names "
            "to shard file names): the file is corrupt or not a model index"
        )
    for filename in set(weight_map.values()):
        if (
            not filename
            or filename in (".", "..")
            or os.path.basename(filename) != filename
            or "/" in filename
            or "\\" in filename
        ):
            raise ValueError(
                f"index file {index_path!r} names shard {filename!r}, which is not a plain file "
                "name in the same directory; refusing to read outside the checkpoint directory"
            )
    return weight_map


def _read_weights(path: str, safetensors_file: bool) -> dict[str, torch.Tensor]:
    try:
        if safetensors_file:
            from safetensors.torch import load_file

            loaded: object = load_file(path, device="cpu")
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except ImportError:
        raise ImportError(f"reading {path!r} needs safetensors: {_SAFETENSORS_INSTALL}") from None
    except OSError:
        raise
    except Exception as err:
        raise ValueError(f"could not read weights file {path!r}: {err}") from err
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise ValueError(
            f"weights file {path!r} does not hold a mapping of names to tensors "
            f"(got {type(loaded).__name__})"
        )
    return dict(loaded)


def load_model_files(save_directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read back the weights that :func:`save_model_files` (or Accelerate's ``save_model``) wrote.

    The first of these found in ``save_directory`` is read: ``model.safetensors``,
    ``model.safetensors.index.json`` (+ its shards), ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json`` (+ its shards). Pickled files are loaded with
    ``torch.load(weights_only=True)``, so they cannot run code. For a sharded save every shard
    named in the index is checked to exist before any is read. Tensors are loaded on CPU;
    tied weights saved as safetensors come back once, so re-tie them after
    ``load_state_dict(strict=False)``.

    Args:
        save_directory: The directory written by :func:`save_model_files`.

    Returns:
        Tensor names to tensors.

    Raises:
        FileNotFoundError: The directory, its weights, or shards named by the index are missing
            (the message names them).
        ValueError: The index is corrupt or names a file outside the directory, a weights file
            cannot be parsed, or a shard lacks a tensor the index assigns to it.
        ImportError: The weights are safetensors and safetensors is not installed.
    """
    directory = os.fspath(save_directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"save_directory={directory!r} is not a directory: pass the directory that "
            "save_model wrote"
        )
    candidates = (
        (SAFE_WEIGHTS_NAME, True, False),
        (SAFE_WEIGHTS_INDEX_NAME, True, True),
        (WEIGHTS_NAME, False, False),
        (WEIGHTS_INDEX_NAME, False, True),
    )
    for name, safetensors_file, is_index in candidates:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if not is_index:
            return _read_weights(path, safetensors_file)
        return _load_sharded(directory, path, safetensors_file)
    raise FileNotFoundError(
        f"no model weights in {directory!r}: expected one of "
        f"{', '.join(name for name, _, _ in candidates)}"
    )


def _load_sharded(
    directory: str, index_path: str, safetensors_file: bool
) -> dict[str, torch.Tensor]:
    weight_map = _read_index(index_path)
    filenames = sorted(set(weight_map.values()))
    missing = [f for f in filenames if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(
            f"checkpoint in {directory!r} is incomplete: shard(s) {missing} named by "
            f"{os.path.basename(index_path)} are missing"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for filename in filenames:
        path = os.path.join(directory, filename)
        loaded = _read_weights(path, safetensors_file)
        expected = [name for name, f in weight_map.items() if f == filename]
        absent = [name for name in expected if name not in loaded]
        if absent:
            raise ValueError(
                f"shard {path!r} lacks tensors {absent[:10]} that "
                f"{os.path.basename(index_path)} assigns to it: the checkpoint is corrupt"
            )
        for name, tensor in loaded.items():
            if weight_map.get(name, filename) == filename:
                state_dict[name] = tensor
    return state_dict
