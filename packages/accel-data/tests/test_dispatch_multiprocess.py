"""Sharded and dispatched loaders on 2 real gloo processes (accel_state.testing.run_on_cpu).

All checks share one run (module fixture): each rank iterates every configuration and
returns plain lists, which the tests merge in rank order.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from accel_data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from accel_state import GradientState, PartialState, gather_object
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess

MODES = ("shard", "split", "dispatch", "dispatch-split")
PAD = -1


class Ragged(Dataset):  # type: ignore[type-arg]
    """Item ``i`` is ``[i] * length(i)``; the lengths differ within and between batches of 4."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    @staticmethod
    def item_length(index: int) -> int:
        return index % 3 + 1 + index // 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.item_length(index),), index, dtype=torch.int64)


def pad_to_own_width(items: list[torch.Tensor]) -> torch.Tensor:
    """Pad a batch to its own longest item, so that batches have different widths."""
    return pad_sequence(items, batch_first=True, padding_value=PAD)


def named_collate(items: list[int]) -> dict[str, Any]:
    return {
        "x": torch.tensor(items, dtype=torch.float32).unsqueeze(1).repeat(1, 3),
        "y": torch.tensor(items, dtype=torch.int64),
        "names": [f"s{i}" for i in items],
    }


def prepare(mode: str, dataloader: DataLoader, **kwargs: Any) -> Any:  # type: ignore[type-arg]
    dispatch = mode.startswith("dispatch")
    return prepare_data_loader(
        dataloader,
        put_on_device=True,
        device="cpu",
        dispatch_batches=dispatch,
        split_batches=mode.endswith("split"),
        **kwargs,
    )


def record(loader: Any) -> list[tuple[list[Any], bool, int]]:
    state = GradientState()
    return [(batch.tolist(), state.end_of_dataloader, state.remainder) for batch in loader]


def _run_checks() -> dict[str, Any]:
    rank = PartialState().process_index
    # Different seeds on each rank: shuffling must still agree (rng_types syncs the sampler's
    # generator from rank 0; dispatching reads on rank 0 only).
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {"rank": rank}

    # No padding: 64 samples, 4 per batch, even_batches=False.
    for mode in MODES:
        for shuffle in (False, True):
            loader = prepare(
                mode,
                DataLoader(list(range(64)), batch_size=4, shuffle=shuffle),
                even_batches=False,
                rng_types=["generator"],
            )
            out[("divisible", mode, shuffle)] = {
                "type": type(loader).__name__,
                "len": len(loader),
                "epochs": [record(loader) for _ in range(2)],
            }
    # gather_object of every rank's samples, as a metric would.
    loader = prepare(
        "shard", DataLoader(list(range(40)), batch_size=4, shuffle=True), rng_types=["generator"]
    )
    out["gathered"] = gather_object([x for batch in loader for x in batch.tolist()])

    # Padding: 49 samples with even_batches=True.
    for mode in MODES:
        loader = prepare(mode, DataLoader(list(range(49)), batch_size=4))
        out[("padded", mode)] = {"len": len(loader), "records": record(loader)}
    loader = prepare("dispatch", DataLoader(list(range(49)), batch_size=4, drop_last=True))
    out["dispatch-drop-last"] = {"len": len(loader), "records": record(loader)}

    # Ragged batches: each batch padded to its own width.
    for mode, length in (("dispatch", 22), ("dispatch", 21), ("dispatch-split", 22)):
        loader = prepare(
            mode, DataLoader(Ragged(length), batch_size=4, collate_fn=pad_to_own_width)
        )
        out[("ragged", mode, length)] = record(loader)

    # Dicts with float/int tensors and a list of strings.
    for mode in ("dispatch", "dispatch-split"):
        loader = prepare(mode, DataLoader(list(range(10)), batch_size=4, collate_fn=named_collate))
        out[("named", mode)] = [
            {
                "x": batch["x"].tolist(),
                "x_dtype": str(batch["x"].dtype),
                "y": batch["y"].tolist(),
                "names": batch["names"],
            }
            for batch in loader
        ]
    out["registered"] = GradientState()._dataloader_references == [None]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_cpu(_run_checks, timeout=120)


def merged_steps(per_rank: list[list[Any]]) -> list[list[Any]]:
    """The gathered batch of each step: the ranks' batches concatenated in rank order."""
    assert len({len(records) for records in per_rank}) == 1
    return [[row for batch, *_ in step for row in batch] for step in zip(*per_rank, strict=True)]


