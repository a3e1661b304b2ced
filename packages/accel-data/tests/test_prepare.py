"""prepare_data_loader in one process: kwargs, sharding choices, samplers, and bad input."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)

from accel_data import (
    BatchSamplerShard,
    DataLoaderConfiguration,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    get_sampler,
    prepare_data_loader,
)
from accel_state import GradientState
from accel_state.torch_support import torch_has

_WORKER_TAG = "main"


def tag_worker(worker_id: int) -> None:
    global _WORKER_TAG
    _WORKER_TAG = f"worker-{worker_id}"


def tagging_collate(items: list[int]) -> dict[str, Any]:
    info = get_worker_info()
    return {
        "x": torch.tensor(items),
        "tag": _WORKER_TAG,
        "worker": -1 if info is None else info.id,
    }


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        return iter(range(self.length))


class SizelessBatchSampler:
    """Batches of growing size and no ``batch_size`` attribute."""

    def __iter__(self) -> Any:
        return iter([[0], [1, 2], [3, 4, 5]])

    def __len__(self) -> int:
        return 3


def tolists(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def no_loader_registered() -> bool:
    return GradientState()._dataloader_references == [None]


# -- DataLoader arguments --------------------------------------------------------------------


def test_original_dataloader_kwargs_are_kept() -> None:
    generator = torch.Generator().manual_seed(3)
    original = DataLoader(
        list(range(12)),
        batch_size=2,
        shuffle=True,
        num_workers=2,
        collate_fn=tagging_collate,
        pin_memory=True,
        worker_init_fn=tag_worker,
        timeout=30,
        generator=generator,
        persistent_workers=True,
        prefetch_factor=3,
        multiprocessing_context="fork",
        # torch < 2.6 has no in_order: the loader is then kept without it
        **({"in_order": False} if torch_has("dataloader_in_order") else {}),
    )
    with warnings.catch_warnings():
        # Without an accelerator torch warns that pin_memory has no effect.
        warnings.simplefilter("ignore", UserWarning)
        loader = prepare_data_loader(original, num_processes=2, process_index=1)
        batches = list(loader)
    assert isinstance(loader, DataLoaderShard)
    assert loader.num_workers == 2
    assert loader.collate_fn is tagging_collate
    assert loader.pin_memory is True
    assert loader.worker_init_fn is tag_worker
    assert loader.timeout == 30
    assert loader.generator is generator
    assert loader.persistent_workers is True
    assert loader.prefetch_factor == 3
    if torch_has("dataloader_in_order"):
        assert loader.in_order is False
    mp_context = loader.multiprocessing_context
    assert mp_context is not None and mp_context.get_start_method() == "fork"
    assert isinstance(loader.batch_sampler, BatchSamplerShard)
    assert len(batches) == 3
    assert {batch["tag"] for batch in batches} <= {"worker-0", "worker-1"}
    assert {batch["worker"] for batch in batches} <= {0, 1}
    assert all(batch["x"].shape == (2,) for batch in batches)


def test_worker_only_arguments_are_dropped_without_workers() -> None:
    original = DataLoader(list(range(4)), batch_size=2, collate_fn=tagging_collate)
    loader = prepare_data_loader(original, num_processes=1, process_index=0)
    assert loader.num_workers == 0
    assert loader.prefetch_factor is None
    assert loader.persistent_workers is False
    assert loader.collate_fn is tagging_collate
    assert [batch["worker"] for batch in loader] == [-1, -1]


# -- what gets built -------------------------------------------------------------------------


def test_one_process_is_still_wrapped() -> None:
    original = DataLoader(list(range(6)), batch_size=2)
    loader = prepare_data_loader(original)
    assert type(loader) is DataLoaderShard
    assert loader is not original
    assert tolists(loader) == [[0, 1], [2, 3], [4, 5]]


def test_dispatch_default_is_for_iterable_data_on_a_device() -> None:
    stream = DataLoader(Stream(4), batch_size=2)
    mapped = DataLoader(list(range(4)), batch_size=2)
    assert isinstance(prepare_data_loader(stream, put_on_device=True), DataLoaderDispatcher)
    assert type(prepare_data_loader(stream)) is DataLoaderShard
    assert type(prepare_data_loader(mapped, put_on_device=True)) is DataLoaderShard
    forced = prepare_data_loader(stream, put_on_device=True, dispatch_batches=False)
    assert type(forced) is DataLoaderShard


def test_map_style_sharding_by_rank() -> None:
    def shards(bs: int = 3, **kwargs: Any) -> list[list[list[int]]]:
        return [
            tolists(
                prepare_data_loader(
                    DataLoader(list(range(21)), batch_size=bs),
                    num_processes=2,
                    process_index=rank,
                    **kwargs,
                )
            )
            for rank in range(2)
        ]

    r0, r1 = shards()
    assert r0 == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]
    assert r1 == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]
    r0, r1 = shards(even_batches=False)
    assert r1 == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]
    r0, r1 = shards(split_batches=True, bs=4)
    assert r0[:2] == [[0, 1], [4, 5]] and r1[:2] == [[2, 3], [6, 7]]
    assert r0[-1] == [20, 0] and r1[-1] == [1, 2]


def test_a_batch_sampler_passed_as_sampler_is_sharded() -> None:
    batch_sampler = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=False)
    shards = [
        prepare_data_loader(
            DataLoader(torch.arange(8) * 10, sampler=batch_sampler, batch_size=None),
            num_processes=2,
            process_index=rank,
        )
        for rank in range(2)
    ]
    assert isinstance(shards[0].sampler, BatchSamplerShard)
    assert [tolists(shard) for shard in shards] == [[[0, 10], [40, 50]], [[20, 30], [60, 70]]]
    assert shards[0].total_batch_size == 4


def test_iterable_data_is_wrapped_in_an_iterable_shard() -> None:
    for split, per_rank in ((False, 4), (True, 2)):
        loader = prepare_data_loader(
            DataLoader(Stream(16), batch_size=4),
            num_processes=2,
            process_index=1,
            split_batches=split,
        )
        assert isinstance(loader.dataset, IterableDatasetShard)
        assert loader.batch_size == per_rank
        assert loader.total_batch_size == 4 if split else 8
        batches = tolists(loader)
        assert all(len(batch) == per_rank for batch in batches)
    assert tolists(loader) == [[2, 3], [6, 7], [10, 11], [14, 15]]


def test_random_sampler_gets_a_synchronised_generator() -> None:
    torch.manual_seed(11)
    first = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=5, shuffle=True),
        num_processes=2,
        process_index=0,
        rng_types=["generator"],
    )
    torch.manual_seed(11)
    second = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=5, shuffle=True),
        num_processes=2,
        process_index=1,
        rng_types=["generator"],
    )
    sampler = get_sampler(first)
    assert isinstance(sampler, RandomSampler)
    assert isinstance(sampler.generator, torch.Generator)
    assert first.synchronized_generator is sampler.generator
    assert first.rng_types == ["generator"]
    both = tolists(first) + tolists(second)
    assert sorted(x for batch in both for x in batch) == list(range(10))


def test_generator_is_dropped_from_rng_types_when_nothing_shuffles() -> None:
    rng_types = ["torch", "generator"]
    loader = prepare_data_loader(
        DataLoader(list(range(4)), batch_size=2),
        num_processes=2,
        process_index=0,
        rng_types=rng_types,
    )
    assert loader.rng_types == ["torch"]
    assert rng_types == ["torch", "generator"]  # the caller's list is not changed
    assert tolists(loader) == [[0, 1]]


def test_seedable_sampler_replaces_the_random_sampler() -> None:
    original = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    loader = prepare_data_loader(
        original, num_processes=2, process_index=0, use_seedable_sampler=True, data_seed=42
    )
    sampler = get_sampler(loader)
    assert isinstance(sampler, SeedableRandomSampler)
    assert sampler.initial_seed == 42
    assert loader.get_sampler() is sampler
    again = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=2, shuffle=True),
        num_processes=2,
        process_index=0,
        use_seedable_sampler=True,
        data_seed=42,
    )
    for _ in range(2):
        assert tolists(loader) == tolists(again)
    epoch0 = torch.randperm(10, generator=torch.Generator().manual_seed(42)).tolist()
    fresh = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=2, shuffle=True),
        num_processes=1,
        process_index=0,
        use_seedable_sampler=True,
        data_seed=42,
    )
    assert [x for batch in tolists(fresh) for x in batch] == epoch0


def test_data_loader_configuration_defaults() -> None:
    config = DataLoaderConfiguration()
    assert config.split_batches is False
    assert config.dispatch_batches is None
    assert config.even_batches is True
    assert config.use_seedable_sampler is False
    assert config.data_seed is None
    assert config.non_blocking is False
    assert config.use_stateful_dataloader is False


# -- bad input -------------------------------------------------------------------------------


def test_split_batches_with_an_indivisible_batch_size() -> None:
    with pytest.raises(ValueError, match=r"batch size \(5\).*number of processes \(2\)"):
        prepare_data_loader(
            DataLoader(list(range(10)), batch_size=5),
            num_processes=2,
            process_index=0,
            split_batches=True,
        )
    with pytest.raises(ValueError, match=r"\(6\).*\(4\)"):
        prepare_data_loader(
            DataLoader(Stream(10), batch_size=6),
            num_processes=4,
            process_index=3,
            split_batches=True,
        )
    assert no_loader_registered()


def test_dispatch_without_put_on_device() -> None:
    with pytest.raises(ValueError, match="put_on_device"):
        prepare_data_loader(
            DataLoader(list(range(4)), batch_size=2),
            num_processes=1,
            process_index=0,
            dispatch_batches=True,
        )
    assert no_loader_registered()


def test_split_batches_with_a_batch_sampler_without_batch_size() -> None:
    original = DataLoader(list(range(6)), batch_sampler=SizelessBatchSampler())
    with pytest.raises(ValueError, match="batch_size"):
        prepare_data_loader(original, num_processes=2, process_index=0, split_batches=True)
    assert no_loader_registered()
    # Without split_batches its batches are handed out whole.
    loader = prepare_data_loader(original, num_processes=2, process_index=1)
    assert tolists(loader) == [[1, 2], [0]]


@pytest.mark.parametrize(("num_processes", "process_index"), [(2, 2), (2, -1), (1, 5), (0, 0)])
def test_process_index_out_of_range(num_processes: int, process_index: int) -> None:
    with pytest.raises(ValueError, match="process_index"):
        prepare_data_loader(
            DataLoader(list(range(4)), batch_size=2),
            num_processes=num_processes,
            process_index=process_index,
        )
    assert no_loader_registered()


def test_failures_leave_nothing_registered_while_another_loader_runs() -> None:
    outer = prepare_data_loader(DataLoader(list(range(4)), batch_size=2))
    state = GradientState()
    for _ in outer:
        with pytest.raises(ValueError):
            prepare_data_loader(
                DataLoader(list(range(4)), batch_size=3),
                num_processes=2,
                process_index=0,
                split_batches=True,
            )
        assert state.active_dataloader is outer
        assert len(state._dataloader_references) == 2
    assert no_loader_registered()


class _Mesh:
    """What ``data_parallel_view`` reads of a ``DeviceMesh``."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...], at: list[int]) -> None:
        self.mesh_dim_names = names
        self.mesh = torch.zeros(shape)
        self._at = at

    def get_coordinate(self) -> list[int]:
        return self._at


def test_the_data_parallel_view_of_a_mesh_skips_model_parallel_dimensions() -> None:
    from accel_data.prepare import data_parallel_view

    names = ("dp_replicate", "dp_shard", "cp", "tp")
    # (replicate, shard, cp, tp) = (1, 0, 1, 1) of 2 x 2 x 2 x 2: data shard 1 * 2 + 0 of 4
    assert data_parallel_view(_Mesh(names, (2, 2, 2, 2), [1, 0, 1, 1])) == (4, 2)
    assert data_parallel_view(_Mesh(("tp",), (4,), [3])) == (1, 0)
    assert data_parallel_view(_Mesh(("dp_shard", "tp"), (2, 2), [1, 0])) == (2, 1)
    with pytest.raises(ValueError, match="does not contain this process"):
        data_parallel_view(_Mesh(("tp",), (2,), None))  # type: ignore[arg-type]
