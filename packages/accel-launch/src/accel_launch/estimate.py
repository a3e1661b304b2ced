"""``accel estimate-memory``: how much memory a model needs, without loading it.

Accelerate's command builds a model from its Hub config; accel reads local models only:

- a ``.safetensors`` file, a ``*.safetensors.index.json`` (with its shards next to it), or a
  folder holding either: sizes come from the files' headers (an 8-byte little-endian length,
  then a JSON table of names, dtypes, shapes and offsets), no tensor is read;
- ``module:callable`` (``mypkg.models:build_model``, ``mymodels:Net``): the callable is called
  without arguments under ``torch.device("meta")``, so its parameters take no memory.

Sizes are those of the model in full precision, as Accelerate reports them: floating-point
tensors count 4 bytes per element whatever dtype they are stored in, other tensors their own
size. The float16, int8 and int4 rows divide by 2, 4 and 8. "Training using Adam" is Adam in
float32 (weights, gradients and two moments: 4x the float32 size) and mixed precision for
float16 (float32 master weights and moments, half-precision gradients and activations at the
step: 2x the float32 size); Accelerate gives no training figure for int8 and int4.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from accel_state.safetensors_header import read_safetensors_header

__all__ = [
    "DTYPES",
    "ModelSizes",
    "convert_bytes",
    "estimate_command",
    "estimate_rows",
    "format_bytes",
    "format_estimate_table",
    "load_sizes",
    "sizes_from_callable",
    "sizes_from_safetensors",
    "sizes_of",
]

#: The dtypes of the table, and how many times smaller than float32 each one is.
DTYPES: dict[str, int] = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}

_FLOAT_PREFIXES = ("F", "BF", "C")  # F64, F32, F16, F8_*, F6_*, F4, BF16, C64
_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What a model weighs in full precision.

    Attributes:
        total: Bytes of all its parameters and buffers.
        largest_layer: Bytes of its largest layer (the unit that a device map or offload moves
            as one piece).
        largest_layer_names: The layers of that size.
        tensors: How many tensors the model has.
        stored_dtypes: How many tensors of each dtype the files (or the built model) hold.
    """

    total: int
    largest_layer: int
    largest_layer_names: tuple[str, ...]
    tensors: int
    stored_dtypes: dict[str, int]


