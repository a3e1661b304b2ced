"""``Accelerator.gather_for_metrics`` on 2 gloo ranks: every sample exactly once, in order.

One worker call runs every configuration: for each ``split_batches`` x ``dispatch_batches``
combination it builds one ``Accelerator(cpu=True)`` and, for map-style and iterable datasets
of 82, 99, 512, 33 and 1 samples (batch 16), with and without ``drop_last``, iterates the
prepared loader calling ``gather_for_metrics`` on every rank at every step. Without
``drop_last`` the concatenated gathered outputs must be exactly the dataset in order (every
unshuffled mode hands out rows so that the rank-major gather of a step is a contiguous slice
of the epoch); with ``drop_last`` only full global batches come back. Python objects
(strings, per-sample dicts) go through ``gather_object`` and obey the same rule.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from accel.accelerator import Accelerator
from accel_data import DataLoaderConfiguration
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess

BATCH_SIZE = 16
WORLD_SIZE = 2
LENGTHS = (82, 99, 512, 33, 1)
MODES = tuple(itertools.product((False, True), (False, True)))  # (split, dispatch)
SHUFFLE_SEED = 3


class Stream(IterableDataset[torch.Tensor]):
    """``range(length)`` as a stream of 0-d tensors, without ``__len__``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        return iter(torch.arange(self.length))


def _records(length: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": f"sample-{i}"} for i in range(length)]


def _keep_list(batch: list[Any]) -> list[Any]:
    """A collate function that keeps the per-sample objects as they are."""
    return list(batch)


def _sized(values: Any) -> Dataset[Any]:
    """A tensor or list used as a map-style dataset (what DataLoader accepts at run time)."""
    return cast(Dataset[Any], values)


def _make_loader(kind: str, length: int, drop_last: bool) -> DataLoader[Any]:
    if kind == "map":
        return DataLoader(_sized(torch.arange(length)), batch_size=BATCH_SIZE, drop_last=drop_last)
    if kind == "iterable":
        return DataLoader(Stream(length), batch_size=BATCH_SIZE, drop_last=drop_last)
    if kind == "shuffled":
        generator = torch.Generator().manual_seed(SHUFFLE_SEED)
        return DataLoader(
            _sized(torch.arange(length)), batch_size=BATCH_SIZE, shuffle=True, generator=generator
        )
    if kind == "strings":
        return DataLoader(_sized([f"sample-{i}" for i in range(length)]), batch_size=BATCH_SIZE)
    return DataLoader(_sized(_records(length)), batch_size=BATCH_SIZE, collate_fn=_keep_list)


def _as_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _as_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_plain(item) for item in value]
    return value


# (split, dispatch, kind, length, drop_last)
TENSOR_CASES = [
    (split, dispatch, kind, length, drop_last)
    for (split, dispatch), kind, length, drop_last in itertools.product(
        MODES, ("map", "iterable"), LENGTHS, (False, True)
    )
]
# Per-sample Python objects: shard mode only (a dispatching loader needs tensor batches, as in
# Accelerate, where ``find_batch_size`` raises on strings).
OBJECT_CASES = [
    (split, False, kind, length, False)
    for split, kind, length in itertools.product(
        (False, True), ("strings", "records"), (82, 99, 33, 1)
    )
]
SHUFFLED_CASES = [
    (split, False, "shuffled", length, False) for split in (False, True) for length in (82, 99)
]
CASES = TENSOR_CASES + OBJECT_CASES + SHUFFLED_CASES
# A tensor batch gathered with use_gather_object=True (map-style, shard mode).
FORCED_OBJECT_CASES = [(False, False, "map", length, False) for length in (82, 33)]


def _forced(case: tuple[Any, ...]) -> tuple[Any, ...]:
    """The result key of a case gathered with use_gather_object=True."""
    return ("forced", *case)


def _run_case(accelerator: Accelerator, case: tuple[Any, ...], forced: bool) -> dict[str, Any]:
    _, _, kind, length, drop_last = case
    loader = accelerator.prepare(_make_loader(kind, length, drop_last))
    per_step: list[Any] = []
    for batch in loader:
        if forced:
            gathered = accelerator.gather_for_metrics(batch, use_gather_object=True)
            per_step.append([_as_plain(item) for item in gathered])
        elif kind in ("map", "iterable", "shuffled"):
            # A structure of tensors, as a model's outputs and labels would be.
            gathered = accelerator.gather_for_metrics({"pred": batch * 2, "label": batch})
            per_step.append(_as_plain(gathered))
        else:
            per_step.append(_as_plain(accelerator.gather_for_metrics(batch)))
    return {"per_step": per_step, "reference": _reference_order(kind, length, drop_last)}


def _reference_order(kind: str, length: int, drop_last: bool) -> list[Any]:
    """The samples in the order the original (unprepared) loader yields them."""
    loader = _make_loader(kind, length, drop_last)
    return [_as_plain(item) for batch in loader for item in batch]


