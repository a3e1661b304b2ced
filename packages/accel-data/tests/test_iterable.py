"""Unit tests for accel_data.iterable.IterableDatasetShard."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accel_data.iterable import IterableDatasetShard


class Stream(IterableDataset[int]):
    """range(length) as an iterable dataset, with or without a length."""

    def __init__(self, length: int, sized: bool = True) -> None:
        self.length = length
        self.sized = sized

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.length))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.length


def shards(
    dataset: object, num_processes: int = 2, **kwargs: object
) -> list[IterableDatasetShard[int]]:
    return [
        IterableDatasetShard(
            dataset,  # type: ignore[arg-type]
            num_processes=num_processes,
            process_index=rank,
            **kwargs,  # type: ignore[arg-type]
        )
        for rank in range(num_processes)
    ]


# (dataset length, batch_size, drop_last, split_batches, rank 0, rank 1, last_buffer_real_items)
GOLDEN = [
    (10, 2, False, False, [0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1], 2),
    (10, 2, True, False, [0, 1, 4, 5], [2, 3, 6, 7], 4),
    (10, 2, False, True, [0, 2, 4, 6, 8], [1, 3, 5, 7, 9], 2),
    (10, 2, True, True, [0, 2, 4, 6, 8], [1, 3, 5, 7, 9], 2),
    (10, 4, False, True, [0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1], 2),
    (10, 4, True, True, [0, 1, 4, 5], [2, 3, 6, 7], 4),
    (8, 2, False, False, [0, 1, 4, 5], [2, 3, 6, 7], 4),
    (11, 3, False, False, [0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 0], 5),
    (3, 2, False, False, [0, 1], [2, 0], 3),  # shorter than one buffer: cycled
    (3, 2, True, False, [], [], 0),
    (1, 4, False, True, [0, 0], [0, 0], 1),
    (0, 2, False, False, [], [], 0),
]


@pytest.mark.parametrize(
    ("length", "batch_size", "drop_last", "split", "rank0", "rank1", "real"), GOLDEN
)
def test_golden(
    length: int,
    batch_size: int,
    drop_last: bool,
    split: bool,
    rank0: list[int],
    rank1: list[int],
    real: int,
) -> None:
    per_rank = shards(
        Stream(length), batch_size=batch_size, drop_last=drop_last, split_batches=split
    )
    assert [list(shard) for shard in per_rank] == [rank0, rank1]
    assert [len(shard) for shard in per_rank] == [len(rank0), len(rank1)]
    assert [shard.last_buffer_real_items for shard in per_rank] == [real, real]


def test_three_ranks_shorter_than_a_buffer() -> None:
    per_rank = shards(Stream(1), num_processes=3, batch_size=2)
    assert [list(shard) for shard in per_rank] == [[0, 0], [0, 0], [0, 0]]
    assert per_rank[2].last_buffer_real_items == 1


def test_len_rules() -> None:
    # Not split: floor / ceil of len / (bs * n), times bs.
    assert len(IterableDatasetShard(Stream(10), 3, False, 2, 0)) == 6
    assert len(IterableDatasetShard(Stream(10), 3, True, 2, 0)) == 3
    assert len(IterableDatasetShard(Stream(12), 3, True, 2, 1)) == 6
    # Split: floor / ceil of len / bs, times bs // n.
    assert len(IterableDatasetShard(Stream(10), 4, False, 2, 0, split_batches=True)) == 6
    assert len(IterableDatasetShard(Stream(10), 4, True, 2, 0, split_batches=True)) == 4
    assert len(IterableDatasetShard(Stream(10), 2, False, 2, 1, split_batches=True)) == 5


def test_len_of_an_unsized_dataset_raises() -> None:
    shard = IterableDatasetShard(iter(range(4)), batch_size=2)
    with pytest.raises(TypeError, match="no length"):
        len(shard)


def test_every_sample_counted_once_with_last_buffer_real_items() -> None:
    """Gathering each step in rank order and trimming the last one gives the dataset back."""
    for length, bs, n, split, drop_last in itertools.product(
        range(0, 23), (1, 2, 3), (1, 2, 3), (False, True), (False, True)
    ):
        if split:
            bs *= n
        ctx = f"N={length} bs={bs} n={n} split={split} drop_last={drop_last}"
        per_rank = shards(
            Stream(length), n, batch_size=bs, drop_last=drop_last, split_batches=split
        )
        outputs = [list(shard) for shard in per_rank]
        share = bs // n if split else bs
        buffer = share * n
        assert {len(out) for out in outputs} == {len(per_rank[0])}, ctx
        assert all(len(out) % share == 0 for out in outputs), ctx
        steps = [
            [x for out in outputs for x in out[i : i + share]]
            for i in range(0, len(outputs[0]), share)
        ]
        assert all(len(step) == buffer for step in steps), ctx
        real = per_rank[0].last_buffer_real_items
        assert all(shard.last_buffer_real_items == real for shard in per_rank), ctx
        gathered = [x for step in steps[:-1] for x in step] + (steps[-1][:real] if steps else [])
        expected = length // buffer * buffer if drop_last else length
        assert gathered == list(range(expected)), ctx
        # This rank's real items in its last slice, by the formula documented on the attribute.
        for rank, out in enumerate(outputs):
            if out:
                own = min(share, max(0, real - rank * share))
                mine = steps[-1][:real][rank * share : rank * share + own]
                assert out[-share:][:own] == mine, ctx


def test_last_buffer_real_items_is_set_when_iteration_ends() -> None:
    shard = IterableDatasetShard(Stream(5), batch_size=2, num_processes=2, process_index=0)
    assert shard.last_buffer_real_items == 0
    iterator = iter(shard)
    assert [next(iterator), next(iterator)] == [0, 1]
    assert shard.last_buffer_real_items == 0
    assert list(iterator) == [4, 0]
    assert shard.last_buffer_real_items == 1
    assert list(shard) == [0, 1, 4, 0]
    assert shard.last_buffer_real_items == 1


def test_in_a_dataloader() -> None:
    shard = IterableDatasetShard(Stream(10), batch_size=2, num_processes=2, process_index=1)
    loader = DataLoader(shard, batch_size=2)
    assert [batch.tolist() for batch in loader] == [[2, 3], [6, 7], [0, 1]]
    assert len(loader) == 3
    assert isinstance(shard, IterableDataset)


class _WithSetEpoch(Stream):
    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _WithGenerator(IterableDataset[int]):
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randint(0, 1000, (6,), generator=self.generator).tolist())


def _draw(seed: int) -> list[int]:
    return torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_set_epoch_is_forwarded_to_the_dataset() -> None:
    dataset = _WithSetEpoch(4)
    shard = IterableDatasetShard(dataset, batch_size=2)
    assert shard.epoch == 0
    shard.set_epoch(3)
    assert shard.epoch == 3
    assert dataset.epochs == [3]


def test_dataset_generator_is_reseeded_with_its_seed_plus_epoch() -> None:
    dataset = _WithGenerator(seed=50)
    shard = IterableDatasetShard(dataset, batch_size=3)
    assert list(shard) == _draw(50)
    assert list(shard) == _draw(50)  # same epoch, same stream
    shard.set_epoch(2)
    assert dataset.generator.initial_seed() == 52
    assert list(shard) == _draw(52)
    shard.set_epoch(0)
    assert list(shard) == _draw(50)


def test_generator_without_torch_generator_is_ignored() -> None:
    dataset = Stream(4)
    dataset.generator = "not a generator"  # type: ignore[attr-defined]
    shard = IterableDatasetShard(dataset, batch_size=2)
    shard.set_epoch(1)
    assert list(shard) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size=0"),
        ({"num_processes": 0}, ValueError, r"num_processes=0"),
        ({"num_processes": 2, "process_index": 2}, ValueError, r"process_index=2"),
        ({"process_index": -1}, ValueError, r"process_index=-1"),
        (
            {"batch_size": 3, "num_processes": 2, "split_batches": True},
            ValueError,
            r"batch size \(3\).*num_processes \(2\)",
        ),
        (
            {"batch_size": 1, "num_processes": 2, "split_batches": True},
            ValueError,
            r"batch size \(1\).*num_processes \(2\)",
        ),
        ({"batch_size": "2"}, TypeError, r"batch_size='2'"),
        ({"num_processes": 2.0}, TypeError, r"num_processes=2.0"),
    ],
)
def test_bad_inputs_raise(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        IterableDatasetShard(Stream(4), **kwargs)  # type: ignore[arg-type]


def test_bad_epoch_raises() -> None:
    shard = IterableDatasetShard(Stream(4))
    with pytest.raises(ValueError, match="epoch=-2"):
        shard.set_epoch(-2)
    assert shard.epoch == 0
