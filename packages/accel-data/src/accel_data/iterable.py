"""Sharding of iterable datasets: every process reads the stream, each keeps its own slice.

An ``IterableDataset`` cannot be indexed, so ``IterableDatasetShard`` lets every process read
the same stream, groups it into buffers of one global batch and keeps this process's
contiguous slice of each buffer. At the end of the stream the last partial buffer is padded
with items from the first buffer so that every process yields the same number of items, and
the number of real items in that last buffer is recorded so that evaluation can count every
sample exactly once.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Sized
from typing import SupportsIndex, TypeVar

import torch
from torch.utils.data import IterableDataset

__all__ = ["IterableDatasetShard"]

_T = TypeVar("_T")
_SEED_MODULUS = 2**64


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int, or raise naming the argument when it is not one >= minimum."""
    if isinstance(value, bool):
        raise TypeError(f"IterableDatasetShard({name}={value!r}): {name} must be an int")
    if not isinstance(value, SupportsIndex):
        raise TypeError(
            f"IterableDatasetShard({name}={value!r}): {name} must be an int, "
            f"got {type(value).__name__}"
        )
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"IterableDatasetShard({name}={number}): {name} must be >= {minimum}")
    return number


class IterableDatasetShard(IterableDataset[_T]):
    """The share of one process of an iterable dataset.

    The stream is read in buffers of ``batch_size * num_processes`` items (``batch_size``
    items with ``split_batches``); of each buffer this process yields the contiguous slice
    ``[process_index * share, (process_index + 1) * share)``, where ``share`` is
    ``batch_size`` (``batch_size // num_processes`` with ``split_batches``). Concatenating
    the slices of all processes in rank order gives the buffer back.

    When the stream ends with a partial buffer: with ``drop_last`` it is dropped; otherwise it
    is padded with items from the start of the first full buffer (or, when the whole stream is
    shorter than one buffer, with the stream itself, repeated), so every process yields the
    same number of items.

    Args:
        dataset: The iterable dataset to shard; every process must read the same stream.
        batch_size: The batch size of one process, or the global batch size with
            ``split_batches``.
        drop_last: Drop the last partial buffer instead of padding it.
        num_processes: The number of processes sharing the stream.
        process_index: The rank of this process, in ``[0, num_processes)``.
        split_batches: ``batch_size`` is the global batch size, split between the processes.

    Attributes:
        epoch (int): The epoch last passed to ``set_epoch`` (0 before any call).
        last_buffer_real_items (int): Set when an iteration runs to its end: how many items of
            the last buffer this shard yielded from were real, out of the buffer's size
            (``batch_size * num_processes``, or ``batch_size`` with ``split_batches``); it
            equals the buffer's size when no padding was needed and is 0 when nothing was
            yielded. Gathering the last batch of every process in rank order and keeping its
            first ``last_buffer_real_items`` items counts every sample once; this process's
            own real items in its last slice are
            ``min(share, max(0, last_buffer_real_items - process_index * share))``. It is 0
            before the first complete iteration, and it is updated in this object only, so
            not when the dataset is iterated in ``DataLoader`` worker processes
            (``num_workers > 0``).

    Raises:
        TypeError: An integer argument is not an int.
        ValueError: ``batch_size < 1``, ``num_processes < 1``, ``process_index`` outside
            ``[0, num_processes)``, or, with ``split_batches``, a ``batch_size`` that is not
            a multiple of ``num_processes``.
    """

    def __init__(
        self,
        dataset: Iterable[_T],
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        batch_size = _check_int("batch_size", batch_size, 1)
        num_processes = _check_int("num_processes", num_processes, 1)
        process_index = _check_int("process_index", process_index, 0)
        if process_index >= num_processes:
            raise ValueError(
                f"IterableDatasetShard(num_processes={num_processes}, "
                f"process_index={process_index}): process_index must be in "
                f"[0, {num_processes - 1}]; pass the rank of this process"
            )
        if split_batches and batch_size % num_processes != 0:
            raise ValueError(
                f"IterableDatasetShard(split_batches=True): the batch size ({batch_size}) must "
                f"be a multiple of num_processes ({num_processes}) to split every batch into "
                f"{num_processes} equal slices; choose a batch size divisible by "
                f"{num_processes} or pass split_batches=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = bool(split_batches)
        self.epoch = 0
        self.last_buffer_real_items = 0
        generator = self._dataset_generator()
        self._generator_seed: int | None = (
            generator.initial_seed() if generator is not None else None
        )

    @property
    def _buffer_size(self) -> int:
        """Items read from the stream per step of all processes together."""
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def _share(self) -> int:
        """Items of each buffer this process yields."""
        return self._buffer_size // self.num_processes

    def _dataset_generator(self) -> torch.Generator | None:
        """The dataset's ``generator`` when it is a torch.Generator and set_epoch is absent."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            return None
        generator = getattr(self.dataset, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _reseed_dataset(self) -> None:
        """Reseed the dataset's generator (if any) with its initial seed plus the epoch."""
        generator = self._dataset_generator()
        if generator is None:
            return
        if self._generator_seed is None:
            self._generator_seed = generator.initial_seed()
        generator.manual_seed((self._generator_seed + self.epoch) % _SEED_MODULUS)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, and pass it on to the dataset.

        A dataset with ``set_epoch`` receives the epoch; otherwise a dataset whose
        ``generator`` attribute is a ``torch.Generator`` has it reseeded with the generator's
        seed at construction plus ``epoch`` (also at the start of every iteration).

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        self.epoch = _check_int("epoch", epoch, 0)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        else:
            self._reseed_dataset()

    def __len__(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError(
                "IterableDatasetShard has no length: the wrapped "
                f"{type(self.dataset).__name__} does not define __len__"
            )
        buffer = self._buffer_size
        total = len(self.dataset)
        buffers = total // buffer if self.drop_last else math.ceil(total / buffer)
        return buffers * self._share

    def __iter__(self) -> Iterator[_T]:
        self._reseed_dataset()
        size = self._buffer_size
        start = self.process_index * self._share
        stop = start + self._share
        first: list[_T] | None = None
        buffer: list[_T] = []
        real = 0
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == size:
                yield from buffer[start:stop]
                real = size
                if first is None:
                    first = buffer
                buffer = []
        if buffer and not self.drop_last:
            real = len(buffer)
            source = first if first is not None else list(buffer)
            buffer.extend(itertools.islice(itertools.cycle(source), size - len(buffer)))
            yield from buffer[start:stop]
        self.last_buffer_real_items = real
