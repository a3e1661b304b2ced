"""How many bytes a model, each of its submodules and each of its layers takes.

This module owns the arithmetic the device-map planner works with: the byte size of one element
of a dtype (including the sub-byte :class:`CustomDtype` sizes), human-readable size strings
(``"5GB"``, ``"2.5GiB"``, ``"8Gb"``), the size of every dotted prefix of a model's tensors, and
the largest "layer" (a leaf module or a module that must not be split). Sizes are computed from
shapes and dtypes only, so a model on the meta device works as well as a real one. Results are
the same as Accelerate 1.15's for the same inputs.
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .tensors import dtype_named, named_module_tensors

__all__ = [
    "CustomDtype",
    "DtypeLike",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "get_max_layer_size",
    "get_module_size_with_ties",
]


class CustomDtype(enum.Enum):
    """Storage formats torch has no dtype for, usable as ``dtype``/``special_dtypes`` when planning.

    ``FP8`` takes one byte per element, ``INT4`` half a byte and ``INT2`` a quarter of a byte.
    """

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


DtypeLike = str | torch.dtype | CustomDtype
"""A dtype as users write it: ``torch.float16``, ``"float16"`` or a :class:`CustomDtype`."""

_CUSTOM_SIZES: dict[CustomDtype, int | float] = {
    CustomDtype.FP8: 1,
    CustomDtype.INT4: 1 / 2,
    CustomDtype.INT2: 1 / 4,
}

_FLOAT8_NAMES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

_FLOAT8_DTYPES = frozenset(getattr(torch, name) for name in _FLOAT8_NAMES if hasattr(torch, name))

_TRAILING_BITS = re.compile(r"\D(\d+)$")

# Unit suffixes, longest first so "GiB" is not read as "B": (suffix, multiplier, may mean bits).
_UNITS: tuple[tuple[str, int, bool], ...] = (
    ("GIB", 2**30, False),
    ("MIB", 2**20, False),
    ("KIB", 2**10, False),
    ("GB", 10**9, True),
    ("MB", 10**6, True),
    ("KB", 10**3, True),
)

_SIZE_FORMS = (
    "an int number of bytes, or a string such as '5GB', '512MB', '2.5GiB' or '100KiB' "
    "(GiB/MiB/KiB are powers of 1024, GB/MB/KB powers of 1000; a lowercase final 'b', "
    "as in '8Gb', means bits)"
)


def _resolve_dtype(value: DtypeLike, argument: str) -> torch.dtype | CustomDtype:
    """Like :func:`parse_dtype`, but :class:`CustomDtype` passes too and ``None`` does not.

    Raises:
        ValueError: a string that names no torch dtype.
        TypeError: neither a string, a ``torch.dtype`` nor a :class:`CustomDtype`.
    """
    if isinstance(value, (torch.dtype, CustomDtype)):
        return value
    if isinstance(value, str):
        found = dtype_named(value)
        if found is not None:
            return found
        raise ValueError(
            f"{argument}={value!r} is not a torch dtype: use a torch.dtype, a name such as "
            "'float16' or 'torch.bfloat16', or a CustomDtype (FP8, INT4, INT2)."
        )
    raise TypeError(
        f"{argument}={value!r} has type {type(value).__name__}: use a torch.dtype, a name such "
        "as 'float16' or 'torch.bfloat16', or a CustomDtype (FP8, INT4, INT2)."
    )


def dtype_byte_size(dtype: DtypeLike) -> int | float:
    """Bytes taken by one element of ``dtype`` (a fraction for sub-byte formats).

    ``torch.bool`` counts 1/8, ``CustomDtype.INT2`` 1/4, ``CustomDtype.INT4`` 1/2, the float8
    dtypes and ``CustomDtype.FP8`` 1; any other dtype counts the bit width at the end of its
    name divided by 8 (``torch.float32`` -> 4).

    Args:
        dtype: a ``torch.dtype``, a :class:`CustomDtype`, or a dtype name such as ``"float16"``.

    Raises:
        ValueError: the dtype's name does not end with a bit width.
    """
    resolved = _resolve_dtype(dtype, "dtype")
    if isinstance(resolved, CustomDtype):
        return _CUSTOM_SIZES[resolved]
    if resolved == torch.bool:
        return 1 / 8
    if resolved in _FLOAT8_DTYPES:
        return 1
    found = _TRAILING_BITS.search(str(resolved))
    if found is None:
        raise ValueError(
            f"dtype={resolved!r} has no bit width in its name, so its size is unknown: use a "
            "dtype such as torch.float16, torch.int8 or a CustomDtype."
        )
    return int(found.group(1)) // 8


# Two size grammars on purpose. This one follows Accelerate's ``convert_file_size_to_int``
# (used for ``max_memory``), where a lowercase final "b" counts bits ("8Gb" is 1 GB). The other,
# ``accel.model_files.parse_size``, reads ``max_shard_size`` as huggingface_hub does, where
# every unit counts bytes. Each keeps the meaning its callers' scripts were written for, so
# they must not be merged.
def convert_file_size_to_int(size: int | str) -> int:
    """Read a size such as ``"5GB"`` or ``"1MiB"`` as bytes; an ``int`` is returned as it is.

    ``GiB``/``MiB``/``KiB`` are binary (powers of 1024), ``GB``/``MB``/``KB`` decimal (powers of
    1000), case-insensitively; a decimal unit whose last letter is a lowercase ``b`` (``"8Gb"``)
    counts bits, so the result is divided by 8. Fractions are allowed (``"1.5GB"``).

    Args:
        size: bytes as an ``int``, or a number followed by a unit.

    Raises:
        ValueError: a negative size, or a string that is not a number followed by a known unit.
        TypeError: ``size`` is neither an ``int`` nor a ``str``.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"size={size!r} has type {type(size).__name__}: use {_SIZE_FORMS}.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size={size!r} is negative: use {_SIZE_FORMS}.")
        return size
    upper = size.upper()
    for suffix, multiplier, may_be_bits in _UNITS:
        if not upper.endswith(suffix):
            continue
        try:
            amount = int(float(size[: -len(suffix)]) * multiplier)
        except (ValueError, OverflowError):
            break
        if may_be_bits and size.endswith("b"):
            amount //= 8
        if amount < 0:
            break
        return amount
    raise ValueError(f"size={size!r} is not a valid size: use {_SIZE_FORMS}.")


