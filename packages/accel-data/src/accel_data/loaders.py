"""Prepared data loaders: the shared state mixin, ``DataLoaderShard`` and ``SkipDataLoader``.

A prepared loader *is* a ``torch.utils.data.DataLoader`` (a subclass, so ``isinstance`` holds,
it pickles, and every DataLoader argument keeps its meaning). On top it:

- knows which batch is the last one before yielding it, so ``end_of_dataloader`` is already
  true while the last batch is being used (gradient accumulation syncs on it, metrics drop
  padding on it): by counting when the batch sampler's length is exact, otherwise by reading
  one batch ahead;
- registers itself in :class:`~accel_state.GradientState` while it is iterated;
- synchronises the random generators named in ``rng_types`` at the start of each epoch and
  forwards the epoch to the sampler or dataset (``set_epoch``);
- moves each batch to ``device``;
- records where it is (epoch, batches yielded, the sampler's order state) in
  ``state_dict()``, and continues exactly there after ``load_state_dict()``.

``remainder`` is the number of real samples in the last *gathered* batch (the concatenation
of every process's last batch in rank order) when that batch holds padding, which is what
``gather_for_metrics`` needs to return each sample exactly once.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accel_state import GradientState, device_mover, synchronize_rng_states
from accel_state.torch_support import torch_has

from .iterable import IterableDatasetShard
from .resume import (
    capture_order_state,
    get_sampler,
    is_reseeded_each_epoch,
    reseed_like_pytorch,
    restore_order_state,
)
from .samplers import BatchSamplerShard, SkipBatchSampler

__all__ = [
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "SkipDataLoader",
]

#: Keyword arguments of ``torch.utils.data.DataLoader`` and their defaults: a prepared loader
#: copies each of them from the original loader. ``in_order`` only where torch has it (2.6).
PYTORCH_DATALOADER_KWARGS: dict[str, Any] = {
    "batch_size": 1,
    "shuffle": False,
    "sampler": None,
    "batch_sampler": None,
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "drop_last": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "generator": None,
    "prefetch_factor": None,
    "persistent_workers": False,
    "pin_memory_device": "",
}
if torch_has("dataloader_in_order"):
    PYTORCH_DATALOADER_KWARGS["in_order"] = True

_STATE_VERSION = 1


class _Progress:
    """Where the current epoch is; mutated in the iteration loop without attribute hooks."""

    __slots__ = ("in_epoch", "yielded")

    def __init__(self) -> None:
        self.yielded = 0
        self.in_epoch = False

    def __getstate__(self) -> tuple[int, bool]:
        return (self.yielded, self.in_epoch)

    def __setstate__(self, state: tuple[int, bool]) -> None:
        self.yielded, self.in_epoch = state


class DataLoaderStateMixin:
    """``end_of_dataloader`` / ``remainder`` bookkeeping and ``GradientState`` registration.

    Attributes:
        end_of_dataloader: True while the last batch of the epoch is being used.
        remainder: How many leading rows of the last gathered batch are real, when
            positive: ``len(dataset) % total_batch_size`` for sharded data (``0``: no
            padding), the rows read for the last step when dispatching. ``-1`` when unknown
            (an iterable dataset without length read by workers).
    """

    end_of_dataloader: bool = False
    remainder: int = -1
    #: False when a wrapper iterated in the training loop's thread registers instead (XLA).
    registers_in_gradient_state: bool = True

    @property
    def gradient_state(self) -> GradientState:
        """The run's ``GradientState`` (the shared one; Accelerate's loaders hold it too)."""
        return GradientState()

    def reset(self) -> None:
        """Forget the end-of-epoch flags."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Mark the start of an epoch: compute the remainder and register in GradientState."""
        self.reset()
        if not getattr(self, "_drop_last", False):
            length = self._known_length()
            if length is not None:
                self.remainder = length % self.total_batch_size  # type: ignore[attr-defined]
        if self.registers_in_gradient_state:
            GradientState()._add_dataloader(self)

    def end(self) -> None:
        """Mark the end of an epoch: unregister from GradientState."""
        if self.registers_in_gradient_state:
            GradientState()._remove_dataloader(self)

    def _known_length(self) -> int | None:
        try:
            return int(self.total_dataset_length)  # type: ignore[attr-defined]
        except (TypeError, NotImplementedError, AttributeError):
            return None


