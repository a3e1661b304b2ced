"""``prepare_data_loader`` and ``skip_first_batches``: the entry points other frameworks call.

``prepare_data_loader(dataloader)`` returns a loader that yields, on each process, its share
of the original loader's batches:

- map-style data, sharded: every process keeps its own batch sampler
  (:class:`~accel_data.BatchSamplerShard` around the original one) and reads only its batches;
- iterable data, sharded: :class:`~accel_data.IterableDatasetShard` keeps every process's
  slice of each run of batches;
- dispatched (``dispatch_batches=True``, the default for iterable data when batches go to a
  device): rank 0 reads everything and sends each process its slice
  (:class:`~accel_data.DataLoaderDispatcher`).

The prepared loader keeps every ``DataLoader`` argument of the original (workers,
``collate_fn``, ``pin_memory``, ...), is itself a ``DataLoader``, and can be saved and
resumed exactly with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel_state import DistributedType, PartialState, broadcast

from .dispatch import DataLoaderDispatcher
from .iterable import IterableDatasetShard
from .loaders import PYTORCH_DATALOADER_KWARGS, DataLoaderShard, PreparedLoader, SkipDataLoader
from .resume import get_sampler, mark_reseeded_each_epoch
from .samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from .xla import device_loader_class, wrap_for_xla

__all__ = ["MODEL_PARALLEL_DIMS", "data_parallel_view", "prepare_data_loader", "skip_first_batches"]

# Arguments the new batch sampler takes care of; the others are copied from the original.
_HANDLED_BY_SAMPLER = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _loader_kwargs(dataloader: DataLoader[Any]) -> dict[str, Any]:
    kwargs = {
        key: getattr(dataloader, key, default)
        for key, default in PYTORCH_DATALOADER_KWARGS.items()
        if key not in _HANDLED_BY_SAMPLER
    }
    if kwargs.get("num_workers", 0) == 0:
        # torch refuses these without workers.
        kwargs["prefetch_factor"] = None
        kwargs["persistent_workers"] = False
    return kwargs


def _fresh_generator(num_processes: int) -> torch.Generator:
    """A CPU generator seeded from torch's global generator (so ``set_seed`` governs it).

    With several processes in a process group the seed is rank 0's, so every process
    shuffles alike even when their global generators differ and no ``rng_types`` ask for
    synchronisation (Accelerate's shards then overlap silently).
    """
    seed = torch.empty((), dtype=torch.int64).random_()
    if (
        num_processes > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        seed = broadcast(seed.to(PartialState().device), from_process=0).cpu()
    generator = torch.Generator()
    generator.manual_seed(int(seed.item()))
    return generator


def _rank0_seed(num_processes: int) -> int:
    """``torch.initial_seed()`` of rank 0 (of this process without a process group)."""
    seed = torch.tensor(torch.initial_seed() % 2**63, dtype=torch.int64)
    if (
        num_processes > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        seed = broadcast(seed.to(PartialState().device), from_process=0).cpu()
    return int(seed.item())


def _batch_size_of(dataloader: DataLoader[Any]) -> int | None:
    if dataloader.batch_size is not None:
        return int(dataloader.batch_size)
    holder = (
        dataloader.sampler
        if isinstance(dataloader.sampler, BatchSampler)
        else dataloader.batch_sampler
    )
    size = getattr(holder, "batch_size", None)
    return int(size) if size is not None else None


#: Mesh dimensions whose ranks share their data (they split the model, not the batch).
MODEL_PARALLEL_DIMS = ("tp", "cp", "sp")


def data_parallel_view(mesh: Any) -> tuple[int, int]:
    """How many data shards ``mesh`` holds and which one this process reads.

    Every dimension not in :data:`MODEL_PARALLEL_DIMS` shards the data (Accelerate's
    ``dp_replicate`` and ``dp_shard``); the ranks along ``tp``, ``cp`` and ``sp`` share
    a shard. ``(1, 0)`` for a mesh of model-parallel dimensions only.
    """
    names = tuple(mesh.mesh_dim_names or ())
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"torch_device_mesh={mesh!r} does not contain this process: pass the run's mesh "
            "(accelerator.torch_device_mesh)"
        )
    count, index = 1, 0
    for position, size in enumerate(mesh.mesh.shape):
        name = names[position] if position < len(names) else f"dim{position}"
        if name in MODEL_PARALLEL_DIMS:
            continue
        count, index = count * int(size), index * int(size) + int(coordinate[position])
    return count, index


def prepare_data_loader(  # noqa: PLR0913 - Accelerate's signature
    dataloader: DataLoader[Any],
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader[Any]:
    """Wrap ``dataloader`` so that each process iterates its share of the batches.

    Args:
        dataloader: The loader to shard.
        device: Where batches go when ``put_on_device``.
        num_processes: Number of processes (default: from ``PartialState``).
        process_index: This process's rank (default: from ``PartialState``).
        split_batches: Split each original batch between the processes instead of giving
            each process whole batches (the batch size must be a multiple of
            ``num_processes``).
        put_on_device: Move batches to ``device``.
        rng_types: Generators synchronised from rank 0 at each epoch start (``"torch"``,
            ``"cuda"``, ``"generator"``, ...). ``"generator"`` is dropped when the sampler has
            no generator to synchronise.
        dispatch_batches: Read on rank 0 and send slices to the others. ``None``: only for
            iterable datasets, and only with ``put_on_device``.
        even_batches: Recycle samples from the start so every process gets as many batches.
        slice_fn_for_dispatch: Custom slicing of a dispatched global batch.
        use_seedable_sampler: Replace a ``RandomSampler`` by a
            :class:`~accel_data.SeedableRandomSampler` (same order for any number of processes).
        data_seed: Seed of the seedable sampler.
        non_blocking: Asynchronous copies to the device.
        use_stateful_dataloader: Accepted for compatibility: every prepared loader has exact
            ``state_dict()`` / ``load_state_dict()`` without torchdata.
        torch_device_mesh: The run's named ``DeviceMesh``: the data is then sharded over its
            data-parallel dimensions only (``num_processes`` and ``process_index`` become
            their size and this process's index there), so the ranks of a tensor- or
            context-parallel group (``tp``, ``cp``, ``sp``) get the same batches.

    Returns:
        A :class:`~accel_data.DataLoaderShard` or :class:`~accel_data.DataLoaderDispatcher`.

    Raises:
        ValueError: ``dispatch_batches`` without ``put_on_device``; ``split_batches`` with a
            batch size that is unknown or not a multiple of ``num_processes``; a
            ``process_index`` outside ``[0, num_processes)``.
    """
    on_xla = PartialState._shared_state.get("distributed_type") == DistributedType.XLA
    dispatch_batches = _dispatch_choice(dataloader, dispatch_batches, put_on_device, on_xla)
    processes, num_processes, process_index = _process_view(
        num_processes, process_index, torch_device_mesh
    )
    if split_batches:
        _check_splittable(dataloader, num_processes)

    seedable, synchronized_generator = _sampler_randomness(
        dataloader, processes, use_seedable_sampler, data_seed
    )
    dataset = dataloader.dataset
    # The seedable sampler goes into a copy: the user's loader keeps its own sampler, so
    # preparing it again (with another data_seed, say) starts from the original.
    batch_sampler = _original_batch_sampler(dataloader, detach=seedable is not None)
    if num_processes > 1 and not dispatch_batches:
        shard = _Sharding(num_processes, process_index, split_batches, even_batches)
        if isinstance(dataset, IterableDataset):
            generator = getattr(dataset, "generator", None)
            if isinstance(generator, torch.Generator):
                synchronized_generator = generator
            dataset = shard.dataset(dataset, dataloader)
        else:
            batch_sampler = shard.batch_sampler(batch_sampler)

    kwargs = _loader_kwargs(dataloader)
    kwargs.update(
        _batching_kwargs(
            dataloader,
            batch_sampler,
            per_process=num_processes if split_batches and not dispatch_batches else 1,
        )
    )
    prepared: PreparedLoader
    if dispatch_batches:
        kwargs.pop("generator", None)
        prepared = DataLoaderDispatcher(
            dataset,
            split_batches=split_batches,
            _drop_last=dataloader.drop_last,
            _non_blocking=non_blocking,
            slice_fn=slice_fn_for_dispatch,
            use_stateful_dataloader=use_stateful_dataloader,
            torch_device_mesh=torch_device_mesh,
            num_processes=num_processes,
            process_index=process_index,
            **kwargs,
        )
    else:
        prepared = DataLoaderShard(
            dataset,
            device=device if put_on_device and not on_xla else None,
            rng_types=_synchronised_rng(rng_types, synchronized_generator),
            synchronized_generator=synchronized_generator,
            _drop_last=dataloader.drop_last,
            _non_blocking=non_blocking,
            use_stateful_dataloader=use_stateful_dataloader,
            torch_device_mesh=torch_device_mesh,
            **kwargs,
        )
    if seedable is not None:
        prepared.set_sampler(seedable)
    if on_xla:
        # torch_xla's preloader moves the batches (see accel_data.xla), the shard does not.
        return wrap_for_xla(prepared, device)
    return prepared


def _dispatch_choice(
    dataloader: DataLoader[Any], dispatch_batches: bool | None, put_on_device: bool, on_xla: bool
) -> bool:
    """``dispatch_batches`` resolved (``None``: iterable data going to a device), or raise."""
    if on_xla and dispatch_batches:
        raise ValueError(
            "prepare_data_loader(dispatch_batches=True) on XLA: each XLA process reads its own "
            "shard through torch_xla's preloader; pass dispatch_batches=False"
        )
    if dispatch_batches is None:
        dispatch_batches = bool(
            put_on_device and not on_xla and isinstance(dataloader.dataset, IterableDataset)
        )
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "Using `dispatch_batches=True` requires `put_on_device=True`: dispatched batches are "
            "sent to each process's device; pass put_on_device=True or dispatch_batches=False"
        )
    return dispatch_batches


def _process_view(
    num_processes: int | None, process_index: int | None, mesh: Any
) -> tuple[int, int, int]:
    """``(processes, data shards, this process's shard)``, defaults from ``PartialState``.

    Every process must shuffle alike, also those that share a data shard (a tensor- or
    context-parallel group), so shuffling follows the processes, sharding the shards.

    Raises:
        ValueError: the shard index lies outside ``[0, shards)``.
    """
    if num_processes is None or process_index is None:
        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    processes = num_processes
    if mesh is not None:
        num_processes, process_index = data_parallel_view(mesh)
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index!r} and num_processes={num_processes!r} do not fit: "
            "the index must lie in [0, num_processes)"
        )
    return processes, num_processes, process_index


def _check_splittable(dataloader: DataLoader[Any], num_processes: int) -> None:
    """Raise unless the loader's batch size is known and a multiple of ``num_processes``."""
    batch_size = _batch_size_of(dataloader)
    if batch_size is None:
        raise ValueError(
            "split_batches=True needs a known batch size to split, but this loader's batch "
            "sampler has no `batch_size`; give the DataLoader a batch_size or use "
            "split_batches=False"
        )
    if batch_size % num_processes != 0:
        raise ValueError(
            f"To use `split_batches=True`, the batch size ({batch_size}) must be a multiple "
            f"of the number of processes ({num_processes}); choose a batch size divisible "
            f"by {num_processes} or use split_batches=False"
        )


def _sampler_randomness(
    dataloader: DataLoader[Any],
    processes: int,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> tuple[SeedableRandomSampler | None, torch.Generator | None]:
    """Make the loader's ``RandomSampler`` shuffle alike on every process.

    Returns:
        The seedable sampler to install (``use_seedable_sampler``), else ``None``; and the
        generator to synchronise from rank 0 at each epoch, if any.
    """
    sampler = get_sampler(dataloader)
    if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
        return None, None
    if use_seedable_sampler:
        seedable = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
            data_seed=data_seed if data_seed is not None else _rank0_seed(processes),
        )
        return seedable, None
    if sampler.generator is not None:
        return None, sampler.generator
    if processes > 1:
        # Every rank must shuffle alike: give the sampler its own generator, seeded from
        # rank 0's torch RNG at prepare (as Accelerate) and synchronised per epoch.
        sampler.generator = _fresh_generator(processes)
        return None, sampler.generator
    # One process: the order of plain PyTorch, which seeds the sampler from torch's RNG at
    # every epoch; the loader does that draw itself into a generator of the sampler's own,
    # so that the epoch's order can be recorded for exact resume.
    sampler.generator = torch.Generator()
    mark_reseeded_each_epoch(sampler)
    return None, None


def _original_batch_sampler(dataloader: DataLoader[Any], *, detach: bool) -> Any:
    """The batch sampler of map-style data (``None`` for iterable data); ``detach``: a copy."""
    if isinstance(dataloader.dataset, IterableDataset):
        return None
    if isinstance(dataloader.sampler, BatchSampler):
        batch_sampler: Any = dataloader.sampler
    else:
        batch_sampler = dataloader.batch_sampler
    return _detached(batch_sampler) if detach else batch_sampler


@dataclass(frozen=True)
class _Sharding:
    """How this process's share of the data is cut out."""

    num_processes: int
    process_index: int
    split_batches: bool
    even_batches: bool

    def dataset(
        self, dataset: IterableDataset[Any], dataloader: DataLoader[Any]
    ) -> IterableDatasetShard:
        """This process's slice of each run of ``dataloader``'s batches of ``dataset``."""
        return IterableDatasetShard(
            dataset,
            batch_size=int(dataloader.batch_size or 1),
            drop_last=dataloader.drop_last,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=self.split_batches,
        )

    def batch_sampler(self, batch_sampler: Any) -> BatchSamplerShard:
        """This process's batches of a map-style dataset."""
        return BatchSamplerShard(
            batch_sampler,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=self.split_batches,
            even_batches=self.even_batches,
        )


def _batching_kwargs(
    dataloader: DataLoader[Any], batch_sampler: Any, *, per_process: int
) -> dict[str, Any]:
    """The ``DataLoader`` arguments that batch: ``batch_sampler`` or batch size and drop_last.

    ``per_process``: how many processes split each of the original batches (1: none).
    """
    if batch_sampler is None:
        batch_size = dataloader.batch_size
        if batch_size is not None:
            batch_size = batch_size // per_process
        return {"drop_last": dataloader.drop_last, "batch_size": batch_size}
    if isinstance(dataloader.sampler, BatchSampler):
        # The dataset is indexed with whole batches of indices: keep it that way.
        return {"sampler": batch_sampler, "batch_size": None}
    return {"batch_sampler": batch_sampler}


def _synchronised_rng(
    rng_types: list[str] | None, synchronized_generator: torch.Generator | None
) -> list[str] | None:
    """A copy of ``rng_types``, less ``"generator"`` when there is no generator to sync."""
    rng = list(rng_types) if rng_types is not None else None
    if rng is not None and synchronized_generator is None and "generator" in rng:
        rng.remove("generator")
    return rng


def _xla_wrapper_of(dataloader: Any) -> Any:
    """``dataloader`` if it is an XLA ``MpDeviceLoaderWrapper`` (torch_xla not imported)."""
    if not type(dataloader).__name__ == "MpDeviceLoaderWrapper":
        return None
    return dataloader if isinstance(dataloader, device_loader_class()) else None


def _detached(batch_sampler: Any) -> Any:
    """A copy of ``batch_sampler`` and of every batch sampler it wraps (not of the samplers)."""
    top = copy.copy(batch_sampler)
    holder = top
    while hasattr(holder, "batch_sampler"):
        inner = copy.copy(holder.batch_sampler)
        holder.batch_sampler = inner
        holder = inner
    return top


def skip_first_batches(dataloader: DataLoader[Any], num_batches: int = 0) -> DataLoader[Any]:
    """Return a loader that starts ``num_batches`` batches into the epoch of ``dataloader``.

    For map-style data the batch sampler skips (no sample is loaded for the skipped batches);
    for iterable data the skipped batches are read and dropped. The result keeps the loader's
    class, device, random generators and epoch. Skipping past the end gives an empty loader.

    A prepared loader that ``load_state`` (or ``load_state_dict``) put in the middle of an
    epoch already resumes there by itself. For Accelerate's recipe (``load_state``, then
    ``skip_first_batches(loader, k)`` for the resumed epoch) the loader itself is returned,
    set to resume that epoch, in its saved order, after ``num_batches`` batches: it yields
    exactly the remaining batches, the epochs after it are whole, and a checkpoint taken
    during the resumed epoch records where it is. A ``num_batches`` other than the saved
    position is honoured, with a warning.

    Raises:
        ValueError: ``num_batches`` is negative.
    """
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(
            f"num_batches={num_batches!r} must be a non-negative integer (batches to skip)"
        )
    xla_wrapper = _xla_wrapper_of(dataloader)
    if xla_wrapper is not None:
        inner = skip_first_batches(xla_wrapper.dataloader, num_batches)
        if inner is xla_wrapper.dataloader:
            return dataloader
        inner.rng_types = xla_wrapper._rng_types  # the wrapper took them from the shard
        return wrap_for_xla(inner, xla_wrapper.device)
    pending = getattr(dataloader, "_resume", None)
    if (
        isinstance(dataloader, PreparedLoader)
        and pending is not None
        and not dataloader.skip_batches
    ):
        if int(pending["batches_yielded"]) != num_batches:
            warnings.warn(
                f"skip_first_batches(num_batches={num_batches}): the loader was restored "
                f"{pending['batches_yielded']} batches into epoch {dataloader.iteration}; "
                f"it resumes that epoch after {num_batches} batches, as asked",
                stacklevel=2,
            )
        dataloader._resume = {**pending, "batches_yielded": num_batches}
        return dataloader
    dataset = dataloader.dataset
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    kwargs = _loader_kwargs(dataloader)
    iteration = int(getattr(dataloader, "iteration", 0))
    if isinstance(dataset, IterableDataset):
        new_batch_sampler = None
        kwargs["batch_size"] = dataloader.batch_size
        kwargs["drop_last"] = dataloader.drop_last
        skip = num_batches
    else:
        original = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
        new_batch_sampler = SkipBatchSampler(original, skip_batches=num_batches)  # type: ignore[arg-type]
        if sampler_is_batch_sampler:
            kwargs["sampler"] = new_batch_sampler
            kwargs["batch_size"] = None
        else:
            kwargs["batch_sampler"] = new_batch_sampler
        skip = 0
    if isinstance(dataloader, DataLoaderDispatcher):
        kwargs.pop("generator", None)
        return DataLoaderDispatcher(
            dataset,
            split_batches=dataloader.split_batches,
            skip_batches=skip,
            _drop_last=dataloader._drop_last,
            _non_blocking=dataloader._non_blocking,
            slice_fn=dataloader.slice_fn,
            iteration=iteration,
            torch_device_mesh=dataloader.torch_device_mesh,
            num_processes=dataloader.num_processes,
            process_index=dataloader.process_index,
            **kwargs,
        )
    if isinstance(dataloader, DataLoaderShard):
        return DataLoaderShard(
            dataset,
            device=dataloader.device,
            rng_types=dataloader.rng_types,
            synchronized_generator=dataloader.synchronized_generator,
            skip_batches=skip,
            _drop_last=dataloader._drop_last,
            _non_blocking=dataloader._non_blocking,
            iteration=iteration,
            **kwargs,
        )
    if new_batch_sampler is None:
        return SkipDataLoader(dataset, skip_batches=num_batches, **kwargs)
    return DataLoader(dataset, **kwargs)