def compute_module_sizes(
    model: nn.Module,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    buffers_only: bool = False,
) -> defaultdict[str, Any]:
    """Bytes taken by every tensor of ``model`` and by every dotted prefix of their names.

    The result maps ``""`` to the whole model, ``"block"`` to everything under ``block``, and
    each tensor's full name to the tensor itself. Tied parameters count once, under the first
    name ``named_parameters`` gives them. Missing names read as 0 (the result is a
    ``defaultdict(int)``), so a module without tensors has size 0.

    Args:
        model: the model to measure (it may live on the meta device).
        dtype: the dtype the weights will be loaded in. Floating-point tensors count with the
            smaller of this size and their own; integer and bool tensors keep their own size.
        special_dtypes: dtypes for particular tensors, by full name (they win over ``dtype``).
        buffers_only: measure the buffers only.

    Returns:
        A ``defaultdict(int)`` from names to sizes in bytes (a ``float`` where sub-byte dtypes
        are involved).

    Raises:
        ValueError, TypeError: ``dtype`` or a value of ``special_dtypes`` is not a dtype.
    """
    target_size: int | float | None = None
    if dtype is not None:
        target_size = dtype_byte_size(_resolve_dtype(dtype, "dtype"))
    special_sizes: dict[str, int | float] = {}
    if special_dtypes is not None:
        special_sizes = {
            name: dtype_byte_size(_resolve_dtype(value, f"special_dtypes[{name!r}]"))
            for name, value in special_dtypes.items()
        }

    tensors: Iterable[tuple[str, torch.Tensor]]
    if buffers_only:
        tensors = model.named_buffers(recurse=True)
    else:
        tensors = named_module_tensors(model, recurse=True)

    sizes: defaultdict[str, Any] = defaultdict(int)
    for name, tensor in tensors:
        own = dtype_byte_size(tensor.dtype)
        if name in special_sizes:
            size = tensor.numel() * special_sizes[name]
        elif target_size is None or _keeps_its_dtype(tensor.dtype):
            size = tensor.numel() * own
        else:
            size = tensor.numel() * min(target_size, own)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def _keeps_its_dtype(dtype: torch.dtype) -> bool:
    """Whether loading with a ``dtype`` leaves a tensor of this dtype alone (ints and bools)."""
    return str(dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
) -> int | float:
    """Total bytes of all the buffers of ``model`` (see :func:`compute_module_sizes`)."""
    sizes = compute_module_sizes(
        model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True
    )
    total: int | float = sizes.get("", 0)
    return total