class _ItselfOnInstances:
    """``loader.base_dataloader``: the ``DataLoader`` doing the loading, i.e. the loader itself.

    accel's prepared loaders are real DataLoaders, where Accelerate's adapters wrap one. As in
    Accelerate it is an attribute of instances: reading it on the class raises AttributeError.
    """

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            raise AttributeError("base_dataloader is an attribute of loader instances")
        return instance


class PreparedLoader(DataLoaderStateMixin, DataLoader):
    """What ``DataLoaderShard`` and ``DataLoaderDispatcher`` share: epochs, state, devices."""

    device: torch.device | str | None
    iteration: int
    skip_batches: int
    _drop_last: bool
    _non_blocking: bool
    _resume: dict[str, Any] | None
    _epoch_order_state: dict[str, Any] | None
    _epoch_seed_state: torch.Tensor | None
    _pending_seed_state: torch.Tensor | None
    _progress: _Progress
    _target: torch.device | None

    def _init_prepared(
        self,
        device: torch.device | str | None,
        skip_batches: int,
        drop_last: bool,
        non_blocking: bool,
        iteration: int,
    ) -> None:
        if not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(
                f"skip_batches={skip_batches!r} must be a non-negative integer (batches to skip "
                "at the start of each epoch)"
            )
        self.device = device
        self.skip_batches = skip_batches
        self._drop_last = drop_last
        self._non_blocking = non_blocking
        self.iteration = iteration
        self._resume = None
        self._epoch_order_state = None
        self._epoch_seed_state = None
        self._pending_seed_state = None
        self._progress = _Progress()
        self._target = None if device is None else torch.device(device)

    base_dataloader = _ItselfOnInstances()

    # -- epochs --------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Tell the samplers (or else the dataset) which epoch starts, and remember it.

        Every batch sampler of the chain and every index sampler behind them that has
        ``set_epoch`` gets the epoch (a custom batch sampler and the sampler it draws from
        both count epochs); the dataset gets it when none of them takes it.
        """
        if self.iteration != epoch:
            self.iteration = epoch
        told = False
        for holder in self._sampler_chain():
            if isinstance(holder, (BatchSamplerShard, SkipBatchSampler)):
                continue  # accel's own wrappers only forward the epoch to what they wrap
            if callable(getattr(holder, "set_epoch", None)):
                holder.set_epoch(epoch)
                told = True
        if not told and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _sampler_chain(self) -> list[Any]:
        """The batch samplers from the outermost in, then the index sampler behind them."""
        chain: list[Any] = []
        holder: Any = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        while holder is not None and all(holder is not seen for seen in chain):
            chain.append(holder)
            inner = getattr(holder, "batch_sampler", None)
            holder = inner if inner is not None else getattr(holder, "sampler", None)
        return chain

    def _start_epoch(self) -> int:
        """Apply a pending resume, record the order state; return the batches to skip."""
        skip = self.skip_batches
        sampler = get_sampler(self)
        self._pending_seed_state = None
        if self._resume is not None:
            resume, self._resume = self._resume, None
            restore_order_state(sampler, resume["order"])
            skip += int(resume["batches_yielded"])
            self._pending_seed_state = resume.get("seed_state")
        self._epoch_order_state = capture_order_state(sampler)
        self._progress.yielded = skip - self.skip_batches
        self._progress.in_epoch = True
        return skip

    def _base_iterator(self, skip: int) -> Iterator[Any]:
        """Start the plain DataLoader iteration with its batch sampler ``skip`` batches in.

        The skipped batches' samples are never loaded. Only valid when
        :meth:`_sampler_can_skip`; otherwise call with ``skip=0`` and drop batches instead.
        """
        iterate = DataLoader.__iter__
        with self._iterator_seed():
            if skip == 0:
                return iterate(self)
            attribute = "batch_sampler" if self.batch_sampler is not None else "sampler"
            original = getattr(self, attribute)
            # DataLoader forbids reassigning its sampler after construction; the swap lasts
            # only while the epoch's iterator is built (it keeps its own reference).
            object.__setattr__(self, attribute, SkipBatchSampler(original, skip_batches=skip))
            try:
                return iterate(self)
            finally:
                object.__setattr__(self, attribute, original)

    @contextlib.contextmanager
    def _iterator_seed(self) -> Iterator[None]:
        """Make a resumed epoch's iterator draw the same base seed as the original one.

        Building a DataLoader iterator draws one number (the workers' base seed) from the
        loader's generator, or from torch's global generator. A run resumed mid-epoch must
        not draw from the global generator again after the restored random state (dropout
        would then see another stream), and its workers must get the original seed: the
        global state from just before the original draw is kept in ``state_dict()`` and
        replayed here, after which the global generator is put back exactly where the
        checkpoint left it.
        """
        saved, self._pending_seed_state = self._pending_seed_state, None
        if self.generator is not None:
            # The loader's own generator: the order state restores it to the epoch's start,
            # before the draw, so the draw replays by itself.
            self._epoch_seed_state = None
            yield
            return
        get_state, set_state = torch.get_rng_state, torch.set_rng_state
        current = get_state()
        self._epoch_seed_state = saved if saved is not None else current
        if saved is not None:
            set_state(saved)
        sampler = get_sampler(self)
        reseeded = is_reseeded_each_epoch(sampler)
        try:
            if reseeded:
                reseed_like_pytorch(sampler)
            yield
            if reseeded:
                torch.empty((), dtype=torch.int64).random_()  # the draw PyTorch's sampler makes
        finally:
            if saved is not None:
                set_state(current)

    def _exact_length(self) -> int | None:
        """Batches this epoch will yield, when the batch sampler's length is exact.

        True for torch's ``BatchSampler`` over a sized sampler and for ``BatchSamplerShard``
        except with ``split_batches`` and ``even_batches=False`` (where, as in Accelerate, a
        process may get one batch fewer than ``len`` says). ``None`` otherwise: the loader
        then reads one batch ahead to find the end.
        """
        if isinstance(self.dataset, IterableDataset) or self.skip_batches:
            return None
        index_sampler: Any = self.batch_sampler if self.batch_sampler is not None else self.sampler
        kind = type(index_sampler)
        if kind is BatchSamplerShard:
            if index_sampler.split_batches and not index_sampler.even_batches:
                return None
            inner = index_sampler.batch_sampler
            if type(inner) is not BatchSampler:
                return None
        elif kind is not BatchSampler:
            return None
        try:
            return len(index_sampler)
        except TypeError:
            return None

    def _sampler_can_skip(self) -> bool:
        index_sampler = self.batch_sampler if self.batch_sampler is not None else self.sampler
        reused_workers = self.persistent_workers and self.num_workers > 0
        return (
            not isinstance(self.dataset, IterableDataset)
            and isinstance(index_sampler, BatchSampler)
            and not reused_workers
        )

    def _finish_epoch(self) -> None:
        self.iteration += 1
        self._progress.yielded = 0
        self._progress.in_epoch = False

    # -- properties ----------------------------------------------------------------------

    @property
    def total_batch_size(self) -> int:
        """Samples consumed per step over all processes."""
        dataset = self.dataset
        if isinstance(dataset, IterableDatasetShard):
            if dataset.split_batches:
                return int(dataset.batch_size)
            return int(dataset.batch_size) * int(dataset.num_processes)
        batch_sampler = (
            self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        )
        size = int(getattr(batch_sampler, "batch_size", None) or self.batch_size or 1)
        if getattr(batch_sampler, "split_batches", False):
            return size
        return size * int(getattr(batch_sampler, "num_processes", 1))

    @property
    def total_dataset_length(self) -> int:
        """Number of samples in the dataset (over all processes)."""
        dataset = self.dataset
        if hasattr(dataset, "total_length"):
            return int(dataset.total_length)
        if isinstance(dataset, IterableDatasetShard):
            return len(dataset.dataset)  # type: ignore[arg-type]
        return len(dataset)  # type: ignore[arg-type]

    def get_sampler(self) -> Any:
        """The index sampler behind this loader."""
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        """Replace the index sampler behind the batch sampler (used for seedable samplers)."""
        holder = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        while holder is not None and hasattr(holder, "batch_sampler"):
            holder = holder.batch_sampler
        if holder is None or not hasattr(holder, "sampler"):
            raise ValueError(
                "set_sampler: this loader has no batch sampler holding an index sampler to replace"
            )
        holder.sampler = sampler

    # -- resume --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: epoch, batches already yielded in it, and its order state.

        Loading it into a loader prepared the same way, in a new process, makes the next
        iteration yield exactly the remaining batches of that epoch, in the same order; the
        epochs after it are those of an uninterrupted run.
        """
        pending = self._resume
        if pending is not None:  # loaded, not iterated yet: where the next iteration starts
            seed_state = pending.get("seed_state")
            return {
                "version": _STATE_VERSION,
                "epoch": self.iteration,
                "batches_yielded": int(pending["batches_yielded"]),
                "order": pending["order"],
                "in_epoch": True,
                "seed_state": seed_state.tolist() if seed_state is not None else None,
            }
        if not self._progress.in_epoch or self._epoch_order_state is None:
            return {
                "version": _STATE_VERSION,
                "epoch": self.iteration,
                "batches_yielded": 0,
                "order": capture_order_state(get_sampler(self)),
                "in_epoch": False,
            }
        return {
            "version": _STATE_VERSION,
            "epoch": self.iteration,
            "batches_yielded": self._progress.yielded,
            "order": self._epoch_order_state,
            "in_epoch": True,
            # Plain ints (not a tensor): states travel through queues and JSON-like stores.
            "seed_state": (
                self._epoch_seed_state.tolist() if self._epoch_seed_state is not None else None
            ),
        }

    def resume_offset(self) -> int:
        """Batches of its epoch the next iteration starts after (a pending resume)."""
        return int(self._resume["batches_yielded"]) if self._resume is not None else 0

    def state_dict_at(self, epoch: int, batches_yielded: int) -> dict[str, Any]:
        """:meth:`state_dict` as if ``batches_yielded`` batches of ``epoch`` had been used.

        For a consumer that runs behind the iteration (the XLA preloader reads ahead):
        ``epoch`` is the epoch in progress, or the one that just finished.
        """
        state = self.state_dict()
        if state["in_epoch"] and state["epoch"] == epoch:
            return {**state, "batches_yielded": batches_yielded}
        if self.iteration != epoch + 1 or self._epoch_order_state is None:
            raise RuntimeError(
                f"state_dict_at(epoch={epoch}): the loader is in epoch {self.iteration}, so "
                "where its consumer stands is not known"
            )
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "batches_yielded": batches_yielded,
            "order": self._epoch_order_state,
            "in_epoch": True,
            "seed_state": (
                self._epoch_seed_state.tolist() if self._epoch_seed_state is not None else None
            ),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration resumes that epoch.

        Raises:
            ValueError: the state is not a loader state, or was saved with another kind of
                sampler.
        """
        missing = {"epoch", "batches_yielded", "order"} - set(state_dict)
        if missing:
            raise ValueError(
                f"load_state_dict: not a prepared-loader state (missing {sorted(missing)}); pass "
                "what state_dict() returned"
            )
        sampler = get_sampler(self)
        # Validate before changing anything.
        restore_order_state(sampler, state_dict["order"])
        self.iteration = int(state_dict["epoch"])
        if state_dict.get("in_epoch", True):
            self._resume = {
                "order": state_dict["order"],
                "batches_yielded": int(state_dict["batches_yielded"]),
                "seed_state": _as_byte_tensor(state_dict.get("seed_state")),
            }
        else:
            self._resume = None
        # An iteration stopped before the load is over: its position is not the loader's.
        self._progress.in_epoch = False
        self._progress.yielded = 0

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_iterator"] = None  # live worker processes do not travel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _mover(self) -> Callable[[Any], Any]:
        """The per-batch device move, with its arguments bound once per epoch."""
        if self._target is None:
            return _unchanged
        return device_mover(self._target, non_blocking=self._non_blocking)


class DataLoaderShard(PreparedLoader):
    """A ``DataLoader`` that yields this process's shard, on its device, one batch ahead.

    Args:
        dataset: The dataset (already wrapped in an ``IterableDatasetShard`` when iterable).
        device: Where batches are moved; ``None`` leaves them where they are.
        rng_types: Generators synchronised from rank 0 at each epoch start (``"torch"``,
            ``"cuda"``, ``"generator"``, ...).
        synchronized_generator: The sampler's generator, for ``"generator"`` in ``rng_types``.
        skip_batches: Batches skipped at the start of every epoch.
        use_stateful_dataloader: Accepted for compatibility (every prepared loader resumes).
        iteration: The epoch the next iteration starts.
        **kwargs: Every other ``torch.utils.data.DataLoader`` argument, plus ``_drop_last``
            and ``_non_blocking``.
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        rng_types: list[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self._init_prepared(device, skip_batches, _drop_last, _non_blocking, iteration)
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.use_stateful_dataloader = use_stateful_dataloader
        self.torch_device_mesh = torch_device_mesh

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.rng_types is not None:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        try:
            self.set_epoch(self.iteration)
            skip = self._start_epoch()
            known = self._exact_length()
            if self._sampler_can_skip():
                base, skip = self._base_iterator(skip), 0
                known = None if known is None else known - self._progress.yielded
            else:
                base = self._base_iterator(0)
                known = None
            if known is not None:
                # The batch count is exact: flag the last batch by its index instead of
                # reading one batch ahead (the previous batch's memory is then reused).
                progress, move = self._progress, self._mover()
                for batch in itertools.islice(base, max(0, known - 1)):
                    progress.yielded += 1
                    yield move(batch)
                batch = next(base, _END)
                if batch is not _END:
                    self.end_of_dataloader = True
                    progress.yielded += 1
                    yield move(batch)
                # Finish the sampler's pass: samplers may draw from their generator (or count
                # the epoch) after their last batch, and the next epoch depends on it.
                for _ in base:
                    pass
                self._finish_epoch()
                return
            for _ in range(skip):  # batches the sampler could not skip: read and drop
                if next(base, _END) is _END:
                    break
            current = next(base, _END)
            if current is _END:
                self._set_iterable_remainder()
                self._finish_epoch()
                return
            # Hot loop, one batch ahead: locals only (DataLoader.__setattr__ is slow).
            progress, move = self._progress, self._mover()
            for upcoming in base:
                progress.yielded += 1
                yield move(current)
                current = upcoming
            self.end_of_dataloader = True
            self._set_iterable_remainder()
            progress.yielded += 1
            yield move(current)
            self._finish_epoch()
        finally:
            self.end()

    def _set_iterable_remainder(self) -> None:
        """For sharded iterable data, learn how much of the last buffer was real."""
        dataset = self.dataset
        if (
            isinstance(dataset, IterableDatasetShard)
            and not dataset.drop_last
            and self.num_workers == 0
        ):
            real = getattr(dataset, "last_buffer_real_items", None)
            if real is not None:
                self.remainder = int(real) % self.total_batch_size

    def __reduce__(self) -> Any:
        return (rebuild_loader, (type(self), self.__getstate__()))


class SkipDataLoader(DataLoaderShard):
    """A ``DataLoaderShard`` that skips the first ``skip_batches`` batches of every epoch.

    Args:
        dataset: The dataset.
        skip_batches: Batches to skip.
        **kwargs: As for :class:`DataLoaderShard`.
    """

    def __init__(self, dataset: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, skip_batches=skip_batches, **kwargs)


_END = object()  # end-of-iteration marker for next(iterator, default)


def _unchanged(batch: Any) -> Any:
    return batch


def rebuild_loader(cls: Any, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _as_byte_tensor(value: Any) -> torch.Tensor | None:
    """A saved generator state (list of ints or tensor) as the uint8 tensor torch expects."""
    if value is None:
        return None
    return torch.as_tensor(value, dtype=torch.uint8).clone()