def _gather_every_case() -> dict[tuple[Any, ...], dict[str, Any]]:
    """On each rank: what gather_for_metrics returned at every step, for every case."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for split, dispatch in MODES:
        # One Accelerator per mode; GradientState follows whichever loader is active.
        accelerator = Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(
                split_batches=split, dispatch_batches=dispatch
            ),
        )
        assert accelerator.num_processes == WORLD_SIZE
        for case in CASES:
            if case[:2] == (split, dispatch):
                out[case] = _run_case(accelerator, case, forced=False)
        for case in FORCED_OBJECT_CASES:
            if case[:2] == (split, dispatch):
                out[_forced(case)] = _run_case(accelerator, case, forced=True)
    return out


@pytest.fixture(scope="module")
def gathered() -> list[dict[tuple[Any, ...], dict[str, Any]]]:
    return run_on_cpu(_gather_every_case, world_size=WORLD_SIZE, timeout=120)


def case_id(case: tuple[Any, ...]) -> str:
    split, dispatch, kind, length, drop_last = case
    mode = ("split" if split else "nosplit") + ("-dispatch" if dispatch else "-shard")
    return f"{kind}-{length}-{mode}{'-drop_last' if drop_last else ''}"


def _global_batch(split: bool) -> int:
    return BATCH_SIZE if split else BATCH_SIZE * WORLD_SIZE


def _flatten(per_step: list[Any], kind: str) -> list[Any]:
    if kind in ("map", "iterable", "shuffled"):
        preds = [p for step in per_step for p in step["pred"]]
        labels = [x for step in per_step for x in step["label"]]
        assert preds == [2 * x for x in labels], "predictions and labels were trimmed apart"
        return labels
    return [item for step in per_step for item in step]


def _step_sizes(per_step: list[Any], kind: str) -> list[int]:
    if kind in ("map", "iterable", "shuffled"):
        return [len(step["label"]) for step in per_step]
    return [len(step) for step in per_step]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gather_for_metrics_returns_each_sample_exactly_once(
    gathered: list[dict[tuple[Any, ...], dict[str, Any]]], case: tuple[Any, ...]
) -> None:
    split, _, kind, length, drop_last = case
    first, second = (ranks[case] for ranks in gathered)
    assert first["per_step"] == second["per_step"], "ranks gathered different data"
    samples = _flatten(first["per_step"], kind)
    reference = first["reference"]
    size = _global_batch(split)
    if drop_last:
        # Only complete global batches: floor(len / global batch) of them, nothing trimmed.
        full = (length // size) * size
        assert samples == reference[:full]
        assert _step_sizes(first["per_step"], kind) == [size] * (length // size)
        return
    key = (lambda record: record["id"]) if kind == "records" else None
    assert sorted(samples, key=key) == sorted(reference, key=key)
    # Every mode hands a step's rows out so that the rank-major gather is a contiguous slice
    # of the original loader's order: the concatenation is the dataset in that order.
    assert samples == reference
    # Every step but the last is one full global batch; the last holds what is left.
    tail = [length % size] if length % size else []
    assert _step_sizes(first["per_step"], kind) == [size] * (length // size) + tail


def test_last_global_batch_smaller_than_the_number_of_processes(
    gathered: list[dict[tuple[Any, ...], dict[str, Any]]],
) -> None:
    # 33 samples, global batch 16 (split): the last step holds 1 sample for 2 ranks.
    for dispatch, kind in itertools.product((False, True), ("map", "iterable")):
        per_step = gathered[0][(True, dispatch, kind, 33, False)]["per_step"]
        assert per_step[-1] == {"pred": [64], "label": [32]}, (dispatch, kind)
    per_step = gathered[1][(False, False, "map", 1, False)]["per_step"]
    assert per_step == [{"pred": [0], "label": [0]}]


def test_shuffled_epoch_is_a_permutation_in_the_loader_order(
    gathered: list[dict[tuple[Any, ...], dict[str, Any]]],
) -> None:
    for case in SHUFFLED_CASES:
        samples = _flatten(gathered[0][case]["per_step"], "shuffled")
        assert samples != list(range(case[3])), "the loader did not shuffle"
        assert sorted(samples) == list(range(case[3]))


@pytest.mark.parametrize("case", FORCED_OBJECT_CASES, ids=case_id)
def test_tensor_gathered_as_objects_is_each_sample_exactly_once(
    gathered: list[dict[tuple[Any, ...], dict[str, Any]]], case: tuple[Any, ...]
) -> None:
    length = case[3]
    per_step = gathered[0][_forced(case)]["per_step"]
    rows: list[int] = []
    for step in per_step:
        for item in step:  # Accelerate: one 0-d row per sample; accel: one tensor per rank
            rows.extend(item if isinstance(item, list) else [item])
    assert rows == list(range(length))
