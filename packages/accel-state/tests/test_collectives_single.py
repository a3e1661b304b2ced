"""Collectives in a single process: identities, validation, and the local pad_input_tensors."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch

from accel_state import (
    DistributedType,
    PartialState,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    pad_input_tensors,
    reduce,
)

Pair = collections.namedtuple("Pair", ["first", "second"])


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCEL_DEBUG_MODE", "ACCEL_TORCH_DEVICE"):
        monkeypatch.delenv(key, raising=False)


def _nested() -> dict[str, Any]:
    return {
        "x": torch.arange(4.0).reshape(2, 2),
        "pair": Pair(torch.tensor(1), [torch.tensor([2, 3])]),
        "t": (torch.zeros(1),),
    }


def _same_leaves(a: Any, b: Any) -> bool:
    """True when the structures match and every leaf is the very same object."""
    if isinstance(a, dict):
        return (
            type(a) is type(b) and a.keys() == b.keys() and all(_same_leaves(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_leaves, a, b))
    return a is b


def test_collectives_create_the_state_on_first_use() -> None:
    assert PartialState._shared_state == {}
    t = torch.ones(2)
    assert gather(t) is t
    assert PartialState().distributed_type == DistributedType.NO


@pytest.mark.parametrize(
    "operation",
    [gather, broadcast, pad_across_processes, lambda d: broadcast(d, from_process=3)],
    ids=["gather", "broadcast", "pad_across_processes", "broadcast_from_3"],
)
def test_single_process_returns_the_input(operation: Callable[[Any], Any]) -> None:
    PartialState()
    data = _nested()
    out = operation(data)
    assert _same_leaves(data, out)
    assert type(out["pair"]) is Pair
    scalar = torch.tensor(5.0)
    assert operation(scalar) is scalar  # 0-d is not expanded without communication


def test_gather_object_and_broadcast_object_list_return_the_input() -> None:
    objects = [{"a": 1}, "two"]
    assert gather_object(objects) is objects
    assert broadcast_object_list(objects) is objects
    assert objects == [{"a": 1}, "two"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "max", "min"])
def test_reduce_returns_a_clone(reduction: str) -> None:
    data = {"a": torch.tensor([1.0, 2.0]), "b": [torch.tensor(3)]}
    out = reduce(data, reduction=reduction)  # type: ignore[arg-type]
    assert out["a"] is not data["a"]
    assert out["a"].data_ptr() != data["a"].data_ptr()
    assert out["a"].tolist() == [1.0, 2.0]
    assert out["b"][0].item() == 3
    out["a"][0] = 100.0
    assert data["a"][0].item() == 1.0


def test_reduce_applies_the_scale() -> None:
    out = reduce(torch.tensor([1.0, 2.0]), reduction="sum", scale=0.5)
    assert out.tolist() == [0.5, 1.0]


@pytest.mark.parametrize("reduction", ["avg", "SUM", "", "product"])
def test_reduce_unknown_reduction_lists_allowed_values(reduction: str) -> None:
    with pytest.raises(ValueError) as info:
        reduce(torch.ones(1), reduction=reduction)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(reduction) in message
    for allowed in ("mean", "sum", "max", "min", "none"):
        assert repr(allowed) in message


@pytest.mark.parametrize(
    ("name", "operation"),
    [
        ("gather", gather),
        ("reduce", reduce),
        ("broadcast", broadcast),
        ("pad_across_processes", pad_across_processes),
    ],
)
def test_non_tensor_leaves_name_type_and_path(name: str, operation: Callable[[Any], Any]) -> None:
    data = {"ok": torch.ones(1), "bad": [torch.ones(1), 3.5]}
    with pytest.raises(TypeError) as info:
        operation(data)
    message = str(info.value)
    assert f"`{name}`" in message
    assert "'float'" in message
    assert "data['bad'][1]" in message


def test_non_tensor_at_the_top_level() -> None:
    with pytest.raises(TypeError, match=r"'str' at data:"):
        gather("text")


def test_pad_input_tensors_golden() -> None:
    batch = torch.arange(1, 11).reshape(5, 2)
    padded = pad_input_tensors(batch, batch_size=5, num_processes=2)
    assert padded.shape == (6, 2)
    assert padded[:5].tolist() == batch.tolist()
    assert padded[5].tolist() == [0, 0]
    assert padded.dtype == batch.dtype


def test_pad_input_tensors_divisible_batch_is_unchanged() -> None:
    batch = torch.arange(6).reshape(6, 1)
    assert pad_input_tensors(batch, batch_size=6, num_processes=2) is batch
    assert pad_input_tensors(batch, batch_size=6, num_processes=1) is batch


@pytest.mark.parametrize(
    ("batch", "processes", "rows"), [(7, 3, 9), (1, 4, 4), (2, 8, 8), (9, 4, 12)]
)
def test_pad_input_tensors_pads_to_a_multiple(batch: int, processes: int, rows: int) -> None:
    padded = pad_input_tensors(torch.ones(batch), batch_size=batch, num_processes=processes)
    assert padded.shape == (rows,)
    assert padded.sum().item() == batch


def test_pad_input_tensors_nested_and_other_dim() -> None:
    data = {"ids": torch.arange(5), "mask": [torch.ones(5, 1)], "scalar": torch.tensor(7)}
    out = pad_input_tensors(data, batch_size=5, num_processes=2)
    assert out["ids"].tolist() == [0, 1, 2, 3, 4, 0]
    assert out["mask"][0].shape == (6, 1)
    assert out["scalar"].item() == 7  # 0-d tensors have no batch dimension
    wide = pad_input_tensors(torch.ones(2, 3), batch_size=3, num_processes=2, dim=1)
    assert wide.tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize("processes", [0, -1])
def test_pad_input_tensors_needs_a_positive_process_count(processes: int) -> None:
    with pytest.raises(ValueError, match="num_processes"):
        pad_input_tensors(torch.ones(2), batch_size=2, num_processes=processes)


def test_copy_tensor_to_devices_single_process() -> None:
    t = torch.arange(3)
    assert copy_tensor_to_devices(t) is t
    with pytest.raises(ValueError, match="no process passed a tensor"):
        copy_tensor_to_devices(None)
