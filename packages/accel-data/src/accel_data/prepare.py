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
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel_state import DistributedType, PartialState, broadcast

from .dispatch import DataLoaderDispatcher
from .iterable import IterableDatasetShard
from .loaders import PYTORCH_DATALOADER_KWARGS, DataLoaderShard, SkipDataLoader, _PreparedLoader
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


def prepare_data_loader(
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
    if num_processes is None or process_index is None:
        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    # Every process must shuffle alike, also those that share a data shard (a tensor- or
    # context-parallel group), so shuffling follows the processes, sharding the shards.
    processes = num_processes
    if torch_device_mesh is not None:
        num_processes, process_index = data_parallel_view(torch_device_mesh)
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index!r} and num_processes={num_processes!r} do not fit: "
            "the index must lie in [0, num_processes)"
        )
    if split_batches:
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

    dataset = dataloader.dataset
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = (
        None
        if isinstance(dataset, IterableDataset)
        else (dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler)
    )
    synchronized_generator: torch.Generator | None = None
    sampler = get_sampler(dataloader)
    seedable: SeedableRandomSampler | None = None
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        if use_seedable_sampler:
            seedable = SeedableRandomSampler(
                sampler.data_source,
                replacement=sampler.replacement,
                num_samples=sampler._num_samples,
                generator=sampler.generator,
                data_seed=data_seed if data_seed is not None else _rank0_seed(processes),
            )
        elif sampler.generator is not None:
            synchronized_generator = sampler.generator
        elif processes > 1:
            # Every rank must shuffle alike: give the sampler its own generator, seeded from
            # rank 0's torch RNG at prepare (as Accelerate) and synchronised per epoch.
            sampler.generator = _fresh_generator(processes)
            synchronized_generator = sampler.generator
        else:
            # One process: the order of plain PyTorch, which seeds the sampler from torch's
            # RNG at every epoch; the loader does that draw itself into a generator of the
            # sampler's own, so that the epoch's order can be recorded for exact resume.
            sampler.generator = torch.Generator()
            mark_reseeded_each_epoch(sampler)
    if seedable is not None and batch_sampler is not None:
        # The seedable sampler goes into a copy: the user's loader keeps its own sampler, so
        # preparing it again (with another data_seed, say) starts from the original.
        batch_sampler = _detached(batch_sampler)

    if num_processes > 1 and not dispatch_batches:
        if isinstance(dataset, IterableDataset):
            generator = getattr(dataset, "generator", None)
            if isinstance(generator, torch.Generator):
                synchronized_generator = generator
            dataset = IterableDatasetShard(
                dataset,
                batch_size=int(dataloader.batch_size or 1),
                drop_last=dataloader.drop_last,
                num_processes=num_processes,
                process_index=process_index,
                split_batches=split_batches,
            )
        else:
            batch_sampler = BatchSamplerShard(
                batch_sampler,  # type: ignore[arg-type]
                num_processes=num_processes,
                process_index=process_index,
                split_batches=split_batches,
                even_batches=even_batches,
            )

    rng = list(rng_types) if rng_types is not None else None
    if rng is not None and synchronized_generator is None and "generator" in rng:
        rng.remove("generator")

    kwargs = _loader_kwargs(dataloader)
    if batch_sampler is None:
        kwargs["drop_last"] = dataloader.drop_last
        batch_size = dataloader.batch_size
        if split_batches and not dispatch_batches and batch_size is not None:
            batch_size = batch_size // num_processes
        kwargs["batch_size"] = batch_size
    if batch_sampler is not None:
        if sampler_is_batch_sampler:
            # The dataset is indexed with whole batches of indices: keep it that way.
            kwargs["sampler"] = batch_sampler
            kwargs["batch_size"] = None
        else:
            kwargs["batch_sampler"] = batch_sampler
    prepared: _PreparedLoader
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
        placement = device if put_on_device and not on_xla else None
        prepared = DataLoaderShard(
            dataset,
            device=placement,
            rng_types=rng,
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
        isinstance(dataloader, _PreparedLoader)
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
