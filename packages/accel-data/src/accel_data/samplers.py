"""Samplers for sharded data loading: a seedable shuffle, per-rank batch shards, batch skipping.

``SeedableRandomSampler`` shuffles from its own generator, reseeded at every epoch with
``initial_seed + epoch``, so every rank draws the same order and a resumed run draws the
order it would have drawn. ``BatchSamplerShard`` hands the batches of one batch sampler to
the ranks in turn (or cuts each batch into one slice per rank) and fills the last round so
that every rank steps the same number of times. ``SkipBatchSampler`` drops the first batches
of an epoch, which is how a run resumes in the middle of one.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator, Sized
from typing import Any, SupportsIndex

import torch
from torch.utils.data import BatchSampler, RandomSampler

__all__ = ["BatchSamplerShard", "SeedableRandomSampler", "SkipBatchSampler"]

_SEED_MODULUS = 2**64


def _check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int, or raise naming the argument when it is not one >= minimum."""
    if isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be an int, not a bool")
    if not isinstance(value, SupportsIndex):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be an int, got {type(value).__name__}"
        )
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"{owner}({name}={number}): {name} must be >= {minimum}")
    return number


def _check_rank(owner: str, num_processes: object, process_index: object) -> tuple[int, int]:
    """Validate a (num_processes, process_index) pair and return it as ints."""
    count = _check_int(owner, "num_processes", num_processes, 1)
    index = _check_int(owner, "process_index", process_index, 0)
    if index >= count:
        raise ValueError(
            f"{owner}(num_processes={count}, process_index={index}): process_index must be "
            f"in [0, {count - 1}]; pass the rank of this process among the {count} processes"
        )
    return count, index


def _sized_length(owner: str, obj: object) -> int:
    """``len(obj)``, with an error naming the wrapper when the wrapped object has no length."""
    if not isinstance(obj, Sized):
        raise TypeError(
            f"{owner} has no length: the wrapped {type(obj).__name__} does not define __len__"
        )
    return len(obj)


