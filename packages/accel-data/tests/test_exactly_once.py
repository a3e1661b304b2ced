"""Every sample is counted exactly once when the ranks' batches are gathered for metrics.

``gather_for_metrics`` concatenates the batches of all processes in rank order and, on the
last step of the epoch (``end_of_dataloader``), keeps only the first ``remainder`` rows when
``remainder > 0``. These tests do that by hand on 2 ranks: the kept rows of an epoch must be
the dataset, each sample once, and in the loader's order.

Sharded loaders (no dispatch) need no collectives, so both ranks' loaders are built in this
process with ``num_processes=2`` and ``process_index=0/1``; dispatching loaders need two real
processes and run once for every configuration (module fixture).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accel_data import prepare_data_loader
from accel_state import GradientState
from accel_state.testing import run_on_cpu

BATCH_SIZE = 16
SEED = 5


class Stream(IterableDataset):  # type: ignore[type-arg]
    """``range(length)`` as a stream without ``__len__``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        return iter(range(self.length))


def make_dataloader(length: int, kind: str, shuffle: bool) -> DataLoader:  # type: ignore[type-arg]
    if kind == "iterable":
        return DataLoader(Stream(length), batch_size=BATCH_SIZE)
    generator = torch.Generator().manual_seed(SEED) if shuffle else None
    return DataLoader(
        list(range(length)), batch_size=BATCH_SIZE, shuffle=shuffle, generator=generator
    )


def record(loader: Any) -> list[tuple[list[int], bool, int]]:
    """Every batch of one epoch with the end flag and remainder seen while it was used."""
    state = GradientState()
    return [(batch.tolist(), state.end_of_dataloader, int(state.remainder)) for batch in loader]


def kept_rows(per_rank: list[list[tuple[list[int], bool, int]]]) -> list[int]:
    """What gather_for_metrics returns over the epoch, from each rank's recorded batches."""
    steps = len(per_rank[0])
    assert all(len(records) == steps for records in per_rank), "ranks stepped unevenly"
    kept: list[int] = []
    for step in range(steps):
        rows = [row for records in per_rank for row in records[step][0]]
        ends = {records[step][1] for records in per_rank}
        assert ends == {step == steps - 1}, f"end_of_dataloader wrong at step {step}"
        remainders = {records[step][2] for records in per_rank}
        assert len(remainders) == 1, "ranks disagree on the remainder"
        remainder = remainders.pop()
        if step == steps - 1 and remainder > 0:
            rows = rows[:remainder]
        kept.extend(rows)
    return kept


def reference_order(length: int, kind: str, shuffle: bool) -> list[int]:
    """The order the original loader yields its samples in."""
    return [x for batch in make_dataloader(length, kind, shuffle) for x in batch.tolist()]


LENGTHS = (82, 99, 512)
CASES = [
    *[
        (length, split, kind, shuffle)
        for length, split, (kind, shuffle) in itertools.product(
            LENGTHS,
            (False, True),
            (("map", False), ("map", True), ("iterable", False)),
        )
    ],
    # The last batch is smaller than the number of processes (1 row for 2 ranks).
    (33, True, "map", False),
    (33, True, "iterable", False),
    (33, False, "map", True),
    (1, True, "map", False),
    (1, False, "iterable", False),
]


def case_id(case: tuple[int, bool, str, bool]) -> str:
    length, split, kind, shuffle = case
    return f"{kind}-{length}-{'split' if split else 'shard'}{'-shuffled' if shuffle else ''}"


# -- sharded: both ranks in this process -----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sharded_loaders_count_every_sample_once(case: tuple[int, bool, str, bool]) -> None:
    length, split, kind, shuffle = case
    per_rank = []
    for rank in range(2):
        loader = prepare_data_loader(
            make_dataloader(length, kind, shuffle),
            num_processes=2,
            process_index=rank,
            split_batches=split,
        )
        per_rank.append(record(loader))
    kept = kept_rows(per_rank)
    assert kept == reference_order(length, kind, shuffle)
    assert sorted(kept) == list(range(length))


# -- dispatched: two real processes ----------------------------------------------------------


def dispatch_records(cases: list[tuple[int, bool, str, bool]]) -> dict[Any, Any]:
    """On each rank: the recorded epoch of a dispatching loader for every case."""
    out = {}
    for length, split, kind, shuffle in cases:
        loader = prepare_data_loader(
            make_dataloader(length, kind, shuffle),
            put_on_device=True,
            device="cpu",
            dispatch_batches=True,
            split_batches=split,
        )
        out[(length, split, kind, shuffle)] = record(loader)
    return out


@pytest.fixture(scope="module")
def dispatched() -> list[dict[Any, Any]]:
    return run_on_cpu(dispatch_records, CASES, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dispatched_loaders_count_every_sample_once(
    dispatched: list[dict[Any, Any]], case: tuple[int, bool, str, bool]
) -> None:
    length, split, kind, shuffle = case
    per_rank = [ranks[case] for ranks in dispatched]
    kept = kept_rows(per_rank)
    assert sorted(kept) == list(range(length))
    if not shuffle:
        assert kept == list(range(length))
    # Rank 0 reads batch after batch: each step takes one global batch (split) or one batch
    # per process, so every step but the last holds 16 (split) or 32 rows.
    full = BATCH_SIZE if split else 2 * BATCH_SIZE
    steps = list(zip(*per_rank, strict=True))
    assert all(len(a[0]) + len(b[0]) == full for a, b in steps[:-1])
    assert len(steps) == -(-length // full)
