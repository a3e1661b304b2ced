"""Exactly-once metrics: gather evaluation outputs and drop the samples that even out batches.

accel-data guarantees that the padding of a prepared loader sits at the end of the *gathered*
last batch (rank-major concatenation of every process's last batch) and reports in
``remainder`` how many rows of it are real. Keeping those rows gives every sample exactly
once, in every sharding mode. Python objects are gathered row by row (a list element, a
tensor row, each field of a mapping), so the same rule applies to them.

On a device mesh with tensor- or context-parallel dimensions the ranks of one such group hold
the same samples; only one rank of each (its ``tp``/``cp``/``sp`` coordinates 0) is kept, so
the samples still come back exactly once (Accelerate returns each ``tp_size`` times).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from accel_state import GradientState, PartialState, gather, gather_object
from accel_state.structures import recursively_apply

__all__ = ["data_representatives", "gather_for_metrics", "trim_to_dataset"]

logger = logging.getLogger("accel.accelerator")


def _has_rows(data: Any) -> bool:
    return isinstance(data, torch.Tensor) and data.dim() > 0


def trim_to_dataset(data: Any, remainder: int) -> Any:
    """Keep the first ``remainder`` rows of every tensor in a gathered structure.

    ``remainder <= 0`` means there is nothing to drop.
    """
    if remainder <= 0:
        return data
    return recursively_apply(lambda tensor: tensor[:remainder], data, test_type=_has_rows)


def _gather_rows(data: Any, keep: int | None) -> Any:
    """``gather_object`` by rows, keeping the first ``keep`` rows when given.

    Tensors with a batch dimension and lists/tuples are gathered element by element (a
    tensor comes back as a tensor), mappings field by field, anything else once per process.
    """
    if isinstance(data, torch.Tensor) and data.dim() > 0:
        rows = gather_object(list(data.unbind(0)))
        rows = rows[:keep] if keep is not None else rows
        return torch.stack(rows) if rows else data[:0]
    if isinstance(data, (list, tuple)):
        rows = gather_object(list(data))
        return rows[:keep] if keep is not None else rows
    if isinstance(data, Mapping):
        return type(data)({key: _gather_rows(value, keep) for key, value in data.items()})  # type: ignore[call-arg]
    return gather_object(data)


def data_representatives(mesh: Any) -> list[int] | None:
    """The global ranks that speak for each data shard of ``mesh``, in data-shard order.

    None when every rank holds its own shard (no model-parallel dimension above 1).
    """
    from accel_data.prepare import MODEL_PARALLEL_DIMS

    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(mesh.mesh.shape)
    if not any(n in MODEL_PARALLEL_DIMS and s > 1 for n, s in zip(names, shape, strict=False)):
        return None
    index = tuple(0 if name in MODEL_PARALLEL_DIMS else slice(None) for name in names)
    return [int(rank) for rank in mesh.mesh[index].flatten().tolist()]


def _empty_like(data: Any) -> Any:
    """What a rank that is not its data shard's representative contributes: no row."""
    if isinstance(data, torch.Tensor) and data.dim() > 0:
        return data[:0]
    if isinstance(data, (list, tuple)):
        return type(data)()
    if isinstance(data, Mapping):
        return type(data)({key: _empty_like(value) for key, value in data.items()})  # type: ignore[call-arg]
    return data


def _keep_ranks(gathered: Any, ranks: list[int], world: int) -> Any:
    def select(tensor: torch.Tensor) -> torch.Tensor:
        blocks = tensor.reshape(world, -1, *tensor.shape[1:])
        return blocks[ranks].flatten(0, 1)

    return recursively_apply(select, gathered, test_type=_has_rows)


def gather_for_metrics(
    input_data: Any,
    use_gather_object: bool,
    gradient_state: GradientState,
    representatives: list[int] | None = None,
) -> Any:
    """Gather ``input_data`` from every process for a metric, each sample exactly once.

    Structures of tensors use ``gather``; anything holding other objects (or
    ``use_gather_object=True``) is gathered as Python objects, by rows. On the last batch of
    the active prepared loader, only the real rows are kept. ``representatives``
    (:func:`data_representatives`): the only ranks whose rows are kept.
    """
    try:
        recursively_apply(lambda tensor: tensor, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    keep: int | None = None
    if gradient_state.end_of_dataloader:
        remainder = gradient_state.remainder
        if remainder == -1:
            logger.info(
                "gather_for_metrics: the data loader's length is unknown, so padding added to "
                "the last batch cannot be removed"
            )
        elif remainder > 0:
            keep = remainder
    if use_gather_object or not all_tensors:
        if representatives is not None and PartialState().process_index not in representatives:
            input_data = _empty_like(input_data)
        return _gather_rows(input_data, keep)
    gathered = gather(input_data)
    if representatives is not None:
        gathered = _keep_ranks(gathered, representatives, PartialState().num_processes)
    return trim_to_dataset(gathered, keep) if keep is not None else gathered
