"""Unit tests for accel_data.samplers: golden shards, coverage properties, seeding, skipping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from accel_data.samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler


def shard_lists(
    batch_sampler: object, num_processes: int = 2, **kwargs: bool
) -> tuple[list[list[list[int]]], list[int]]:
    """Iterate the shard of every rank; return the batches and the reported lengths."""
    shards = [
        BatchSamplerShard(batch_sampler, num_processes, rank, **kwargs)  # type: ignore[arg-type]
        for rank in range(num_processes)
    ]
    return [list(shard) for shard in shards], [len(shard) for shard in shards]


def interleave(per_rank: Sequence[Sequence[list[int]]]) -> list[int]:
    """The global order: step by step, the items of rank 0, then rank 1, ..."""
    out: list[int] = []
    for step in range(max((len(batches) for batches in per_rank), default=0)):
        for batches in per_rank:
            if step < len(batches):
                out.extend(batches[step])
    return out


# --------------------------------------------------------------------------------------------
# BatchSamplerShard: golden values (2 ranks)
# --------------------------------------------------------------------------------------------

B0, B1, B2, B3 = [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]
B4, B5, B6, B7 = [12, 13, 14], [15, 16, 17], [18, 19, 20], [21, 22, 23]
SHARED_HEAD = ([B0, B2, B4], [B1, B3, B5])  # what every drop_last case below yields

# (dataset length, drop_last, even_batches, expected rank 0, expected rank 1), batch size 3.
NO_SPLIT_CASES = [
    (24, False, True, [B0, B2, B4, B6], [B1, B3, B5, B7]),
    (24, True, True, [B0, B2, B4, B6], [B1, B3, B5, B7]),
    (21, False, True, [B0, B2, B4, B6], [B1, B3, B5, [0, 1, 2]]),
    (21, True, True, *SHARED_HEAD),
    (22, False, True, [B0, B2, B4, B6], [B1, B3, B5, [21, 0, 1]]),
    (22, True, True, *SHARED_HEAD),
    (20, False, True, [B0, B2, B4, [18, 19, 0]], [B1, B3, B5, [1, 2, 3]]),
    (20, True, True, *SHARED_HEAD),
    (2, False, True, [[0, 1, 0]], [[1, 0, 1]]),
    (2, True, True, [], []),
    (24, False, False, [B0, B2, B4, B6], [B1, B3, B5, B7]),
    (24, True, False, [B0, B2, B4, B6], [B1, B3, B5, B7]),
    (21, False, False, [B0, B2, B4, B6], [B1, B3, B5]),
    (21, True, False, *SHARED_HEAD),
    (22, False, False, [B0, B2, B4, B6], [B1, B3, B5, [21]]),
    (22, True, False, *SHARED_HEAD),
    (20, False, False, [B0, B2, B4, [18, 19]], [B1, B3, B5]),
    (20, True, False, *SHARED_HEAD),
    (2, False, False, [[0, 1]], []),
    (2, True, False, [], []),
]


@pytest.mark.parametrize(("length", "drop_last", "even", "rank0", "rank1"), NO_SPLIT_CASES)
def test_no_split_golden(
    length: int, drop_last: bool, even: bool, rank0: list[list[int]], rank1: list[list[int]]
) -> None:
    sampler = BatchSampler(range(length), batch_size=3, drop_last=drop_last)
    batches, lengths = shard_lists(sampler, even_batches=even)
    assert batches == [rank0, rank1]
    assert lengths == [len(rank0), len(rank1)]


S = [[4 * i, 4 * i + 1] for i in range(6)]  # rank 0's slices of range(24) in batches of 4
T = [[4 * i + 2, 4 * i + 3] for i in range(6)]  # rank 1's slices

# (dataset length, drop_last, even_batches, expected rank 0, expected rank 1), batch size 4.
SPLIT_CASES = [
    (24, False, True, S, T),
    (24, True, True, S, T),
    (22, False, True, S, [*T[:5], [0, 1]]),
    (22, True, True, S[:5], T[:5]),
    (21, False, True, [*S[:5], [20, 0]], [*T[:5], [1, 2]]),
    (21, True, True, S[:5], T[:5]),
    (2, False, True, [[0, 1]], [[0, 1]]),
    (2, True, True, [], []),
    (24, False, False, S, T),
    (24, True, False, S, T),
    (22, False, False, S, T[:5]),
    (22, True, False, S[:5], T[:5]),
    (21, False, False, [*S[:5], [20]], T[:5]),
    (21, True, False, S[:5], T[:5]),
    (2, False, False, [[0, 1]], []),
    (2, True, False, [], []),
]


@pytest.mark.parametrize(("length", "drop_last", "even", "rank0", "rank1"), SPLIT_CASES)
def test_split_golden(
    length: int, drop_last: bool, even: bool, rank0: list[list[int]], rank1: list[list[int]]
) -> None:
    sampler = BatchSampler(range(length), batch_size=4, drop_last=drop_last)
    batches, lengths = shard_lists(sampler, split_batches=True, even_batches=even)
    assert batches == [rank0, rank1]
    # Split mode reports the wrapped sampler's length on every rank.
    assert lengths == [len(sampler), len(sampler)]


@pytest.mark.parametrize(
    ("length", "drop_last", "even", "expected"),
    [
        (24, False, True, [4, 4]),
        (21, False, True, [4, 4]),  # 7 batches: floor + 1 on every rank
        (21, True, True, [3, 3]),  # floor
        (21, False, False, [4, 3]),  # + 1 only below the remainder
        (22, False, False, [4, 4]),  # 8 batches: divisible
        (20, True, False, [3, 3]),
        (2, False, False, [1, 0]),
        (2, False, True, [1, 1]),
    ],
)
def test_len_rules(length: int, drop_last: bool, even: bool, expected: list[int]) -> None:
    sampler = BatchSampler(range(length), batch_size=3, drop_last=drop_last)
    shards = [BatchSamplerShard(sampler, 2, rank, even_batches=even) for rank in range(2)]
    assert [len(shard) for shard in shards] == expected
    assert all(shard.total_length == len(sampler) for shard in shards)


# --------------------------------------------------------------------------------------------
# BatchSamplerShard: variable-size batch samplers (no batch_size) are cycled whole
# --------------------------------------------------------------------------------------------

VARIABLE = [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12], [13]]


def test_variable_size_not_even() -> None:
    batches, lengths = shard_lists(VARIABLE[:5], even_batches=False)
    assert batches == [[[0], [4, 5], [10, 11, 12]], [[1, 2, 3], [6, 7, 8, 9]]]
    assert lengths == [3, 2]


def test_variable_size_even_round_complete() -> None:
    batches, lengths = shard_lists(VARIABLE)
    assert batches == [[[0], [4, 5], [10, 11, 12]], [[1, 2, 3], [6, 7, 8, 9], [13]]]
    assert lengths == [3, 3]


def test_variable_size_even_pads_with_whole_batches_from_the_start() -> None:
    batches, lengths = shard_lists(VARIABLE[:5])
    assert batches == [[[0], [4, 5], [10, 11, 12]], [[1, 2, 3], [6, 7, 8, 9], [0]]]
    assert lengths == [3, 3]
    # Three ranks, four batches: ranks 1 and 2 receive the first and second batch again.
    batches, lengths = shard_lists(VARIABLE[:4], num_processes=3)
    assert batches == [[[0], [6, 7, 8, 9]], [[1, 2, 3], [0]], [[4, 5], [1, 2, 3]]]
    assert lengths == [2, 2, 2]
    # One batch for three ranks: it is repeated.
    batches, _ = shard_lists([[7, 8]], num_processes=3)
    assert batches == [[[7, 8]], [[7, 8]], [[7, 8]]]


class _DroppingBatches:
    """A batch sampler without batch_size that drops its incomplete tail."""

    drop_last = True

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_variable_size_drop_last_drops_the_incomplete_round() -> None:
    batches, lengths = shard_lists(_DroppingBatches(VARIABLE[:5]))
    assert batches == [[[0], [4, 5]], [[1, 2, 3], [6, 7, 8, 9]]]
    assert lengths == [2, 2]


# --------------------------------------------------------------------------------------------
# BatchSamplerShard: coverage properties over many configurations
# --------------------------------------------------------------------------------------------

CONFIGS = [
    (length, bs, n, drop_last, even)
    for length in range(0, 26)
    for bs in (1, 2, 3, 5)
    for n in (1, 2, 3, 4)
    for drop_last in (False, True)
    for even in (False, True)
]


def test_round_robin_coverage_properties() -> None:
    for length, bs, n, drop_last, even in CONFIGS:
        ctx = f"N={length} bs={bs} n={n} drop_last={drop_last} even={even}"
        sampler = BatchSampler(range(length), batch_size=bs, drop_last=drop_last)
        batches, lengths = shard_lists(sampler, n, even_batches=even)
        assert lengths == [len(b) for b in batches], ctx
        flat = interleave(batches)
        if drop_last:
            kept = (length // bs) // n * n * bs
            assert flat == list(range(kept)), ctx
        elif even:
            assert flat[:length] == list(range(length)), ctx
            assert set(flat) == set(range(length)), ctx
        else:
            assert flat == list(range(length)), ctx  # every index exactly once
        if drop_last or even:
            assert len(set(lengths)) == 1, ctx
            assert all(len(batch) == bs for rank in batches for batch in rank), ctx


def test_split_coverage_properties() -> None:
    for length, bs, n, drop_last, even in CONFIGS:
        bs *= n  # split mode needs a batch size divisible by n
        ctx = f"N={length} bs={bs} n={n} drop_last={drop_last} even={even}"
        sampler = BatchSampler(range(length), batch_size=bs, drop_last=drop_last)
        batches, lengths = shard_lists(sampler, n, split_batches=True, even_batches=even)
        assert lengths == [len(sampler)] * n, ctx
        flat = interleave(batches)
        if drop_last:
            assert flat == list(range(length // bs * bs)), ctx
        elif even:
            assert flat[:length] == list(range(length)), ctx
            assert set(flat) == set(range(length)), ctx
        else:
            assert flat == list(range(length)), ctx
        if drop_last or even:
            assert len({len(rank) for rank in batches}) == 1, ctx
            assert all(len(batch) == bs // n for rank in batches for batch in rank), ctx
            assert [len(rank) for rank in batches] == lengths, ctx


# --------------------------------------------------------------------------------------------
# BatchSamplerShard: attributes, epochs, data loaders, errors
# --------------------------------------------------------------------------------------------


def test_shard_is_a_batch_sampler_and_mirrors_attributes() -> None:
    inner = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=True)
    shard = BatchSamplerShard(inner, 2, 1)
    assert isinstance(shard, BatchSampler)
    assert shard.batch_size == 4
    assert shard.drop_last is True
    assert shard.sampler is inner.sampler
    assert shard.total_length == 2
    replacement = SequentialSampler(range(8))
    shard.sampler = replacement
    assert inner.sampler is replacement
    no_size = BatchSamplerShard([[0, 1], [2]], 2, 0, even_batches=False)
    assert no_size.batch_size is None
    assert no_size.drop_last is False
    assert no_size.sampler is None


def test_shard_in_a_dataloader() -> None:
    inner = BatchSampler(range(21), batch_size=3, drop_last=False)
    loader: DataLoader[int] = DataLoader(
        list(range(100, 121)),  # type: ignore[arg-type]
        batch_sampler=BatchSamplerShard(inner, 2, 1),
    )
    assert [batch.tolist() for batch in loader] == [
        [103, 104, 105],
        [109, 110, 111],
        [115, 116, 117],
        [100, 101, 102],
    ]
    assert len(loader) == 4


class _EpochBatchSampler(BatchSampler):
    def __init__(self) -> None:
        super().__init__(range(8), batch_size=2, drop_last=False)
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_set_epoch_is_forwarded() -> None:
    sampler = SeedableRandomSampler(range(8), data_seed=3)
    shard = BatchSamplerShard(BatchSampler(sampler, 2, False), 2, 0)
    shard.set_epoch(5)
    assert sampler.epoch == 5
    custom = _EpochBatchSampler()
    BatchSamplerShard(custom, 2, 0).set_epoch(4)
    assert custom.epoch == 4
    # A sampler without set_epoch is left alone.
    BatchSamplerShard(BatchSampler(range(8), 2, False), 2, 0).set_epoch(1)


@pytest.mark.parametrize(
    ("num_processes", "process_index", "match"),
    [
        (2, 2, r"num_processes=2, process_index=2"),
        (2, -1, r"process_index=-1"),
        (0, 0, r"num_processes=0"),
        (-3, 0, r"num_processes=-3"),
    ],
)
def test_bad_rank_raises(num_processes: int, process_index: int, match: str) -> None:
    inner = BatchSampler(range(8), batch_size=2, drop_last=False)
    with pytest.raises(ValueError, match=match):
        BatchSamplerShard(inner, num_processes, process_index)


def test_bad_rank_type_raises() -> None:
    inner = BatchSampler(range(8), batch_size=2, drop_last=False)
    with pytest.raises(TypeError, match="num_processes"):
        BatchSamplerShard(inner, 2.0, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="process_index"):
        BatchSamplerShard(inner, 2, True)


def test_split_needs_a_divisible_batch_size() -> None:
    inner = BatchSampler(range(20), batch_size=3, drop_last=False)
    with pytest.raises(ValueError, match=r"batch size \(3\).*num_processes \(2\)"):
        BatchSamplerShard(inner, 2, 0, split_batches=True)


@pytest.mark.parametrize("even", [True, False])
def test_split_needs_a_batch_size(even: bool) -> None:
    with pytest.raises(ValueError, match="split_batches=True.*batch_size"):
        BatchSamplerShard([[0, 1, 2, 3]], 2, 0, split_batches=True, even_batches=even)


def test_len_of_unsized_batch_sampler_names_the_wrapper() -> None:
    shard = BatchSamplerShard(iter([[0, 1], [2, 3]]), 2, 0, even_batches=False)
    with pytest.raises(TypeError, match="BatchSamplerShard has no length"):
        len(shard)


# --------------------------------------------------------------------------------------------
# SeedableRandomSampler
# --------------------------------------------------------------------------------------------


def test_seedable_sampler_is_a_random_sampler_with_public_state() -> None:
    sampler = SeedableRandomSampler(range(10), data_seed=42)
    assert isinstance(sampler, RandomSampler)
    assert sampler.initial_seed == 42
    assert sampler.epoch == 0
    assert isinstance(sampler.generator, torch.Generator)
    assert len(sampler) == 10


def test_same_seed_same_order_and_epochs_differ() -> None:
    first = SeedableRandomSampler(range(50), data_seed=1234)
    second = SeedableRandomSampler(range(50), data_seed=1234)
    epochs_first = [list(first) for _ in range(3)]
    epochs_second = [list(second) for _ in range(3)]
    assert epochs_first == epochs_second
    assert all(sorted(order) == list(range(50)) for order in epochs_first)
    assert epochs_first[0] != epochs_first[1] != epochs_first[2]
    assert first.epoch == 3
    other = SeedableRandomSampler(range(50), data_seed=99)
    assert list(other) != epochs_first[0]


def test_epoch_advances_only_after_a_full_pass_and_set_epoch_replays() -> None:
    sampler = SeedableRandomSampler(range(20), data_seed=7)
    epoch0 = list(sampler)
    epoch1 = list(sampler)
    assert sampler.epoch == 2
    partial = iter(sampler)
    next(partial)
    del partial
    assert sampler.epoch == 2  # an abandoned pass does not advance the epoch
    sampler.set_epoch(1)
    assert list(sampler) == epoch1
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    assert sampler.epoch == 1
    # The seed of epoch e is initial_seed + e.
    assert list(SeedableRandomSampler(range(20), data_seed=8)) == epoch1


def test_order_does_not_depend_on_the_global_rng() -> None:
    sampler = SeedableRandomSampler(range(30), data_seed=5)
    torch.manual_seed(0)
    order_a = list(sampler)
    sampler.set_epoch(0)
    torch.manual_seed(1)
    order_b = list(sampler)
    assert order_a == order_b
    state = torch.get_rng_state()
    list(sampler)
    assert torch.equal(state, torch.get_rng_state())


def test_seed_drawn_from_the_global_rng_once() -> None:
    torch.manual_seed(17)
    first = SeedableRandomSampler(range(30))
    torch.manual_seed(17)
    second = SeedableRandomSampler(range(30))
    assert first.initial_seed == second.initial_seed
    assert list(first) == list(second)
    torch.manual_seed(18)
    assert SeedableRandomSampler(range(30)).initial_seed != first.initial_seed


def test_given_generator_is_used_and_reseeded() -> None:
    generator = torch.Generator().manual_seed(123)
    sampler = SeedableRandomSampler(range(12), generator=generator, data_seed=4)
    assert sampler.generator is generator
    assert list(sampler) == list(SeedableRandomSampler(range(12), data_seed=4))


def test_replacement_and_num_samples_are_reproducible() -> None:
    def make() -> SeedableRandomSampler:
        return SeedableRandomSampler(range(5), replacement=True, num_samples=40, data_seed=11)

    first, second = make(), make()
    drawn = list(first)
    assert len(drawn) == 40 and set(drawn) <= set(range(5))
    assert drawn == list(second)


def test_global_order_is_the_same_for_any_number_of_processes() -> None:
    def global_orders(num_processes: int, epochs: int = 3) -> list[list[int]]:
        # Every rank builds its own sampler from the same seed, as each process does.
        shards = [
            BatchSamplerShard(
                BatchSampler(SeedableRandomSampler(range(24), data_seed=2024), 3, False),
                num_processes,
                rank,
            )
            for rank in range(num_processes)
        ]
        orders = []
        for epoch in range(epochs):
            for shard in shards:
                shard.set_epoch(epoch)
            orders.append(interleave([list(shard) for shard in shards]))
        return orders

    reference = global_orders(1)
    assert sorted(reference[0]) == list(range(24))
    assert reference[0] != reference[1]
    for num_processes in (2, 4):
        assert global_orders(num_processes) == reference


@pytest.mark.parametrize("bad", ["7", 7.0, True])
def test_bad_data_seed_raises(bad: object) -> None:
    with pytest.raises(TypeError, match="data_seed"):
        SeedableRandomSampler(range(4), data_seed=bad)  # type: ignore[arg-type]


def test_bad_epoch_raises() -> None:
    sampler = SeedableRandomSampler(range(4), data_seed=0)
    with pytest.raises(ValueError, match="epoch=-1"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch"):
        sampler.set_epoch("1")  # type: ignore[arg-type]
    assert sampler.epoch == 0


# --------------------------------------------------------------------------------------------
# SkipBatchSampler
# --------------------------------------------------------------------------------------------


def test_skip_golden() -> None:
    inner = BatchSampler(range(16), batch_size=4, drop_last=False)
    skipped = SkipBatchSampler(inner, 2)
    assert list(skipped) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert len(skipped) == 2
    assert skipped.total_length == 4
    assert isinstance(skipped, BatchSampler)
    assert skipped.batch_size == 4 and skipped.drop_last is False
    assert skipped.sampler is inner.sampler


@pytest.mark.parametrize("skip", [4, 5, 100])
def test_skip_beyond_the_end_yields_nothing(skip: int) -> None:
    skipped = SkipBatchSampler(BatchSampler(range(16), batch_size=4, drop_last=False), skip)
    assert list(skipped) == []
    assert len(skipped) == 0


def test_skip_zero_is_the_identity_and_repeats_every_epoch() -> None:
    inner = BatchSampler(range(5), batch_size=2, drop_last=False)
    assert list(SkipBatchSampler(inner)) == list(inner)
    skipped = SkipBatchSampler(inner, 1)
    assert list(skipped) == list(skipped) == [[2, 3], [4]]


def test_skip_draws_the_skipped_batches_and_forwards_set_epoch() -> None:
    sampler = SeedableRandomSampler(range(12), data_seed=3)
    full = list(BatchSampler(SeedableRandomSampler(range(12), data_seed=3), 3, False))
    skipped = SkipBatchSampler(BatchSampler(sampler, 3, False), 2)
    assert list(skipped) == full[2:]
    assert sampler.epoch == 1
    skipped.set_epoch(0)
    assert sampler.epoch == 0
    assert list(skipped) == full[2:]


def test_skip_in_a_dataloader_over_a_shard() -> None:
    inner = BatchSampler(range(21), batch_size=3, drop_last=False)
    shard = BatchSamplerShard(inner, 2, 0)
    loader: DataLoader[int] = DataLoader(
        list(range(21)),  # type: ignore[arg-type]
        batch_sampler=SkipBatchSampler(shard, 3),
    )
    assert [batch.tolist() for batch in loader] == [[18, 19, 20]]
    assert len(loader) == 1


@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (1.5, TypeError)])
def test_bad_skip_raises(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"skip_batches={bad}"):
        SkipBatchSampler(BatchSampler(range(4), 2, False), bad)  # type: ignore[arg-type]


def test_every_sampler_exports() -> None:
    import accel_data.samplers as module

    assert sorted(module.__all__) == [
        "BatchSamplerShard",
        "SeedableRandomSampler",
        "SkipBatchSampler",
    ]
