"""Walking nested batches: lists, tuples, namedtuples and mappings of tensors.

:func:`recursively_apply` is the one traversal every collective and device move uses; it
keeps the container types (a namedtuple stays that namedtuple, a ``dict`` subclass stays that
class) and, when asked to reject other leaves, names the offending type and where it sits
(``data['labels'][1]``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "TensorInformation",
    "concatenate",
    "device_mover",
    "find_batch_size",
    "find_device",
    "get_data_structure",
    "get_pretty_name",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "is_torch_xpu_tensor",
    "listify",
    "merge_dicts",
    "recursive_getattr",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
]


@dataclasses.dataclass
class TensorInformation:
    """Shape and dtype of a tensor, sent ahead of the data when broadcasting structures."""

    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``."""
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is an instance of a ``collections.namedtuple`` / ``typing.NamedTuple``."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Build an object of ``type(obj)`` from ``generator`` (namedtuples positionally)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _rebuild(mapping: Any) -> Any:
    """The constructor of a mapping's type (typed as Any: Mapping itself has no constructor)."""
    return type(mapping)


def _describe(path: str) -> str:
    return f"data{path}" if path else "data"


def apply_to_leaves(
    func: Callable[..., Any],
    data: Any,
    path: str,
    args: tuple[Any, ...],
    test_type: Callable[[Any], bool],
    error_on_other_type: bool,
    kwargs: dict[str, Any],
    error: Callable[[Any, str], Exception] | None = None,
) -> Any:
    """The walk behind :func:`recursively_apply`; ``error(leaf, where)`` builds the exception."""
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                apply_to_leaves(
                    func, item, f"{path}[{i}]", args, test_type, error_on_other_type, kwargs, error
                )
                for i, item in enumerate(data)
            ),
        )
    if isinstance(data, Mapping):
        return _rebuild(data)(
            {
                key: apply_to_leaves(
                    func,
                    value,
                    f"{path}[{key!r}]",
                    args,
                    test_type,
                    error_on_other_type,
                    kwargs,
                    error,
                )
                for key, value in data.items()
            }
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        if error is not None:
            raise error(data, _describe(path))
        name = getattr(func, "__name__", repr(func))
        # Accelerate's wording, which suites assert verbatim; where the value sits goes into a
        # note, which tracebacks show.
        problem = TypeError(
            f"Unsupported types ({type(data)}) passed to `{name}`. Only nested list/tuple/dicts "
            f"of objects that are valid for `{getattr(test_type, '__name__', test_type)}` should "
            "be passed."
        )
        if sys.version_info >= (3, 11):  # notes are new in 3.11
            problem.add_note(f"The {type(data).__name__!r} value is at {_describe(path)}.")
        raise problem
    return data


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func`` to every leaf of ``data`` for which ``test_type`` holds.

    Args:
        func: Called as ``func(leaf, *args, **kwargs)``.
        data: A leaf, or nested lists/tuples/namedtuples/mappings.
        *args: Extra positional arguments for ``func``.
        test_type: Which leaves ``func`` applies to (default: tensors).
        error_on_other_type: Raise on other leaves instead of returning them unchanged.
        **kwargs: Extra keyword arguments for ``func``.

    Raises:
        TypeError: a leaf fails ``test_type`` and ``error_on_other_type`` is set; the message
            names its type and its path in the structure.
    """
    return apply_to_leaves(func, data, "", args, test_type, error_on_other_type, kwargs)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Move every tensor (anything with ``.to``) in a nested structure to ``device``.

    Tensors already on ``device`` are returned as they are (no copy), and a list, tuple or
    dict whose tensors all are already there is returned itself, not rebuilt.

    Args:
        tensor: A tensor or nested structure; leaves without ``.to`` are returned as they are.
        device: The target device.
        non_blocking: Ask for an asynchronous copy (pinned memory to GPU).
        skip_keys: Keys of mappings whose values are left where they are.
    """
    return device_mover(device, non_blocking=non_blocking, skip_keys=skip_keys)(tensor)


def device_mover(
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Callable[[Any], Any]:
    """Return ``f`` with ``f(batch) == send_to_device(batch, device, ...)``, set up once.

    For per-batch loops: the device is parsed and the placement test chosen once, so each
    call costs a few attribute reads when the batch is already in place.
    """
    target = device if isinstance(device, torch.device) else torch.device(device)
    # Reading `torch.device.type` costs more than a whole walk; equality is cheap.
    on_target = _is_cpu if target == _CPU else functools.partial(_is_on, target)
    skip: Any = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or ())

    def move(data: Any) -> Any:
        if type(data) is torch.Tensor:  # the common cases first, without the generic walk
            return data if on_target(data) else data.to(target, non_blocking=non_blocking)
        if _settled(data, on_target):
            return data
        return _send(data, target, device, on_target, non_blocking, skip)

    def move_to_cpu(data: Any) -> Any:
        # Same as `move` with the CPU test inlined: the case of every CPU training loop.
        kind = type(data)
        if kind is torch.Tensor:
            return data if data.is_cpu else data.to(target, non_blocking=non_blocking)
        if kind is list or kind is tuple:
            for value in data:
                if type(value) is not torch.Tensor or not value.is_cpu:
                    break
            else:
                return data
        return move(data)

    return move_to_cpu if on_target is _is_cpu else move


_CPU = torch.device("cpu")


def _settled(data: Any, on_target: Callable[[torch.Tensor], bool]) -> bool:
    """True for a list/tuple/dict of tensors (one level deep) all already on the target."""
    kind = type(data)
    if kind is list or kind is tuple:
        values: Any = data
    elif kind is dict:
        values = data.values()
    else:
        return False
    for value in values:
        if type(value) is not torch.Tensor or not on_target(value):
            return False
    return True


def _is_cpu(tensor: torch.Tensor) -> bool:
    return bool(tensor.is_cpu)


def _is_on(target: torch.device, tensor: torch.Tensor) -> bool:
    return bool(tensor.device == target)


def _send(
    data: Any,
    target: torch.device,
    device: Any,
    on_target: Callable[[torch.Tensor], bool],
    non_blocking: bool,
    skip: Any,
) -> Any:
    """Move ``data`` to ``target``; objects other than tensors get ``device`` as passed."""
    if isinstance(data, torch.Tensor):
        return data if on_target(data) else data.to(target, non_blocking=non_blocking)
    if isinstance(data, (tuple, list)):
        moved = [_send(item, target, device, on_target, non_blocking, skip) for item in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return type(data)(*moved)
        return type(data)(moved)
    if isinstance(data, Mapping):
        return _rebuild(data)(
            {
                key: value
                if key in skip
                else _send(value, target, device, on_target, non_blocking, skip)
                for key, value in data.items()
            }
        )
    to = getattr(data, "to", None)
    if to is None or not callable(to):
        return data
    try:
        return to(device, non_blocking=non_blocking)
    except TypeError:
        # Objects whose .to does not know non_blocking (e.g. some tokenizer outputs).
        return to(device)


def get_data_structure(data: Any) -> Any:
    """Replace each tensor of ``data`` by its :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    """Replace each tensor of ``data`` by its shape as a list."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Create empty tensors shaped like the :class:`TensorInformation` leaves of a structure."""
    return recursively_apply(
        lambda info: torch.empty(info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def find_batch_size(data: Any) -> int:
    """Return the size of the first dimension of the first tensor found in ``data``.

    Raises:
        ValueError: ``data`` is an empty list, tuple or mapping.
        TypeError: the first leaf found is not a tensor.
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from an empty {type(data).__name__}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(
            f"Can only find the batch size of tensors but got {type(data).__name__!r}: put the "
            "batch tensors first in the structure"
        )
    return int(data.shape[0])


def ignorant_find_batch_size(data: Any) -> int | None:
    """Like :func:`find_batch_size` but returns ``None`` instead of raising."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError, IndexError):
        return None


def listify(data: Any) -> Any:
    """Turn every tensor of ``data`` into a (nested) Python list or number."""

    def _to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.to(torch.float32)
        return tensor.tolist()

    return recursively_apply(_to_list, data)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of structures leaf by leaf along ``dim``.

    A list of one batch is returned as it is, even when its leaves are not tensors.

    Raises:
        TypeError: several batches whose leaves are not tensors.
    """
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(
            first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first)))
        )
    if isinstance(first, Mapping):
        return _rebuild(first)({key: concatenate([d[key] for d in data], dim=dim) for key in first})
    if not isinstance(first, torch.Tensor):
        if len(data) == 1:  # a single batch is returned as it is, whatever it holds
            return first
        raise TypeError(
            f"Can only concatenate tensors but got {type(first).__name__!r}: pass a list of "
            "(nested) tensors"
        )
    return torch.cat(data, dim=dim)


def slice_tensors(
    data: Any,
    tensor_slice: slice | int,
    process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """Apply ``tensor_slice`` to every tensor of ``data``."""
    return recursively_apply(lambda tensor: tensor[tensor_slice], data)


def find_device(data: Any) -> torch.device | None:
    """Return the device of the first tensor found in ``data`` (``None`` if there is none)."""
    if isinstance(data, Mapping):
        for value in data.values():
            device = find_device(value)
            if device is not None:
                return device
        return None
    if isinstance(data, (tuple, list)):
        for value in data:
            device = find_device(value)
            if device is not None:
                return device
        return None
    if isinstance(data, torch.Tensor):
        return data.device
    return None


# --- Accelerate's small object helpers (accelerate.utils.other) ---------------------------


def get_pretty_name(obj: Any) -> str:
    """A readable name for ``obj``: its qualified name, or its class's for an instance."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return str(name) if name is not None else str(obj)


def merge_dicts(source: dict[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, not replaced).

    ``destination`` is changed in place and returned.
    """
    for key, value in source.items():
        if isinstance(value, dict):
            node = destination.setdefault(key, {})
            merge_dicts(value, node)
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer.0")``.

    Raises:
        AttributeError: a step of the path does not exist (the message names it).
    """
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def is_torch_xpu_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor on an Intel XPU."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"
