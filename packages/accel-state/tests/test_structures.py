"""Walking nested batches: recursively_apply, send_to_device, batch sizes and friends."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import pytest
import torch

from accel_state import (
    TensorInformation,
    concatenate,
    find_batch_size,
    find_device,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_torch_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from accel_state.structures import get_shape

Point = collections.namedtuple("Point", ["x", "y"])


class TypedPoint(NamedTuple):
    x: Any
    y: Any


class MyDict(dict):  # type: ignore[type-arg]
    """A dict subclass that must survive a traversal."""


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_recursively_apply_keeps_container_types() -> None:
    data = {
        "list": [torch.tensor(1), torch.tensor(2)],
        "tuple": (torch.tensor(3),),
        "named": Point(torch.tensor(4), [torch.tensor(5)]),
        "typed": TypedPoint(torch.tensor(6), torch.tensor(7)),
        "ordered": collections.OrderedDict([("b", torch.tensor(8)), ("a", torch.tensor(9))]),
        "mine": MyDict(k=torch.tensor(10)),
    }
    out = recursively_apply(_double, data)
    assert type(out) is dict
    assert type(out["list"]) is list and [t.item() for t in out["list"]] == [2, 4]
    assert type(out["tuple"]) is tuple and out["tuple"][0].item() == 6
    assert type(out["named"]) is Point
    assert out["named"].x.item() == 8 and out["named"].y[0].item() == 10
    assert type(out["typed"]) is TypedPoint and out["typed"].y.item() == 14
    assert type(out["ordered"]) is collections.OrderedDict
    assert list(out["ordered"]) == ["b", "a"]
    assert out["ordered"]["a"].item() == 18
    assert type(out["mine"]) is MyDict and out["mine"]["k"].item() == 20
    # The input is not modified.
    assert data["list"][0].item() == 1


def test_recursively_apply_passes_extra_arguments() -> None:
    def add(t: torch.Tensor, amount: int, *, times: int = 1) -> torch.Tensor:
        return (t + amount) * times

    out = recursively_apply(add, [torch.tensor(1)], 2, times=3)
    assert out[0].item() == 9


def test_recursively_apply_leaves_other_leaves_alone_by_default() -> None:
    out = recursively_apply(_double, {"t": torch.tensor(1), "s": "text", "n": None})
    assert out["s"] == "text" and out["n"] is None and out["t"].item() == 2


def test_recursively_apply_custom_test_type() -> None:
    out = recursively_apply(lambda v: v + 1, [1, (2, "x")], test_type=lambda v: isinstance(v, int))
    assert out == [2, (3, "x")]


def test_error_on_other_type_names_the_type_and_the_path() -> None:
    data = {"a": torch.zeros(1), "b": [torch.zeros(1), "oops"]}
    with pytest.raises(TypeError) as info:
        recursively_apply(_double, data, error_on_other_type=True)
    # Accelerate's text, verbatim (its suite compares it); the place is in the note.
    assert str(info.value) == (
        "Unsupported types (<class 'str'>) passed to `_double`. Only nested list/tuple/dicts "
        "of objects that are valid for `is_torch_tensor` should be passed."
    )
    assert info.value.__notes__ == ["The 'str' value is at data['b'][1]."]


def test_error_on_other_type_at_the_top_level() -> None:
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'int'>\)") as info:
        recursively_apply(_double, 3, error_on_other_type=True)
    assert info.value.__notes__ == ["The 'int' value is at data."]


def test_honor_type_and_is_namedtuple() -> None:
    assert honor_type((1, 2), (x for x in [3, 4])) == (3, 4)
    assert honor_type([1], iter([5])) == [5]
    rebuilt = honor_type(Point(1, 2), (x * 10 for x in (1, 2)))
    assert rebuilt == Point(10, 20) and type(rebuilt) is Point
    assert is_namedtuple(Point(1, 2)) and is_namedtuple(TypedPoint(1, 2))
    assert not is_namedtuple((1, 2))
    assert not is_namedtuple([1, 2])
    assert is_torch_tensor(torch.zeros(1)) and not is_torch_tensor([0])


def test_send_to_device_moves_tensors_and_keeps_structure() -> None:
    batch = {"x": torch.ones(2), "pair": Point(torch.zeros(1), "label"), "n": 3}
    moved = send_to_device(batch, "meta")
    assert moved["x"].device.type == "meta"
    assert type(moved["pair"]) is Point
    assert moved["pair"].x.device.type == "meta"
    assert moved["pair"].y == "label" and moved["n"] == 3


def test_send_to_device_same_device_returns_the_tensor() -> None:
    t = torch.ones(2)
    assert send_to_device(t, "cpu") is t
    assert send_to_device(t, torch.device("cpu")) is t


def test_send_to_device_skip_keys() -> None:
    batch = {"x": torch.ones(1), "keep": torch.ones(1), "nested": {"keep": torch.ones(1)}}
    moved = send_to_device(batch, "meta", skip_keys="keep")
    assert moved["x"].device.type == "meta"
    assert moved["keep"] is batch["keep"]
    assert moved["nested"]["keep"] is batch["nested"]["keep"]
    moved = send_to_device(batch, "meta", skip_keys=["x", "keep"])
    assert moved["x"] is batch["x"] and moved["keep"] is batch["keep"]
    assert moved["nested"]["keep"] is batch["nested"]["keep"]


def test_send_to_device_leaves_objects_without_to() -> None:
    class NotCallableTo:
        to = "not a method"

    marker = object()
    odd = NotCallableTo()
    out = send_to_device([marker, odd, "s", 1.5], "meta")
    assert out[0] is marker and out[1] is odd and out[2:] == ["s", 1.5]


def test_send_to_device_calls_to_and_retries_without_non_blocking() -> None:
    class Blocking:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def to(self, device: Any) -> Blocking:
            self.calls.append(device)
            return self

    class Flexible:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def to(self, device: Any, non_blocking: bool = False) -> str:
            self.calls.append((device, non_blocking))
            return "moved"

    blocking, flexible = Blocking(), Flexible()
    assert send_to_device(blocking, "cpu", non_blocking=True) is blocking
    assert blocking.calls == ["cpu"]
    assert send_to_device({"f": flexible}, "cpu", non_blocking=True) == {"f": "moved"}
    assert flexible.calls == [("cpu", True)]


def test_find_batch_size() -> None:
    assert find_batch_size(torch.zeros(4, 2)) == 4
    assert find_batch_size([torch.zeros(3), torch.zeros(5)]) == 3
    assert find_batch_size({"ids": (torch.zeros(7, 1),)}) == 7


@pytest.mark.parametrize(("empty", "name"), [([], "list"), ((), "tuple"), ({}, "dict")])
def test_find_batch_size_empty_container(empty: Any, name: str) -> None:
    with pytest.raises(ValueError, match=f"empty {name}"):
        find_batch_size(empty)


def test_find_batch_size_non_tensor() -> None:
    with pytest.raises(TypeError, match="'str'"):
        find_batch_size({"text": "hello", "ids": torch.zeros(2)})


def test_ignorant_find_batch_size() -> None:
    assert ignorant_find_batch_size({"ids": torch.zeros(6)}) == 6
    assert ignorant_find_batch_size([]) is None
    assert ignorant_find_batch_size(["x"]) is None
    assert ignorant_find_batch_size(torch.tensor(1.0)) is None  # 0-d: no batch dimension


def test_listify_handles_bf16_and_nesting() -> None:
    data = {
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "pair": (torch.tensor(3), [torch.tensor([[1, 2]])]),
        "text": "kept",
    }
    out = listify(data)
    assert out == {"bf16": [1.5, -2.0], "pair": (3, [[[1, 2]]]), "text": "kept"}
    assert isinstance(out["pair"][0], int)


def test_listify_detaches() -> None:
    weight = torch.ones(2, requires_grad=True)
    assert listify(weight * 2) == [2.0, 2.0]


def test_concatenate_nested() -> None:
    first = {"x": torch.tensor([1, 2]), "pair": (torch.tensor([[1]]), [torch.tensor([0])])}
    second = {"x": torch.tensor([3]), "pair": (torch.tensor([[2]]), [torch.tensor([9])])}
    out = concatenate([first, second])
    assert out["x"].tolist() == [1, 2, 3]
    assert type(out["pair"]) is tuple
    assert out["pair"][0].tolist() == [[1], [2]]
    assert out["pair"][1][0].tolist() == [0, 9]
    named = concatenate([Point(torch.zeros(1), torch.ones(1)), Point(torch.ones(1), torch.ones(1))])
    assert type(named) is Point and named.x.tolist() == [0.0, 1.0]


def test_concatenate_along_another_dim() -> None:
    out = concatenate([torch.zeros(2, 1), torch.ones(2, 2)], dim=1)
    assert out.shape == (2, 3)


def test_concatenate_rejects_non_tensors() -> None:
    with pytest.raises(TypeError, match="'int'"):
        concatenate([[1], [2]])


def test_slice_tensors() -> None:
    data = {"a": torch.arange(6).reshape(3, 2), "b": [torch.arange(3)], "c": "kept"}
    out = slice_tensors(data, slice(1, None))
    assert out["a"].tolist() == [[2, 3], [4, 5]]
    assert out["b"][0].tolist() == [1, 2]
    assert out["c"] == "kept"
    assert slice_tensors(torch.arange(4), 2).item() == 2


def test_find_device() -> None:
    assert find_device([1, {"s": "x", "t": torch.zeros(1, device="meta")}]) == torch.device("meta")
    assert find_device({"a": torch.zeros(1)}) == torch.device("cpu")
    assert find_device(["no", ("tensors", None)]) is None
    assert find_device({}) is None


def test_data_structure_round_trip() -> None:
    data = {"ids": torch.zeros(2, 3, dtype=torch.int8), "rest": (torch.ones(4),)}
    structure = get_data_structure(data)
    assert structure["ids"] == TensorInformation(shape=torch.Size([2, 3]), dtype=torch.int8)
    assert type(structure["rest"]) is tuple
    assert structure["rest"][0] == TensorInformation(torch.Size([4]), torch.float32)
    tensors = initialize_tensors(structure)
    assert tensors["ids"].shape == (2, 3) and tensors["ids"].dtype == torch.int8
    assert tensors["rest"][0].shape == (4,) and tensors["rest"][0].dtype == torch.float32
    assert get_shape(data) == {"ids": [2, 3], "rest": ([4],)}


def test_device_mover_returns_placed_batches_untouched_and_moves_others() -> None:
    from accel_state import device_mover

    move = device_mover("cpu")
    batch = [torch.ones(2), torch.zeros(1)]
    assert move(batch) is batch  # already in place: not rebuilt
    mapping = {"x": torch.ones(1)}
    assert move(mapping) is mapping
    meta = device_mover("meta")([torch.ones(2), {"y": torch.ones(1)}, "label"])
    assert meta[0].device.type == "meta" and meta[1]["y"].device.type == "meta"
    assert meta[2] == "label"