def _forward_epoch(batch_sampler: object, epoch: int) -> None:
    """Pass ``epoch`` to a batch sampler, or else to its sampler, when either takes one."""
    set_epoch = getattr(batch_sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
        return
    sampler_set_epoch = getattr(getattr(batch_sampler, "sampler", None), "set_epoch", None)
    if callable(sampler_set_epoch):
        sampler_set_epoch(epoch)


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on a seed and the epoch.

    Every ``__iter__`` reseeds the sampler's generator with ``initial_seed + epoch`` before
    drawing, and advances ``epoch`` by one once the order has been drawn in full. The order
    therefore never depends on the global RNG, on what happened in earlier epochs or on the
    number of processes the batches are later shared between; restoring ``epoch`` (and
    ``initial_seed``) reproduces an epoch exactly.

    Args:
        data_source: The dataset (anything with a length) to draw indices for.
        replacement: Draw with replacement.
        num_samples: How many indices to draw per epoch (default: ``len(data_source)``).
        generator: The generator to draw from; it is reseeded at every epoch. A new CPU
            generator is made when omitted.
        data_seed: The seed of epoch 0. When omitted, torch's seed
            (``torch.initial_seed()``, which ``set_seed`` sets) is used, as in Accelerate;
            nothing is drawn from the global RNG. Several processes must agree on it, which
            ``prepare_data_loader`` arranges (it passes rank 0's).

    Attributes:
        initial_seed (int): The seed of epoch 0.
        epoch (int): The epoch the next ``__iter__`` draws; ``set_epoch`` changes it.

    Raises:
        TypeError: ``data_seed`` is not an int, or ``replacement`` is not a bool.
        ValueError: ``num_samples`` is not a positive int (checked by ``RandomSampler``).
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        if data_seed is not None and (
            isinstance(data_seed, bool) or not isinstance(data_seed, int)
        ):
            raise TypeError(
                f"SeedableRandomSampler(data_seed={data_seed!r}): data_seed must be an int or None"
            )
        if generator is None:
            generator = torch.Generator()
        super().__init__(data_source, replacement, num_samples, generator)
        self.generator: torch.Generator = generator
        if data_seed is None:
            data_seed = int(torch.initial_seed())
        self.initial_seed: int = data_seed
        self.epoch: int = 0

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed((self.initial_seed + self.epoch) % _SEED_MODULUS)
        yield from super().__iter__()
        self.epoch += 1

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration draws (its seed is ``initial_seed + epoch``).

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        self.epoch = _check_int("SeedableRandomSampler.set_epoch", "epoch", epoch, 0)


class _WrappingBatchSampler(BatchSampler):
    """A batch sampler built around another one: forwards its sampler, length and epochs."""

    batch_sampler: Iterable[list[int]]

    @property
    def sampler(self) -> Any:
        """The sampler of the wrapped batch sampler (``None`` when it has none)."""
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value  # type: ignore[attr-defined]

    @property
    def total_length(self) -> int:
        """The number of batches of the wrapped batch sampler (all processes, none skipped)."""
        return _sized_length(type(self).__name__, self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to the wrapped batch sampler, or else to its sampler.

        Args:
            epoch: The epoch number.
        """
        _forward_epoch(self.batch_sampler, epoch)


class BatchSamplerShard(_WrappingBatchSampler):
    """The share of one process of the batches of a batch sampler.

    Without ``split_batches``, batch ``i`` of the wrapped sampler goes to process
    ``i % num_processes``; a process receives its batch of a round only once the whole round of
    ``num_processes`` batches has been seen with full-size batches. How the last, incomplete
    round ends:

    - the wrapped sampler drops its last batch (``drop_last=True``): the incomplete round is
      dropped, so every process gets the same number of full batches;
    - ``even_batches=True``: the round is completed with indices taken again from the start of
      the epoch (the first ``num_processes`` batches, repeated when the dataset is smaller than
      one round), so every process gets the same number of full-size batches;
    - ``even_batches=False``: the batches of the round go to the processes that own them, as
      they are; later processes get one batch fewer, and the short batch stays short.

    Batch samplers without a ``batch_size`` (or with ``batch_size=None``: variable-size
    batches) are cycled whole: a round is complete once it has ``num_processes`` batches, and
    with ``even_batches=True`` the missing batches of the last round are whole batches from the
    start of the epoch, in order.

    With ``split_batches``, every full batch is cut into ``num_processes`` equal slices and this
    process gets slice ``process_index``. A short last batch is completed with indices from the
    first batch (``even_batches=True``) or sliced as it is, so that later processes may get a
    short slice or none (``even_batches=False``).

    Args:
        batch_sampler: The batch sampler (any iterable of lists of indices) to share out.
        num_processes: The number of processes sharing it.
        process_index: The rank of this process, in ``[0, num_processes)``.
        split_batches: Cut every batch into slices instead of handing out whole batches.
        even_batches: Complete the last round so that every process gets as many batches,
            all of full size, as the others.

    Attributes:
        batch_size (int | None): The batch size of the wrapped sampler (``None`` when it has
            none).
        drop_last (bool): Whether the wrapped sampler drops its last short batch.

    Raises:
        TypeError: ``num_processes`` or ``process_index`` is not an int.
        ValueError: ``num_processes < 1``, ``process_index`` outside ``[0, num_processes)``,
            or, with ``split_batches``, a batch size that is missing or not a multiple of
            ``num_processes``.
    """

    batch_size: int | None  # type: ignore[assignment]

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        owner = "BatchSamplerShard"
        num_processes, process_index = _check_rank(owner, num_processes, process_index)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches:
            if batch_size is None:
                raise ValueError(
                    f"{owner}(split_batches=True) needs a batch sampler with a fixed batch_size; "
                    f"{type(batch_sampler).__name__} has batch_size=None. Pass "
                    "split_batches=False to hand out its (variable-size) batches whole"
                )
            if batch_size % num_processes != 0:
                raise ValueError(
                    f"{owner}(split_batches=True): the batch size ({batch_size}) must be a "
                    f"round multiple of num_processes ({num_processes}) to cut every batch into "
                    f"{num_processes} equal slices; choose a batch size divisible by "
                    f"{num_processes} or pass split_batches=False"
                )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = bool(split_batches)
        self.even_batches = bool(even_batches)
        self.batch_size = batch_size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    def __len__(self) -> int:
        total = self.total_length
        if self.split_batches:
            # One slice of every batch of the wrapped sampler.
            return total
        rounds, leftover = divmod(total, self.num_processes)
        if leftover == 0 or self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + 1 if self.process_index < leftover else rounds

    def __iter__(self) -> Iterator[list[int]]:
        if self.split_batches:
            return self._iter_slices()
        return self._iter_round_robin()

    def _iter_slices(self) -> Iterator[list[int]]:
        assert self.batch_size is not None
        size = self.batch_size
        width = size // self.num_processes
        start = width * self.process_index
        first: list[int] | None = None
        last: list[int] | None = None
        for batch in self.batch_sampler:
            if first is None:
                first = list(batch)
            last = batch
            if len(batch) == size:
                yield batch[start : start + width]
        if self.drop_last or first is None or last is None or len(last) == size:
            return
        if self.even_batches:
            # Complete the short batch with the first batch of the epoch (repeated if short).
            filler = itertools.islice(itertools.cycle(first), size - len(last))
            yield [*last, *filler][start : start + width]
        elif len(last) > start:
            yield last[start : start + width]

    def _iter_round_robin(self) -> Iterator[list[int]]:
        n, rank, size = self.num_processes, self.process_index, self.batch_size
        keep_head = not self.drop_last and self.even_batches
        head: list[list[int]] = []  # the first n batches, to complete the last round
        mine: list[int] | None = None  # this process's batch of the round in progress
        round_batches: list[list[int]] = []  # every batch of the round in progress
        for index, batch in enumerate(self.batch_sampler):
            if keep_head and index < n:
                head.append(batch)
            position = index % n
            if position == 0:
                round_batches = []
            round_batches.append(batch)
            if position == rank:
                mine = batch
            if position == n - 1 and (size is None or len(batch) == size):
                # The round is complete and full: every process takes its batch.
                assert mine is not None
                yield mine
                mine = None
                round_batches = []
        if self.drop_last or not round_batches:
            return
        yield from self._last_round(head, round_batches, mine)

    def _last_round(
        self, head: list[list[int]], round_batches: list[list[int]], mine: list[int] | None
    ) -> Iterator[list[int]]:
        """This process's batch of an incomplete last round (completed when even_batches)."""
        n, rank, size = self.num_processes, self.process_index, self.batch_size
        if not self.even_batches:
            if mine is not None:
                yield mine
            return
        if size is None:
            # Variable-size batches: missing batches are whole batches from the epoch start.
            if mine is not None:
                yield mine
            else:
                yield head[(rank - len(round_batches)) % len(head)]
            return
        # Fixed size: fill the round up to n full batches from the epoch's first indices.
        pool = itertools.cycle([index for batch in head for index in batch])
        for position in range(n):
            if position < len(round_batches):
                batch = round_batches[position]
                if len(batch) == size:
                    if position == rank:
                        yield batch
                    continue
                completed = [*batch, *itertools.islice(pool, size - len(batch))]
            else:
                completed = list(itertools.islice(pool, size))
            if position == rank:
                yield completed


class SkipBatchSampler(_WrappingBatchSampler):
    """A batch sampler that leaves out the first ``skip_batches`` batches of another.

    Used to resume in the middle of an epoch: the skipped batches are drawn (so the sampler's
    random state advances as it did) but not yielded. Skipping more batches than there are
    yields nothing.

    Args:
        batch_sampler: The batch sampler (any iterable of lists of indices) to skip into.
        skip_batches: How many batches to leave out at the start of each iteration.

    Attributes:
        batch_size (int | None): The batch size of the wrapped sampler (``None`` when it has
            none).
        drop_last (bool): Whether the wrapped sampler drops its last short batch.

    Raises:
        TypeError: ``skip_batches`` is not an int.
        ValueError: ``skip_batches`` is negative.
    """

    batch_size: int | None  # type: ignore[assignment]

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.skip_batches = _check_int("SkipBatchSampler", "skip_batches", skip_batches, 0)
        self.batch_sampler = batch_sampler
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    def __len__(self) -> int:
        return max(0, self.total_length - self.skip_batches)

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)