def _find_holder(tensor_name: str, entries: Sequence[tuple[str, Any]]) -> tuple[str, Any] | None:
    """The entry of ``entries`` that is ``tensor_name`` or contains it, if any."""
    for entry_name, entry in entries:
        if tensor_name == entry_name or tensor_name.startswith(entry_name + "."):
            return entry_name, entry
    return None


def get_module_size_with_ties(
    tied_params: Sequence[str],
    module_size: int | float,
    module_sizes: Mapping[str, int | float],
    modules_to_treat: Sequence[tuple[str, Any]],
) -> tuple[int | float, list[str], list[Any]]:
    """Size of a module together with the modules holding the partners of its tied parameters.

    Args:
        tied_params: names of parameters outside the module that are tied to one inside it.
        module_size: size of the module itself.
        module_sizes: sizes from :func:`compute_module_sizes`.
        modules_to_treat: the ``(name, module)`` entries still to place; each tied parameter's
            holder is the entry that is it or contains it.

    Returns:
        ``(total size, holder names, holders)``; each holder adds its size minus the tied
        parameter's (already counted in the module). A tied parameter with no holder among
        ``modules_to_treat`` adds nothing.
    """
    if not tied_params:
        return module_size, [], []
    total = module_size
    names: list[str] = []
    holders: list[Any] = []
    for tied_param in tied_params:
        found = _find_holder(tied_param, modules_to_treat)
        if found is None:
            continue
        holder_name, holder = found
        names.append(holder_name)
        holders.append(holder)
        total += _size_of(module_sizes, holder_name) - _size_of(module_sizes, tied_param)
    return total, names, holders


def _size_of(module_sizes: Mapping[str, int | float], name: str) -> int | float:
    return module_sizes.get(name, 0)


def get_max_layer_size(
    modules: Sequence[tuple[str, Any]],
    module_sizes: Mapping[str, int | float],
    no_split_module_classes: Sequence[str],
) -> tuple[int | float, list[str]]:
    """The size of the largest layer among ``modules``, and the names of the layers that size.

    A layer is a module without children, a module whose class name is in
    ``no_split_module_classes``, or a bare tensor; other modules are looked into.

    Args:
        modules: ``(name, module or tensor)`` entries to scan.
        module_sizes: sizes from :func:`compute_module_sizes`.
        no_split_module_classes: class names of modules that must stay whole.

    Returns:
        ``(largest size, names of every layer of that size)``; ``(0, [...])`` when nothing has
        a positive size.
    """
    largest: int | float = 0
    names: list[str] = []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending = [(f"{name}.{child}", sub) for child, sub in children] + pending
            continue
        size = _size_of(module_sizes, name)
        if size > largest:
            largest = size
            names = [name]
        elif size == largest:
            names.append(name)
    return largest, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int | float, tuple[int | float, list[str]]]:
    """Total size of ``model`` and its largest layer.

    A transformers model's ``_no_split_modules`` are treated as layers.

    Returns:
        ``(total bytes, (largest layer bytes, names of the layers of that size))``.
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    entries: list[tuple[str, Any]] = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(entries, sizes, no_split)