def format_bytes(size: float) -> str:
    """``size`` in the largest unit that keeps it at least 1 (``"417.64 MB"``), as Accelerate."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


#: Accelerate's name (``accelerate.utils.convert_bytes``).
convert_bytes = format_bytes


def _full_precision_bytes(dtype: str, numel: int, stored: int) -> int:
    if dtype.upper().startswith(_FLOAT_PREFIXES):
        return numel * 4
    return stored


def _layer_of(name: str) -> str:
    """The layer a tensor belongs to, from its name alone.

    A numbered block (``model.layers.3.mlp.up.weight`` -> ``model.layers.3``) is one layer, as
    Transformers' "no split" blocks are; otherwise the tensor's module (``lm_head.weight`` ->
    ``lm_head``); a tensor at the top level is its own layer.
    """
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) or name


def sizes_of(entries: Iterable[tuple[str, str, int, int]]) -> ModelSizes:
    """Sum ``(name, dtype, numel, stored_bytes)`` entries into :class:`ModelSizes`.

    Layers are found from the names (see the module docstring): a numbered block, or else the
    tensor's module.
    """
    total = 0
    count = 0
    layers: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    for name, dtype, numel, stored in entries:
        size = _full_precision_bytes(dtype, numel, stored)
        total += size
        count += 1
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
        layer = _layer_of(name)
        layers[layer] = layers.get(layer, 0) + size
    largest = max(layers.values(), default=0)
    names = tuple(sorted(name for name, size in layers.items() if size == largest and largest))
    return ModelSizes(total, largest, names, count, dtypes)


def _header_entries(path: Path) -> list[tuple[str, str, int, int]]:
    # Only the header: a file whose tensor data is absent still has its sizes.
    header = read_safetensors_header(path, check_data=False)
    return [(name, t.dtype, t.numel, t.nbytes) for name, t in header.tensors.items()]


def _index_files(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        shards = sorted(set(str(file) for file in weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError(
            f"{index} is not a safetensors index: it needs a JSON object with a "
            '"weight_map" of tensor names to shard files'
        ) from None
    files = [index.parent / shard for shard in shards]
    missing = [str(file.name) for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index} lists shards that are not next to it: {missing}; put them in "
            f"{index.parent} (their headers are read, not their tensors)"
        )
    return files


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise ValueError(
                f"the folder {path} holds several indexes ({[p.name for p in indexes]}): pass "
                "the one to read"
            )
        if indexes:
            return _index_files(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"the folder {path} holds no .safetensors file and no *.safetensors.index.json; "
                "pass a folder with the model's weights, a file, or module:callable"
            )
        return files
    if path.name.endswith(".json"):
        return _index_files(path)
    return [path]


def sizes_from_safetensors(path: str | os.PathLike[str]) -> ModelSizes:
    """Sizes of a model saved as safetensors, read from the file headers only.

    Args:
        path: A ``.safetensors`` file, a ``*.safetensors.index.json`` whose shards sit next to
            it, or a folder holding one index (or, without an index, every ``.safetensors``
            file of the folder).

    Raises:
        FileNotFoundError: ``path``, or a shard the index names, does not exist.
        ValueError: a file is not safetensors, or an index is malformed.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"{str(path)!r} does not exist: pass a .safetensors file, a "
            "*.safetensors.index.json, a folder holding them, or module:callable"
        )
    entries: list[tuple[str, str, int, int]] = []
    for file in _safetensors_files(root):
        entries.extend(_header_entries(file))
    return sizes_of(entries)


def _import_callable(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules are found
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"model={spec!r}: cannot import the module {module_name!r} ({error}); run from "
            "the folder that holds it or install its package"
        ) from None
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"model={spec!r}: {module_name} has no attribute {attribute!r}; name a "
                "function or class that builds the model"
            ) from None
    if not callable(target):
        raise ValueError(f"model={spec!r}: {attribute} is a {type(target).__name__}, not callable")
    return target


def _module_layers(model: Any) -> list[tuple[str, int]]:
    """Layer sizes of a built module: leaves, "no split" blocks, and loose tensors."""
    import torch

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    out: list[tuple[str, int]] = []

    def tensor_bytes(tensor: torch.Tensor) -> int:
        stored = tensor.numel() * tensor.element_size()
        return _full_precision_bytes(
            "F" if tensor.is_floating_point() or tensor.is_complex() else "I",
            tensor.numel(),
            stored,
        )

    def walk(prefix: str, module: torch.nn.Module) -> None:
        children = list(module.named_children())
        if not children or type(module).__name__ in no_split:
            size = sum(tensor_bytes(t) for t in module.parameters())
            size += sum(tensor_bytes(t) for t in module.buffers())
            out.append((prefix or type(module).__name__, size))
            return
        for name, tensor in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            out.append((f"{prefix}.{name}" if prefix else name, tensor_bytes(tensor)))
        for name, child in children:
            walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", model)
    return out


