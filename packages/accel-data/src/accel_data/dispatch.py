"""``DataLoaderDispatcher``: rank 0 reads the data, every process gets its slice.

Only the main process iterates the underlying loader. For each step it takes one batch
(``split_batches=True``) or one batch per process and joins them into a *global batch*,
broadcasts its structure (shapes and dtypes, with ``broadcast_object_list``) and then its
tensors (with ``broadcast``); each process keeps its contiguous slice of rows. The last
global batch, when its rows do not divide evenly, is completed by repeating its own first
rows, so padding always sits at the end of the gathered batch and ``remainder`` tells how
many rows are real.

Beyond Accelerate, batches whose non-batch dimensions differ (variable-length sequences
that the collate function did not pad to one length) do not crash: when the batches of one
step cannot be concatenated, each process receives one whole batch of its own (*per-rank
dispatch*: rank ``r`` gets the ``r``-th batch read for that step), so no tensor is padded or
cut. Non-tensor leaves (strings, ids) are sent with the structure and reach every process
unsliced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel_state import (
    PartialState,
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

from .loaders import PreparedLoader, rebuild_loader

__all__ = ["DataLoaderDispatcher"]


def _take_rows(batch: Any, rows: int) -> Any:
    """Extend every tensor of ``batch`` to ``rows`` rows by cycling its own rows."""

    def _extend(tensor: torch.Tensor) -> torch.Tensor:
        have = tensor.shape[0]
        if have >= rows:
            return tensor
        index = torch.arange(rows, device=tensor.device) % have
        return tensor.index_select(0, index)

    return recursively_apply(_extend, batch)


def _structure(batch: Any) -> Any:
    return get_data_structure(batch)


def _trailing_shapes(batch: Any) -> list[Any]:
    shapes: list[Any] = []
    recursively_apply(lambda t: shapes.append((tuple(t.shape[1:]), t.dtype)), batch)
    return shapes


def _join(batches: list[Any]) -> Any:
    """The batches of a step concatenated, or None when they cannot be (ragged, non-tensor)."""
    if any(_trailing_shapes(b) != _trailing_shapes(batches[0]) for b in batches):
        return None
    try:
        return concatenate(batches, dim=0)
    except TypeError:  # non-tensor leaves (strings, ids) cannot be joined row-wise
        return None


class DataLoaderDispatcher(PreparedLoader):
    """A ``DataLoader`` whose batches are read on rank 0 and sent to every process.

    Args:
        dataset: The full dataset (not sharded).
        split_batches: Each batch read is split between the processes (its size must be a
            multiple of the number of processes); otherwise one batch per process is read.
        skip_batches: Batches (of this process) skipped at the start of every epoch.
        use_stateful_dataloader: Accepted for compatibility (every prepared loader resumes).
        slice_fn: ``slice_fn(batch, slice, process_index, num_processes)`` cutting a
            process's rows out of the global batch (default: slicing every tensor).
        iteration: The epoch the next iteration starts.
        num_processes: How many slices a global batch is cut into (default: the number of
            processes; fewer when tensor- or context-parallel peers share a slice).
        process_index: Which slice this process keeps (default: its rank).
        **kwargs: Every other ``torch.utils.data.DataLoader`` argument, plus ``_drop_last``
            and ``_non_blocking``.
    """

    def __init__(  # noqa: PLR0913 - Accelerate's signature
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        num_processes: int | None = None,
        process_index: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        state = PartialState()
        self._init_prepared(state.device, skip_batches, _drop_last, _non_blocking, iteration)
        self.split_batches = split_batches
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self.use_stateful_dataloader = use_stateful_dataloader
        self.torch_device_mesh = torch_device_mesh
        # The data-parallel view (the ranks of a tensor- or context-parallel group share one
        # index and so one slice); the reading and the broadcasts stay with global rank 0.
        self.num_processes = state.num_processes if num_processes is None else num_processes
        self.process_index = state.process_index if process_index is None else process_index
        self._reads = state.process_index == 0

    # -- sizes ---------------------------------------------------------------------------

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            steps = whole
        elif self._drop_last:
            steps = whole // self.num_processes
        else:
            steps = math.ceil(whole / self.num_processes)
        return max(0, steps - self.skip_batches)

    @property
    def total_batch_size(self) -> int:
        """Samples consumed per step over all processes."""
        size = int(getattr(self.batch_sampler, "batch_size", None) or self.batch_size or 1)
        return size if self.split_batches else size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        """Number of samples in the dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    # -- reading on rank 0 ---------------------------------------------------------------

    def _fetch(self, base: Iterator[Any] | None) -> list[Any] | None:
        """On rank 0: the batches of the next step (1, or up to one per process); else None."""
        if base is None:
            return None
        wanted = 1 if self.split_batches else self.num_processes
        batches: list[Any] = []
        for _ in range(wanted):
            try:
                batches.append(next(base))
            except StopIteration:
                break
        if not batches or (self._drop_last and len(batches) < wanted):
            return None
        return batches

    def _plan(self, batches: list[Any] | None) -> tuple[dict[str, Any] | None, Any]:
        """On rank 0: what to announce about a step, and the data to send."""
        if batches is None:
            return None, None
        device = self.device
        assert device is not None  # always the process's device for a dispatcher
        batches = [send_to_device(b, device, non_blocking=self._non_blocking) for b in batches]
        n = self.num_processes
        glob = batches[0] if len(batches) == 1 else _join(batches)
        if glob is None:
            rows = sum(find_batch_size(b) for b in batches)
            per_rank = [batches[r % len(batches)] for r in range(n)]
            header = {
                "mode": "per_rank",
                "structures": [_structure(b) for b in per_rank],
                "rows": rows,
            }
            return header, per_rank
        rows = find_batch_size(glob)
        per_process = math.ceil(rows / n)
        if rows % n:
            glob = _take_rows(glob, per_process * n)
        header = {
            "mode": "slice",
            "structure": _structure(glob),
            "rows": rows,
            "per_process": per_process,
        }
        return header, glob

    def _announce(self, header: dict[str, Any] | None) -> dict[str, Any] | None:
        box = [header]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def _receive(self, header: dict[str, Any], payload: Any) -> Any:
        """Broadcast a step's tensors from rank 0 and return this process's share."""
        rank = self.process_index  # which share: the data-parallel index
        if header["mode"] == "per_rank":
            mine = None
            for source, structure in enumerate(header["structures"]):
                data = payload[source] if self._reads else self._allocate(structure)
                data = _broadcast_tensors(data)
                if source == rank:
                    mine = data
            return mine
        data = payload if self._reads else self._allocate(header["structure"])
        data = _broadcast_tensors(data)
        size = header["per_process"]
        return self.slice_fn(
            data,
            slice(rank * size, (rank + 1) * size),
            process_index=rank,
            num_processes=self.num_processes,
        )

    def _allocate(self, structure: Any) -> Any:
        assert self.device is not None
        return send_to_device(initialize_tensors(structure), self.device)

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.begin()
        try:
            self.set_epoch(self.iteration)
            skip = self._start_epoch()
            is_main = self._reads
            # Only rank 0 reads. Skipped steps are dropped on rank 0 alone (nothing is sent for
            # them): inside the batch sampler for map-style data, by reading otherwise.
            base = None
            if is_main:
                per_step = 1 if self.split_batches else self.num_processes
                if self._sampler_can_skip():
                    base, skip = self._base_iterator(skip * per_step), 0
                else:
                    base = self._base_iterator(0)
            for _ in range(skip):
                if self._fetch(base) is None:
                    break
            header, payload = self._plan(self._fetch(base)) if is_main else (None, None)
            header = self._announce(header)
            while header is not None:
                mine = self._receive(header, payload)
                upcoming_header, upcoming = (
                    self._plan(self._fetch(base)) if is_main else (None, None)
                )
                upcoming_header = self._announce(upcoming_header)
                if upcoming_header is None:
                    self.end_of_dataloader = True
                    self.remainder = int(header["rows"])
                self._progress.yielded += 1
                yield mine
                header, payload = upcoming_header, upcoming
            self._finish_epoch()
        finally:
            self.end()

    def __reduce__(self) -> Any:
        return (rebuild_loader, (type(self), self.__getstate__()))


def _broadcast_tensors(data: Any) -> Any:
    """Broadcast the tensor leaves of ``data`` from rank 0; other leaves stay as announced."""
    return recursively_apply(broadcast, data, from_process=0)
