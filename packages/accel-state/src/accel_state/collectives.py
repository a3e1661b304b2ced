"""Collectives over nested structures of tensors: gather, broadcast, reduce, pad.

Each function works on a tensor or on (nested) lists, tuples, namedtuples and dicts of
tensors, keeps the structure, and is the identity when a single process runs. With several
processes it calls ``torch.distributed`` directly (one collective per tensor, no extra
round trip), so the cost over a raw call is a few Python operations. Failures, including a
peer that never arrives before the process-group timeout, raise
:class:`~accel_state.exceptions.DistributedOperationException` naming the operation; in debug
mode (``ACCEL_DEBUG_MODE=1``) every call first checks that all ranks entered the same
operation with tensors of the same shapes.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import xla
from .enums import DistributedType
from .exceptions import DistributedOperationException
from .process_group import collective_failure, verify_collective
from .state import TORCH_DISTRIBUTED_TYPES, PartialState
from .structures import apply_to_leaves, is_torch_tensor

__all__ = [
    "CannotPadNestedTensorWarning",
    "broadcast",
    "broadcast_object_list",
    "copy_tensor_to_devices",
    "gather",
    "gather_object",
    "pad_across_processes",
    "pad_input_tensors",
    "reduce",
]

ReductionType = Literal["mean", "sum", "max", "min", "none"]
_REDUCTIONS: dict[str, Any] = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "none": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# torch >= 2.13 names the flat all-gather `all_gather_single`; older releases only have
# `all_gather_into_tensor`.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CannotPadNestedTensorWarning(UserWarning):
    """A nested tensor was passed to ``pad_across_processes``; it is returned unpadded."""


def _group_size() -> int:
    """Number of processes when a torch.distributed group is in use, else 0."""
    state = PartialState._shared_state
    if not state:
        state = PartialState()._shared_state
    if state["distributed_type"] in TORCH_DISTRIBUTED_TYPES:
        return int(state["num_processes"])
    return 0


def _xla_size() -> int:
    """Number of processes of an XLA run with several, else 0."""
    state = PartialState._shared_state
    if not state:
        state = PartialState()._shared_state
    if state["distributed_type"] == DistributedType.XLA and state["num_processes"] > 1:
        return int(state["num_processes"])
    return 0


def _debug() -> bool:
    return bool(PartialState._shared_state.get("debug", False))


def _map_tensors(operation: str, func: Any, data: Any) -> Any:
    """Apply ``func`` to each tensor of ``data``; other leaves raise a TypeError naming them."""

    def _unsupported(leaf: Any, where: str) -> TypeError:
        return TypeError(
            f"`{operation}` got an object of type {type(leaf).__name__!r} at {where}: only "
            "tensors and (nested) lists, tuples and dicts of tensors can be passed; convert it "
            "to a tensor or use gather_object / broadcast_object_list for arbitrary Python objects"
        )

    return apply_to_leaves(func, data, "", (), is_torch_tensor, True, {}, _unsupported)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _signature(operation: str, data: Any) -> Any:
    """What debug mode compares across ranks: shape, dtype and device type of each tensor."""
    return _map_tensors(
        operation,
        lambda t: (tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type),
        data,
    )


def gather(tensor: Any) -> Any:
    """Gather tensors from all processes and concatenate them along the first dimension.

    A 0-d tensor becomes a 1-d tensor with one element per process; non-contiguous tensors
    are made contiguous. Every process receives the full result.

    Raises:
        TypeError: a leaf of ``tensor`` is not a tensor (the message gives its path).
        DistributedOperationException: the collective failed or timed out; in debug mode, the
            ranks' shapes differ.
    """
    num_processes = _group_size()
    if num_processes == 0:
        if _xla_size():
            return _map_tensors("gather", xla.all_gather, tensor)
        return _map_tensors("gather", _identity, tensor)
    if _debug():
        verify_collective("gather", _signature("gather", tensor), num_processes)
    if type(tensor) is torch.Tensor:
        return _gather_one(tensor, num_processes)
    return _map_tensors("gather", lambda t: _gather_one(t, num_processes), tensor)


def _gather_one(tensor: torch.Tensor, num_processes: int) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    output = torch.empty(
        (num_processes * tensor.shape[0], *tensor.shape[1:]),
        dtype=tensor.dtype,
        device=tensor.device,
    )
    try:
        # Collectives carry no autograd history (as Accelerate's): gather the data only.
        _all_gather_flat(output, tensor.detach())
    except RuntimeError as err:
        raise collective_failure("gather", err) from err
    return output


def gather_object(object: Any) -> list[Any]:
    """Gather picklable objects from all processes.

    Each process passes a list (or tuple); the result is their concatenation in rank
    order, on every process. If some process passes something other than a list or tuple,
    the result is the list of the objects, one per process.

    Raises:
        DistributedOperationException: the collective failed or timed out.
    """
    num_processes = _group_size()
    if num_processes == 0 and not _xla_size():
        return object
    if num_processes == 0:
        output = xla.gather_objects("accel.gather_object", object)
    else:
        if _debug():
            verify_collective("gather_object", None, num_processes, compare_inputs=False)
        output = [None] * num_processes
        try:
            dist.all_gather_object(output, object)
        except RuntimeError as err:
            raise collective_failure("gather_object", err) from err
    if all(isinstance(item, (list, tuple)) for item in output):
        return [element for item in output for element in item]
    return output


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Send the tensors of process ``from_process`` to every process (in place).

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: ``from_process`` is not a rank of the run.
        DistributedOperationException: the collective failed or timed out; in debug mode, the
            ranks' shapes differ.
    """
    num_processes = _group_size()
    xla_processes = _xla_size()
    if num_processes == 0 and not xla_processes:
        return _map_tensors("broadcast", _identity, tensor)
    _check_rank(from_process, num_processes or xla_processes, "from_process")
    if _debug() and num_processes:
        verify_collective("broadcast", _signature("broadcast", tensor), num_processes)

    def _broadcast_one(t: torch.Tensor) -> torch.Tensor:
        target = t if t.is_contiguous() else t.contiguous()
        if xla_processes:
            xla.broadcast_(target, from_process)
        else:
            try:
                dist.broadcast(target, src=from_process)
            except RuntimeError as err:
                raise collective_failure("broadcast", err) from err
        if target is not t:
            t.copy_(target)
        return t

    return _map_tensors("broadcast", _broadcast_one, tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace, in place, the items of ``object_list`` by those of process ``from_process``.

    Raises:
        ValueError: ``from_process`` is not a rank of the run.
        DistributedOperationException: the collective failed or timed out.
    """
    num_processes = _group_size()
    if num_processes == 0 and _xla_size():
        _check_rank(from_process, _xla_size(), "from_process")
        sent = xla.broadcast_objects("accel.broadcast_object_list", list(object_list), from_process)
        object_list[:] = sent
        return object_list
    if num_processes == 0:
        return object_list
    _check_rank(from_process, num_processes, "from_process")
    if _debug():
        verify_collective("broadcast_object_list", len(object_list), num_processes)
    try:
        dist.broadcast_object_list(object_list, src=from_process)
    except RuntimeError as err:
        raise collective_failure("broadcast_object_list", err) from err
    return object_list


def reduce(tensor: Any, reduction: ReductionType = "mean", scale: float = 1.0) -> Any:
    """Reduce tensors across processes; every process receives the result.

    Args:
        tensor: A tensor or nested structure of tensors (not modified).
        reduction: ``"mean"`` (sum divided by the number of processes; integer tensors give
            a floating result), ``"sum"``, ``"max"``, ``"min"``, or ``"none"`` (summed, as in
            Accelerate).
        scale: Factor applied to the result.

    Raises:
        ValueError: ``reduction`` is not one of the allowed values.
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the collective failed or timed out; in debug mode, the
            ranks' shapes differ.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction={reduction!r} is not supported: use one of "
            f"{', '.join(repr(r) for r in _REDUCTIONS)}"
        )
    num_processes = _group_size()
    xla_processes = _xla_size()
    if _debug() and num_processes:
        verify_collective("reduce", _signature("reduce", tensor), num_processes)
    op = _REDUCTIONS[reduction]

    def _reduce_one(t: torch.Tensor) -> torch.Tensor:
        if xla_processes:
            result = xla.all_reduce(t, reduction)
            if reduction == "mean":
                result = result / xla_processes
            return result * scale if scale != 1.0 else result
        result = t.clone()
        if num_processes:
            if not result.is_contiguous():
                result = result.contiguous()
            try:
                dist.all_reduce(result, op=op)
            except RuntimeError as err:
                raise collective_failure("reduce", err) from err
        if reduction == "mean" and num_processes:
            result = result / num_processes
        if scale != 1.0:
            result = result * scale
        return result

    return _map_tensors("reduce", _reduce_one, tensor)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has, so it can be gathered.

    Args:
        tensor: A tensor or nested structure of tensors.
        dim: The dimension to pad; a dimension the tensor lacks leaves it unchanged.
        pad_index: The value to pad with.
        pad_first: Pad at the beginning instead of the end.

    Raises:
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the collective failed or timed out; in debug mode, the
            ranks' tensors have different numbers of dimensions.
    """
    num_processes = _group_size()
    xla_processes = _xla_size()
    if num_processes == 0 and not xla_processes:
        return _map_tensors("pad_across_processes", _unpadded, tensor)
    if _debug() and num_processes:
        ndims = _map_tensors("pad_across_processes", lambda t: t.ndim, tensor)
        verify_collective("pad_across_processes", ndims, num_processes)

    def _pad_one(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            return _unpadded(t)
        if not -t.ndim <= dim < t.ndim:
            return t
        axis = dim % t.ndim
        sizes = torch.tensor(t.shape, device=t.device, dtype=torch.int64)[None]
        try:
            if xla_processes:
                all_sizes = xla.all_gather(sizes).cpu()
            else:
                all_sizes = _gather_one(sizes, num_processes).cpu()
        except DistributedOperationException as err:
            raise DistributedOperationException(
                f"Error found while calling `pad_across_processes`: {err}"
            ) from err
        max_size = int(all_sizes[:, axis].max())
        if max_size == t.shape[axis]:
            return t
        new_shape = list(t.shape)
        new_shape[axis] = max_size
        padded = t.new_full(new_shape, pad_index)
        start = max_size - t.shape[axis] if pad_first else 0
        index = [slice(None)] * t.ndim
        index[axis] = slice(start, start + t.shape[axis])
        padded[tuple(index)] = t
        return padded

    return _map_tensors("pad_across_processes", _pad_one, tensor)


def _unpadded(t: torch.Tensor) -> torch.Tensor:
    """A tensor left as it is; a nested one with the warning that it cannot be padded."""
    if getattr(t, "is_nested", False):
        warnings.warn(
            "pad_across_processes cannot pad nested tensors; the tensor is returned as is",
            CannotPadNestedTensorWarning,
            stacklevel=4,
        )
    return t


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Zero-pad a batch along ``dim`` so its size is a multiple of ``num_processes``.

    Local operation (no communication): used before splitting one batch between
    processes. A batch already divisible is returned unchanged.

    Raises:
        ValueError: ``num_processes`` is not positive.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer")
    target = -(-batch_size // num_processes) * num_processes

    def _pad_one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or t.shape[dim] >= target:
            return t
        new_shape = list(t.shape)
        new_shape[dim] = target
        padded = t.new_zeros(new_shape)
        index = [slice(None)] * t.ndim
        index[dim] = slice(0, t.shape[dim])
        padded[tuple(index)] = t
        return padded

    return _map_tensors("pad_input_tensors", _pad_one, tensor)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a tensor held by exactly one process to every process.

    The process that has the tensor passes it; the others pass ``None`` and receive a copy
    on their own device.

    Raises:
        ValueError: no process, or more than one, passed a tensor.
        DistributedOperationException: the collective failed or timed out.
    """
    num_processes = _group_size()
    xla_processes = _xla_size()
    if num_processes == 0 and not xla_processes:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: no process passed a tensor; pass one")
        return tensor
    meta = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    metas: list[Any] = [None] * num_processes
    if xla_processes:
        metas = xla.gather_objects("accel.copy_tensor_to_devices", meta)
    else:
        try:
            dist.all_gather_object(metas, meta)
        except RuntimeError as err:
            raise collective_failure("copy_tensor_to_devices", err) from err
    owners = [rank for rank, item in enumerate(metas) if item is not None]
    if len(owners) != 1:
        raise ValueError(
            f"copy_tensor_to_devices: exactly one process must pass a tensor, but processes "
            f"{owners} did; pass None on all the others"
        )
    shape, dtype = metas[owners[0]]
    device = PartialState().device
    buffer = (
        tensor.contiguous()
        if tensor is not None
        else torch.empty(shape, dtype=dtype, device=device)
    )
    if xla_processes:
        xla.broadcast_(buffer, owners[0])
        return buffer
    try:
        dist.broadcast(buffer, src=owners[0])
    except RuntimeError as err:
        raise collective_failure("copy_tensor_to_devices", err) from err
    return buffer


def _check_rank(rank: int, num_processes: int, name: str) -> None:
    if not isinstance(rank, int) or not 0 <= rank < num_processes:
        raise ValueError(
            f"{name}={rank!r} is not a process of this run: use a rank in [0, {num_processes - 1}]"
        )