def test_both_ranks_ran_and_unregistered(ranks: list[dict[str, Any]]) -> None:
    assert [info["rank"] for info in ranks] == [0, 1]
    assert all(info["registered"] for info in ranks)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_gathered_batches_are_the_dataset_without_padding(
    ranks: list[dict[str, Any]], mode: str, shuffle: bool
) -> None:
    runs = [info[("divisible", mode, shuffle)] for info in ranks]
    expected_type = DataLoaderDispatcher if mode.startswith("dispatch") else DataLoaderShard
    assert {run["type"] for run in runs} == {expected_type.__name__}
    orders = []
    for epoch in range(2):
        per_rank = [run["epochs"][epoch] for run in runs]
        for run, records in zip(runs, per_rank, strict=True):
            assert run["len"] == len(records)
            assert [end for _, end, _ in records] == [False] * (len(records) - 1) + [True]
            # Sharded: len(dataset) % total_batch_size; dispatched: the rows of the last
            # global batch. Either way the whole last gathered batch is kept.
            last_rows = sum(len(records[-1][0]) for records in per_rank)
            assert records[-1][2] == (last_rows if mode.startswith("dispatch") else 0)
        flat = [row for step in merged_steps(per_rank) for row in step]
        assert sorted(flat) == list(range(64))
        orders.append(flat)
        if not shuffle:
            assert flat == list(range(64))
    if shuffle:
        assert orders[0] != list(range(64))
        assert orders[0] != orders[1]  # a new order each epoch


def test_gather_object_of_the_ranks_samples(ranks: list[dict[str, Any]]) -> None:
    gathered = [info["gathered"] for info in ranks]
    assert gathered[0] == gathered[1]
    assert sorted(gathered[0]) == list(range(40))


@pytest.mark.parametrize("mode", MODES)
def test_even_batches_pad_with_duplicates_that_the_remainder_drops(
    ranks: list[dict[str, Any]], mode: str
) -> None:
    per_rank = [info[("padded", mode)]["records"] for info in ranks]
    steps = merged_steps(per_rank)
    for info, records in zip(ranks, per_rank, strict=True):
        assert info[("padded", mode)]["len"] == len(records)
    remainder = per_rank[0][-1][2]
    assert remainder == 49 % (4 if mode.endswith("split") else 8)
    kept = [row for step in steps[:-1] for row in step] + steps[-1][:remainder]
    extras = steps[-1][remainder:]
    assert kept == list(range(49))
    everything = collections.Counter(row for step in steps for row in step)
    assert everything == collections.Counter(range(49)) + collections.Counter(extras)
    if mode.startswith("dispatch"):
        # The last global batch is completed by repeating its own rows.
        assert extras == [48]
    else:
        # Sharded loaders complete the last round from the start of the epoch.
        assert extras == list(range(len(extras)))
        assert len(extras) == (3 if mode == "split" else 7)


def test_dispatch_with_drop_last(ranks: list[dict[str, Any]]) -> None:
    per_rank = [info["dispatch-drop-last"]["records"] for info in ranks]
    assert all(info["dispatch-drop-last"]["len"] == 6 for info in ranks)
    steps = merged_steps(per_rank)
    assert [row for step in steps for row in step] == list(range(48))
    assert per_rank[0][-1][2] == 8  # the real rows of the last global batch: all of them


def real_rows(batch: list[list[int]]) -> list[tuple[int, int]]:
    """(item, length) of each row, with the padding stripped."""
    rows = []
    for row in batch:
        values = [v for v in row if v != PAD]
        assert values and len(set(values)) == 1 and row[: len(values)] == values
        rows.append((values[0], len(values)))
    return rows


@pytest.mark.parametrize(
    ("mode", "length"), [("dispatch", 22), ("dispatch", 21), ("dispatch-split", 22)]
)
def test_ragged_batches_are_dispatched_whole(
    ranks: list[dict[str, Any]], mode: str, length: int
) -> None:
    per_rank = [info[("ragged", mode, length)] for info in ranks]
    original = [
        batch.tolist()
        for batch in DataLoader(Ragged(length), batch_size=4, collate_fn=pad_to_own_width)
    ]
    kept: list[tuple[int, int]] = []
    steps = list(zip(*per_rank, strict=True))
    for index, step in enumerate(steps):
        rows = [row for batch, _, _ in step for row in real_rows(batch)]
        if index == len(steps) - 1 and step[0][2] > 0:
            rows = rows[: step[0][2]]
        kept.extend(rows)
        if mode == "dispatch" and 2 * index + 1 < len(original):
            # Per-rank dispatch: rank r receives the r-th batch read for this step, whole.
            assert [batch for batch, _, _ in step] == original[2 * index : 2 * index + 2]
    assert kept == [(i, Ragged.item_length(i)) for i in range(length)]
    widths = {len(batch[0]) for batch, _, _ in per_rank[0]}
    assert len(widths) > 1


@pytest.mark.parametrize("mode", ["dispatch", "dispatch-split"])
def test_dict_batches_with_strings_are_dispatched(ranks: list[dict[str, Any]], mode: str) -> None:
    per_rank = [info[("named", mode)] for info in ranks]
    seen = sorted(y for batches in per_rank for batch in batches for y in batch["y"])
    for batches in per_rank:
        for batch in batches:
            assert batch["x_dtype"] == "torch.float32"
            assert batch["x"] == [[float(y)] * 3 for y in batch["y"]]
            # The strings of a batch travel with it, unsliced.
            assert {f"s{y}" for y in batch["y"]} <= set(batch["names"])
    assert sorted(set(seen)) == list(range(10))
