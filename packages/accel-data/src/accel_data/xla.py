"""The loader of an XLA run: torch_xla's ``MpDeviceLoader`` around a prepared shard.

On XLA, :func:`~accel_data.prepare_data_loader` returns a :class:`MpDeviceLoaderWrapper`
(Accelerate's name): torch_xla's preloader iterates the shard in background threads and
moves the batches to the XLA device, so the shard itself places nothing.

Those threads run ahead of the training loop by up to the preloader's queue. Accelerate
lets them drive the shard's bookkeeping, so ``end_of_dataloader`` (and with it the last
synchronising step of a gradient accumulation window) turns true several batches early, and
a checkpoint counts batches the loop never saw. Here the wrapper keeps that bookkeeping on
the consumer's side: it registers itself in ``GradientState``, flags the last batch by
looking one batch ahead on the device side, and its ``state_dict()`` counts the batches the
loop received, so a resume starts at the first batch the loop did not train on.

torch_xla is imported when the first wrapper is built (the class derives from torch_xla's
``MpDeviceLoader``), never when accel-data is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import torch

from accel_state import synchronize_rng_states

from .loaders import DataLoaderShard, DataLoaderStateMixin

__all__ = ["device_loader_class", "wrap_for_xla"]

_END = object()
_CLASS: list[type] = []


class _ConsumerSideLoader(DataLoaderStateMixin):
    """The methods of ``MpDeviceLoaderWrapper``; :func:`device_loader_class` adds the base.

    torch_xla's ``MpDeviceLoader`` comes last in the wrapper's bases, so ``super()`` here
    reaches it: it keeps the shard as ``_loader`` and its ``__iter__`` preloads on the device.
    """

    _loader: DataLoaderShard

    def __init__(self, dataloader: DataLoaderShard, device: torch.device) -> None:
        super().__init__(dataloader, device)  # type: ignore[call-arg]
        # The preloading threads must not draw from (or touch) the XLA RNG: the wrapper
        # synchronises the generators once per epoch, from the loop's thread.
        self._rng_types = dataloader.rng_types
        dataloader.rng_types = None
        dataloader.registers_in_gradient_state = False
        self.device = device
        self._consumed = 0
        self._epoch: int | None = None
        self._start = 0

    def __iter__(self) -> Iterator[Any]:
        shard = self._loader
        if self._rng_types is not None:
            synchronize_rng_states(self._rng_types, shard.synchronized_generator)
        self._epoch, self._start = shard.iteration, shard.resume_offset()
        self._consumed = 0
        self.begin()
        try:
            batches = super().__iter__()  # type: ignore[misc]
            current = next(batches, _END)
            if current is _END:
                return
            for upcoming in batches:
                self._consumed += 1
                yield current
                current = upcoming
            self.end_of_dataloader = True
            self._consumed += 1
            yield current
        finally:
            self._epoch = None
            self.end()

    def __len__(self) -> int:
        return len(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """Set the shard's epoch (its sampler's shuffle)."""
        self._loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is (not the preloader): see the module docstring."""
        shard = self._loader
        if self._epoch is None:
            return shard.state_dict()
        return shard.state_dict_at(self._epoch, self._start + self._consumed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the shard where a :meth:`state_dict` left it."""
        self._loader.load_state_dict(state_dict)

    @property
    def dataloader(self) -> DataLoaderShard:
        """The prepared shard."""
        return self._loader

    @property
    def total_batch_size(self) -> int:
        """Samples per step over every process."""
        return int(self._loader.total_batch_size)

    @property
    def total_dataset_length(self) -> int:
        """Length of the dataset over every process."""
        return int(self._loader.total_dataset_length)

    @property
    def batch_sampler(self) -> Any:
        """The shard's batch sampler."""
        return self._loader.batch_sampler

    @property
    def dataset(self) -> Any:
        """The shard's dataset."""
        return self._loader.dataset

    @property
    def _drop_last(self) -> bool:
        return bool(self._loader._drop_last)

    @property
    def batch_size(self) -> Any:
        """The shard's batch size."""
        return self._loader.batch_size


_WRAPPER_DOC = """A prepared shard whose batches torch_xla's preloader moves to the XLA device.

    Attributes:
        device: The XLA device batches arrive on.
        dataloader: The prepared shard (``DataLoaderShard``).
    """


def device_loader_class() -> type:
    """``MpDeviceLoaderWrapper``: a subclass of ``torch_xla``'s ``MpDeviceLoader`` (cached)."""
    if _CLASS:
        return _CLASS[0]
    xpl = importlib.import_module("torch_xla.distributed.parallel_loader")
    wrapper = type(
        "MpDeviceLoaderWrapper",
        (_ConsumerSideLoader, xpl.MpDeviceLoader),
        {"__module__": __name__, "__doc__": _WRAPPER_DOC},
    )
    _CLASS.append(wrapper)
    return wrapper


def wrap_for_xla(loader: Any, device: torch.device | str | None) -> Any:
    """``loader`` inside an ``MpDeviceLoaderWrapper`` on ``device``.

    Raises:
        ValueError: ``loader`` dispatches batches from one process (on XLA each process
            reads its own shard; pass ``dispatch_batches=False``).
    """
    if not isinstance(loader, DataLoaderShard):
        raise ValueError(
            f"prepare_data_loader on XLA: a {type(loader).__name__} cannot be wrapped for the "
            "XLA preloader (each XLA process reads its own shard); pass dispatch_batches=False"
        )
    return device_loader_class()(loader, torch.device(device) if device is not None else None)