def sizes_from_callable(spec: str) -> ModelSizes:
    """Sizes of the model that ``module:callable`` builds, built on the meta device.

    The module is imported (the current folder is searchable, as with ``python -m``) and the
    callable is called without arguments inside ``torch.device("meta")``, so no parameter
    takes memory. Layers are the modules without children and the classes the model lists in
    ``_no_split_modules`` (as Transformers models do).

    Raises:
        ValueError: the module cannot be imported, the attribute is missing or not callable,
            calling it fails, or it does not return a ``torch.nn.Module``.
    """
    import torch

    factory = _import_callable(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # re-raised with the name of the callable
        raise ValueError(
            f"model={spec!r}: calling it without arguments on the meta device raised "
            f"{type(error).__name__}: {error}"
        ) from error
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"model={spec!r} returned a {type(model).__name__}, not a torch.nn.Module; point "
            "it at a function or class that builds the model"
        )
    dtypes: dict[str, int] = {}
    total = 0
    count = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        name = str(tensor.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
        count += 1
        kind = "F" if tensor.is_floating_point() or tensor.is_complex() else "I"
        total += _full_precision_bytes(kind, tensor.numel(), tensor.numel() * tensor.element_size())
    layers = _module_layers(model)
    largest = max((size for _, size in layers), default=0)
    names = tuple(sorted(name for name, size in layers if size == largest and largest))
    return ModelSizes(total, largest, names, count, dtypes)


def load_sizes(model: str) -> ModelSizes:
    """Sizes of ``model``: an existing path (safetensors) or else ``module:callable``.

    Raises:
        FileNotFoundError: ``model`` is neither an existing path nor ``module:callable``.
        ValueError: see :func:`sizes_from_safetensors` and :func:`sizes_from_callable`.
    """
    if Path(model).expanduser().exists():
        return sizes_from_safetensors(model)
    if _CALLABLE.match(model):
        return sizes_from_callable(model)
    raise FileNotFoundError(
        f"model={model!r} is neither an existing path nor module:callable: pass a "
        ".safetensors file, a *.safetensors.index.json, a folder holding them, or a "
        "callable such as mypkg.models:build_model (accel reads no model hub)"
    )


def _training_bytes(dtype: str, total: int) -> int | None:
    if dtype == "float32":
        return total * 4
    if dtype == "float16":
        return total * 2
    return None


def estimate_rows(sizes: ModelSizes, dtypes: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """The table rows: dtype, largest layer, total size, training using Adam.

    Raises:
        ValueError: a dtype is not one of :data:`DTYPES`.
    """
    rows = []
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        divisor = DTYPES[dtype]
        training = _training_bytes(dtype, sizes.total)
        rows.append(
            (
                dtype,
                format_bytes(sizes.largest_layer / divisor),
                format_bytes(sizes.total / divisor),
                format_bytes(training) if training is not None else "N/A",
            )
        )
    return rows


def format_estimate_table(title: str, rows: Sequence[Sequence[str]]) -> str:
    """A box-drawn table with a title row, like Accelerate's estimate-memory output."""
    headers = ("dtype", "Largest Layer", "Total Size", "Training using Adam")
    widths = [max(len(str(row[i])) for row in [headers, *rows]) + 2 for i in range(4)]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    def cells(values: Sequence[str]) -> str:
        return "│" + "│".join(str(v).center(w) for v, w in zip(values, widths, strict=True)) + "│"

    out = [
        "┌" + "─" * inner + "┐",
        "│" + title.center(inner) + "│",
        line("├", "┬", "┤"),
        cells(headers),
        line("├", "┼", "┤"),
        *(cells(row) for row in rows),
        line("└", "┴", "┘"),
    ]
    return "\n".join(out)


def estimate_command(model: str, dtypes: Sequence[str]) -> str:
    """The full ``accel estimate-memory`` output for ``model``.

    Raises:
        FileNotFoundError, ValueError: see :func:`load_sizes`.
    """
    sizes = load_sizes(model)
    table = format_estimate_table(
        f"Memory Usage for loading `{model}`", estimate_rows(sizes, dtypes)
    )
    stored = ", ".join(f"{dtype}: {count}" for dtype, count in sorted(sizes.stored_dtypes.items()))
    names = ", ".join(sizes.largest_layer_names[:3])
    if len(sizes.largest_layer_names) > 3:
        names += f" (and {len(sizes.largest_layer_names) - 3} more of the same size)"
    notes = [
        f"{sizes.tensors} tensors ({stored or 'none'}); sizes are in full precision "
        "(floating-point tensors at 4 bytes per element).",
        f"Largest layer: {names or '-'}.",
        "Training using Adam: float32 weights, gradients and two moments (4x); for float16, "
        "mixed precision (2x the float32 size). Activations are not included.",
    ]
    return table + "\n" + "\n".join(notes)
