"""Prepared loaders in one process: DataLoader identity, epochs, GradientState, devices, skips."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler

import accel_data.loaders as loaders_module
from accel_data import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from accel_state import GradientState


class Stream(IterableDataset):  # type: ignore[type-arg]
    """A deterministic stream of ``length`` ints that records the epochs it is told."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        return iter(range(self.length))


class EpochSampler(Sampler[int]):
    """A sequential sampler with ``set_epoch`` that records the epochs it is told."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        return iter(range(self.length))

    def __len__(self) -> int:
        return self.length


class EpochBatchSampler(BatchSampler):
    """A batch sampler with its own ``set_epoch`` (its sampler has one too, which must not win)."""

    def __init__(self, length: int, batch_size: int) -> None:
        super().__init__(EpochSampler(length), batch_size, drop_last=False)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def tolists(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def single(dataloader: DataLoader, **kwargs: Any) -> Any:  # type: ignore[type-arg]
    return prepare_data_loader(dataloader, num_processes=1, process_index=0, **kwargs)


def no_loader_registered() -> bool:
    return GradientState()._dataloader_references == [None]


# -- identity and pickling -------------------------------------------------------------------


def test_prepared_loaders_are_dataloaders() -> None:
    shard = single(DataLoader(list(range(8)), batch_size=2))
    dispatcher = single(
        DataLoader(list(range(8)), batch_size=2),
        put_on_device=True,
        device="cpu",
        dispatch_batches=True,
    )
    assert isinstance(shard, DataLoaderShard) and isinstance(shard, DataLoader)
    assert isinstance(dispatcher, DataLoaderDispatcher) and isinstance(dispatcher, DataLoader)


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_pickle_round_trip_yields_the_same_batches(dispatch: bool, shuffle: bool) -> None:
    torch.manual_seed(0)
    loader = prepare_data_loader(
        DataLoader(list(range(20)), batch_size=3, shuffle=shuffle),
        num_processes=1,
        process_index=0,
        put_on_device=True,
        device="cpu",
        dispatch_batches=dispatch,
    )
    before = tolists(loader)  # iterated once: the copy must not carry a live iterator
    copy = pickle.loads(pickle.dumps(loader))
    assert type(copy) is type(loader)
    assert isinstance(copy, DataLoader)
    assert copy.iteration == loader.iteration == 1
    # One process shuffles as PyTorch does, from torch's RNG at each epoch: from the same
    # RNG state, the copy and the original draw the same epoch.
    rng = torch.get_rng_state()
    from_copy = tolists(copy)
    torch.set_rng_state(rng)
    assert from_copy == tolists(loader)
    assert sorted(x for batch in before for x in batch) == list(range(20))


def test_pickle_round_trip_of_a_sharded_loader() -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=2), num_processes=2, process_index=1
    )
    copy = pickle.loads(pickle.dumps(loader))
    assert tolists(copy) == tolists(loader) == [[2, 3], [6, 7], [0, 1]]


# -- end_of_dataloader -----------------------------------------------------------------------


@pytest.mark.parametrize("dispatch", [False, True])
def test_end_of_dataloader_is_true_exactly_at_the_last_batch_of_every_epoch(
    dispatch: bool,
) -> None:
    loader = single(
        DataLoader(list(range(16)), batch_size=4),
        put_on_device=dispatch,
        device="cpu" if dispatch else None,
        dispatch_batches=dispatch,
    )
    state = GradientState()
    for _epoch in range(3):
        flags = []
        for batch in loader:
            assert batch.shape == (4,)
            flags.append(state.end_of_dataloader)
            assert loader.end_of_dataloader is flags[-1]
        assert flags == [False, False, False, True]


def test_end_of_dataloader_with_one_batch_and_for_a_sharded_iterable() -> None:
    state = GradientState()
    one = single(DataLoader(list(range(3)), batch_size=4))
    assert [state.end_of_dataloader for _ in one] == [True]
    assert [state.end_of_dataloader for _ in one] == [True]
    stream = prepare_data_loader(
        DataLoader(Stream(20), batch_size=3), num_processes=2, process_index=1
    )
    for _epoch in range(2):
        flags = [state.end_of_dataloader for _ in stream]
        assert flags == [False, False, False, True]


def test_nested_loaders_report_the_innermost() -> None:
    state = GradientState()
    outer = single(DataLoader(list(range(4)), batch_size=2))
    inner = single(DataLoader(list(range(6)), batch_size=2))
    seen = []
    for _ in outer:
        assert state.active_dataloader is outer
        for _ in inner:
            assert state.active_dataloader is inner
            seen.append(state.end_of_dataloader)
        assert state.active_dataloader is outer
    assert seen == [False, False, True] * 2
    assert no_loader_registered()


# -- GradientState registration --------------------------------------------------------------


@pytest.mark.parametrize("dispatch", [False, True])
def test_loader_is_registered_only_while_iterated(dispatch: bool) -> None:
    state = GradientState()
    loader = single(
        DataLoader(list(range(12)), batch_size=4),
        put_on_device=dispatch,
        device="cpu" if dispatch else None,
        dispatch_batches=dispatch,
    )
    assert no_loader_registered() and not state.in_dataloader
    for _ in loader:
        assert state.in_dataloader
        assert state.active_dataloader is loader
    assert no_loader_registered() and not state.in_dataloader
    for _ in loader:
        break
    assert no_loader_registered()
    assert state.end_of_dataloader is False


def test_loader_is_unregistered_when_a_batch_raises() -> None:
    loader = single(DataLoader(list(range(12)), batch_size=4))
    with pytest.raises(RuntimeError, match="boom"):
        for _ in loader:
            raise RuntimeError("boom")
    assert no_loader_registered()


# -- set_epoch -------------------------------------------------------------------------------


def test_set_epoch_reaches_a_batch_sampler_with_set_epoch() -> None:
    batch_sampler = EpochBatchSampler(8, 2)
    loader = single(DataLoader(list(range(8)), batch_sampler=batch_sampler))
    for _ in range(3):
        assert tolists(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert batch_sampler.epochs == [0, 1, 2]
    # Its sampler counts epochs too and is told as well (as Accelerate does).
    assert batch_sampler.sampler.epochs == [0, 1, 2]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_set_epoch_reaches_a_sampler_with_set_epoch(num_processes: int) -> None:
    sampler = EpochSampler(8)
    loader = prepare_data_loader(
        DataLoader(list(range(8)), batch_size=2, sampler=sampler),
        num_processes=num_processes,
        process_index=0,
    )
    for _ in range(3):
        list(loader)
    assert sampler.epochs == [0, 1, 2]
    loader.set_epoch(7)
    assert sampler.epochs[-1] == 7
    list(loader)
    assert sampler.epochs[-1] == 7
    assert loader.iteration == 8


@pytest.mark.parametrize("num_processes", [1, 2])
def test_set_epoch_reaches_an_iterable_dataset(num_processes: int) -> None:
    stream = Stream(8)
    loader = prepare_data_loader(
        DataLoader(stream, batch_size=2), num_processes=num_processes, process_index=0
    )
    for _ in range(3):
        assert len(tolists(loader)) == 4 // num_processes
    assert stream.epochs[-3:] == [0, 1, 2]
    assert set(stream.epochs) == {0, 1, 2}


def test_set_epoch_reaches_a_batch_sampler_passed_as_sampler() -> None:
    batch_sampler = EpochBatchSampler(8, 2)
    loader = single(DataLoader(torch.arange(8), sampler=batch_sampler, batch_size=None))
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    list(loader)
    assert batch_sampler.epochs == [0, 1]


# -- devices ---------------------------------------------------------------------------------


def test_put_on_device_moves_every_tensor_of_the_batch() -> None:
    data = [{"x": torch.tensor([float(i)]), "y": i} for i in range(6)]
    moved = single(DataLoader(data, batch_size=2), put_on_device=True, device="meta")
    batches = list(moved)
    assert len(batches) == 3
    for batch in batches:
        assert batch["x"].device.type == "meta"
        assert batch["y"].device.type == "meta"
    kept = single(DataLoader(data, batch_size=2), device="meta")  # put_on_device=False
    assert kept.device is None
    assert all(batch["x"].device.type == "cpu" for batch in kept)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_batches_go_to_the_device_with_non_blocking(
    monkeypatch: pytest.MonkeyPatch, non_blocking: bool
) -> None:
    calls: list[tuple[Any, Any]] = []
    moved: list[Any] = []
    real = loaders_module.device_mover

    def spy(device: Any, non_blocking: bool = False, **kwargs: Any) -> Any:
        calls.append((torch.device(device), non_blocking))
        move = real(device, non_blocking=non_blocking, **kwargs)

        def counting(batch: Any) -> Any:
            moved.append(batch)
            return move(batch)

        return counting

    monkeypatch.setattr(loaders_module, "device_mover", spy)
    loader = single(
        DataLoader(list(range(6)), batch_size=2),
        put_on_device=True,
        device="cpu",
        non_blocking=non_blocking,
    )
    assert tolists(loader) == [[0, 1], [2, 3], [4, 5]]
    assert calls == [(torch.device("cpu"), non_blocking)]  # set up once per epoch
    assert len(moved) == 3  # every batch goes through it


# -- len, total_batch_size, remainder --------------------------------------------------------


@pytest.mark.parametrize("length", [16, 18, 22, 24, 25, 3])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even_batches", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_matches_the_batches_yielded(
    length: int, split: bool, even_batches: bool, drop_last: bool
) -> None:
    batches = -(-length // 4) if not drop_last else length // 4
    for rank in range(2):
        loader = prepare_data_loader(
            DataLoader(list(range(length)), batch_size=4, drop_last=drop_last),
            num_processes=2,
            process_index=rank,
            split_batches=split,
            even_batches=even_batches,
        )
        got = tolists(loader)
        if split:
            # Accelerate's rule: one slice of every batch. With even_batches=False a short last
            # batch may have no slice for a later rank, which len() does not subtract.
            expected = batches
            short_slice_missing = not even_batches and not drop_last and 0 < length % 4 <= 2 * rank
            assert len(got) == expected - short_slice_missing
        elif drop_last:
            expected = batches // 2
        elif even_batches:
            expected = -(-batches // 2)
        else:
            expected = batches // 2 + (1 if rank < batches % 2 else 0)
        assert len(loader) == expected
        if not split:
            assert len(got) == expected


def test_len_of_an_unsharded_loader_and_a_dispatcher() -> None:
    plain = single(DataLoader(list(range(10)), batch_size=4))
    assert len(plain) == 3
    dispatcher = single(
        DataLoader(list(range(10)), batch_size=4),
        put_on_device=True,
        device="cpu",
        dispatch_batches=True,
    )
    assert len(dispatcher) == 3 == len(tolists(dispatcher))


@pytest.mark.parametrize(
    ("length", "split", "total", "remainder"),
    [(16, False, 8, 0), (18, False, 8, 2), (18, True, 4, 2), (20, True, 4, 0), (3, False, 8, 3)],
)
def test_total_batch_size_and_remainder(
    length: int, split: bool, total: int, remainder: int
) -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(length)), batch_size=4),
        num_processes=2,
        process_index=0,
        split_batches=split,
    )
    assert loader.total_batch_size == total
    assert loader.total_dataset_length == length
    for _ in loader:
        pass
    assert loader.remainder == remainder


def test_remainder_of_a_sharded_iterable_dataset() -> None:
    loader = prepare_data_loader(DataLoader(Stream(19), batch_size=4), num_processes=2)
    assert loader.total_batch_size == 8
    remainders = [loader.remainder for _ in loader]
    assert remainders[-1] == 19 % 8


def test_drop_last_has_no_remainder() -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(18)), batch_size=4, drop_last=True),
        num_processes=2,
        process_index=0,
    )
    for _ in loader:
        pass
    assert loader.remainder == -1


# -- skip_first_batches ----------------------------------------------------------------------


def test_skip_first_batches_skips_and_keeps_class_device_and_epoch() -> None:
    loader = single(DataLoader(list(range(16)), batch_size=4), put_on_device=True, device="cpu")
    list(loader)
    list(loader)
    skipped = skip_first_batches(loader, 2)
    assert type(skipped) is DataLoaderShard
    assert skipped.device == "cpu"
    assert skipped.iteration == loader.iteration == 2
    assert len(skipped) == 2
    assert tolists(skipped) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    flags = []
    for _ in skipped:
        flags.append(GradientState().end_of_dataloader)
    assert flags == [False, True]


def test_skip_first_batches_beyond_the_end_is_empty() -> None:
    loader = single(DataLoader(list(range(16)), batch_size=4))
    for count in (4, 5, 100):
        skipped = skip_first_batches(loader, count)
        assert len(skipped) == 0
        assert tolists(skipped) == []
    assert no_loader_registered()
    with pytest.raises(ValueError, match="num_batches"):
        skip_first_batches(loader, -1)


def test_skip_first_batches_of_a_sharded_and_a_dispatching_loader() -> None:
    shard = prepare_data_loader(
        DataLoader(list(range(16)), batch_size=2), num_processes=2, process_index=1
    )
    assert tolists(skip_first_batches(shard, 3)) == [[14, 15]]
    dispatcher = single(
        DataLoader(list(range(16)), batch_size=4),
        put_on_device=True,
        device="cpu",
        dispatch_batches=True,
    )
    skipped = skip_first_batches(dispatcher, 2)
    assert type(skipped) is DataLoaderDispatcher
    assert tolists(skipped) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert tolists(skip_first_batches(dispatcher, 9)) == []


def test_skip_first_batches_of_iterable_and_plain_loaders() -> None:
    stream = single(DataLoader(Stream(10), batch_size=3))
    assert tolists(skip_first_batches(stream, 2)) == [[6, 7, 8], [9]]
    assert tolists(skip_first_batches(stream, 9)) == []
    plain_stream = skip_first_batches(DataLoader(Stream(10), batch_size=3), 1)
    assert isinstance(plain_stream, SkipDataLoader)
    assert tolists(plain_stream) == [[3, 4, 5], [6, 7, 8], [9]]
    plain = skip_first_batches(DataLoader(list(range(10)), batch_size=3), 2)
    assert isinstance(plain, DataLoader)
    assert tolists(plain) == [[6, 7, 8], [9]]


def test_skip_batches_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="skip_batches"):
        DataLoaderShard(list(range(4)), skip_batches=-1)


def test_set_sampler_replaces_the_index_sampler() -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(8)), batch_size=2), num_processes=2, process_index=0
    )
    loader.set_sampler(SequentialSampler(list(range(4))))
    assert tolists(loader) == [[0, 1]]
    assert isinstance(loader.get_sampler(), SequentialSampler)
