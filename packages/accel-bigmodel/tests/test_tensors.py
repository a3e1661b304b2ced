"""A module's own tensors: set_module_tensor_to_device, tied parameters, device parsing."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from accel_bigmodel.tensors import (
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    clear_device_cache,
    find_tied_parameters,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
    parse_device,
    retie_parameters,
    set_module_tensor_to_device,
)


class TaggedParameter(nn.Parameter):
    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        return super().__new__(cls, data, requires_grad)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.tensor(5))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.blocks = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.blocks[1].weight = self.blocks[0].weight


# -- set_module_tensor_to_device ---------------------------------------------------------


def test_shape_mismatch_names_both_shapes_and_changes_nothing() -> None:
    model = Model()
    before = model.linear.weight
    with pytest.raises(ValueError) as info:
        set_module_tensor_to_device(model, "linear.weight", "cpu", value=torch.zeros(4, 4))
    # Accelerate's text verbatim (its suite compares it); the full name is in the note.
    assert str(info.value) == (
        'Trying to set a tensor of shape torch.Size([4, 4]) in "weight" (which has shape '
        "torch.Size([4, 3])), this looks incorrect."
    )
    assert info.value.__notes__ == [
        "'linear.weight' has shape (4, 3); the value given has shape (4, 4). Nothing was changed."
    ]
    assert model.linear.weight is before
    meta = Model().to("meta")
    with pytest.raises(ValueError, match=r"\(2,\)"):
        set_module_tensor_to_device(meta, "linear.bias", "cpu", value=torch.zeros(2))
    assert meta.linear.bias.device.type == "meta"


def test_meta_tensor_without_value_is_refused() -> None:
    model = Model().to("meta")
    with pytest.raises(ValueError, match="'linear.weight' is on the meta device.*value="):
        set_module_tensor_to_device(model, "linear.weight", "cpu")
    set_module_tensor_to_device(model, "linear.weight", "meta")  # meta -> meta is fine


def test_value_keeps_the_model_dtype_unless_told() -> None:
    model = Model()
    set_module_tensor_to_device(model, "linear.weight", "cpu", value=torch.ones(4, 3).half())
    assert model.linear.weight.dtype == torch.float32
    set_module_tensor_to_device(
        model, "linear.weight", "cpu", value=torch.ones(4, 3), dtype=torch.bfloat16
    )
    assert model.linear.weight.dtype == torch.bfloat16
    set_module_tensor_to_device(model, "linear.bias", "cpu", value=torch.ones(4), dtype="float16")
    assert model.linear.bias.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype='float17'"):
        set_module_tensor_to_device(
            model, "linear.bias", "cpu", value=torch.ones(4), dtype="float17"
        )


def test_integer_values_are_never_cast() -> None:
    model = Model()
    set_module_tensor_to_device(model, "steps", "cpu", value=torch.tensor(9, dtype=torch.int32))
    assert model.steps.dtype == torch.int32 and int(model.steps) == 9
    set_module_tensor_to_device(
        model, "norm.num_batches_tracked", "cpu", value=torch.tensor(3), dtype=torch.float16
    )
    assert model.norm.num_batches_tracked.dtype == torch.int64


def test_meta_with_dtype() -> None:
    model = Model()
    set_module_tensor_to_device(model, "linear.weight", "meta", dtype=torch.float16)
    assert model.linear.weight.device.type == "meta"
    assert model.linear.weight.dtype == torch.float16


def test_same_device_same_dtype_value_is_not_copied() -> None:
    model = Model()
    value = torch.randn(4, 3)
    set_module_tensor_to_device(model, "linear.weight", "cpu", value=value)
    assert model.linear.weight.data_ptr() == value.data_ptr()
    assert isinstance(model.linear.weight, nn.Parameter)
    buffer = torch.randn(4)
    set_module_tensor_to_device(model, "norm.running_mean", "cpu", value=buffer)
    assert model.norm.running_mean is buffer


def test_parameter_class_attributes_and_requires_grad_are_kept() -> None:
    model = Model()
    tagged = TaggedParameter(torch.zeros(4), requires_grad=False)
    tagged.scale = 0.5  # type: ignore[attr-defined]
    model.linear.bias = tagged
    set_module_tensor_to_device(model, "linear.bias", "meta")
    set_module_tensor_to_device(model, "linear.bias", "cpu", value=torch.ones(4))
    bias = model.linear.bias
    assert type(bias) is TaggedParameter
    assert bias.scale == 0.5  # type: ignore[attr-defined]
    assert not bias.requires_grad
    assert torch.equal(bias, torch.ones(4))


def test_tied_params_map_reuses_a_copy_already_on_the_device() -> None:
    model = TiedModel()
    source = model.embed.weight.detach().clone()
    tied: dict[int, dict[Any, torch.Tensor]] = {source.data_ptr(): {}}
    model.to("meta")
    set_module_tensor_to_device(model, "embed.weight", "cpu", value=source, tied_params_map=tied)
    assert tied[source.data_ptr()][torch.device("cpu")] is model.embed.weight
    other = source.clone()  # would be a second copy without the map
    tied[other.data_ptr()] = tied[source.data_ptr()]
    set_module_tensor_to_device(model, "head.weight", "cpu", value=other, tied_params_map=tied)
    assert model.head.weight is model.embed.weight


def test_unknown_names_and_bad_arguments() -> None:
    model = Model()
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        set_module_tensor_to_device(model, "nope.weight", "cpu")
    with pytest.raises(ValueError, match="Linear has no parameter or buffer named 'kernel'"):
        set_module_tensor_to_device(model, "linear.kernel", "cpu")
    with pytest.raises(ValueError, match="device='disk'"):
        set_module_tensor_to_device(model, "linear.weight", "disk")
    with pytest.raises(ValueError, match="fp16_statistics"):
        set_module_tensor_to_device(
            model, "linear.weight", "cpu", value=torch.ones(4, 3), fp16_statistics=torch.ones(1)
        )
    with pytest.raises(ValueError, match="device='gpu' is not a device"):
        set_module_tensor_to_device(model, "linear.weight", "gpu")


def test_none_parameter_is_refused() -> None:
    model = nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match="registered as None"):
        set_module_tensor_to_device(model, "bias", "cpu", value=torch.ones(2))


# -- named tensors -----------------------------------------------------------------------


def test_named_module_tensors() -> None:
    model = Model()
    assert [n for n, _ in named_module_tensors(model)] == ["steps", "cache"]
    assert [n for n, _ in named_module_tensors(model, remove_non_persistent=True)] == ["steps"]
    assert [n for n, _ in named_module_tensors(model, include_buffers=False)] == []
    names = [n for n, _ in named_module_tensors(model, recurse=True, remove_non_persistent=True)]
    assert names == [
        "linear.weight",
        "linear.bias",
        "norm.weight",
        "norm.bias",
        "steps",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    ]


def test_get_non_persistent_buffers() -> None:
    model = nn.Sequential(Model())
    assert get_non_persistent_buffers(model) == set()
    assert get_non_persistent_buffers(model, recurse=True) == {"cache"}
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"0.cache"}


def test_id_tensor_storage() -> None:
    base = torch.zeros(10)
    assert id_tensor_storage(base[:5]) == id_tensor_storage(base[5:])
    assert id_tensor_storage(base) != id_tensor_storage(base.clone())
    first, second = torch.zeros(2, device="meta"), torch.zeros(2, device="meta")
    assert id_tensor_storage(first) != id_tensor_storage(second)


# -- tied parameters ---------------------------------------------------------------------


def test_find_tied_parameters() -> None:
    assert find_tied_parameters(TiedModel()) == [
        ["embed.weight", "head.weight"],
        ["blocks.0.weight", "blocks.1.weight"],
    ]
    assert find_tied_parameters(Model()) == []


def test_retie_parameters_points_at_the_first_loaded_copy() -> None:
    model = TiedModel()
    tied = find_tied_parameters(model)
    model.head.weight = nn.Parameter(torch.zeros(5, 3, device="meta"))
    model.blocks[1].weight = nn.Parameter(model.blocks[0].weight.detach().clone())
    retie_parameters(model, tied)
    assert model.head.weight is model.embed.weight
    assert model.blocks[1].weight is model.blocks[0].weight
    meta = TiedModel().to("meta")
    meta.head.weight = nn.Parameter(torch.zeros(5, 3, device="meta"))
    retie_parameters(meta, tied)  # every member on meta: the first name's parameter wins
    assert meta.head.weight is meta.embed.weight


def test_check_tied_parameters_on_same_device(caplog: pytest.LogCaptureFixture) -> None:
    tied = [["embed.weight", "head.weight"]]
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.tensors"):
        check_tied_parameters_on_same_device(tied, {"embed": "cpu", "head": "cpu"})
        assert not caplog.text
        check_tied_parameters_on_same_device(tied, {"embed": "cpu", "": "disk"})
    assert "Tied parameters are on different devices" in caplog.text
    with pytest.raises(ValueError, match="does not place 'head.weight'"):
        check_tied_parameters_on_same_device(tied, {"embed": "cpu"})


def test_check_tied_parameters_in_config_plain_model() -> None:
    assert check_tied_parameters_in_config(TiedModel()) is False


# -- devices -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cpu", torch.device("cpu")),
        ("cuda:1", torch.device("cuda", 1)),
        ("cuda", torch.device("cuda")),
        ("mps", torch.device("mps")),
        ("xpu:0", torch.device("xpu", 0)),
        ("meta", torch.device("meta")),
        ("disk", "disk"),
        (torch.device("cpu"), torch.device("cpu")),
        (0, torch.device("cuda", 0)),
    ],
)
def test_parse_device_accepts(value: Any, expected: Any) -> None:
    if isinstance(value, int) and not torch.cuda.is_available():
        assert parse_device(value).index == 0
        return
    assert parse_device(value) == expected


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:-1", "", -1, True, 1.5, None, "CPU"])
def test_parse_device_rejects_with_the_accepted_forms(value: Any) -> None:
    with pytest.raises(ValueError, match=r"device_map\['lm_head'\]=.*'cpu', 'disk'"):
        parse_device(value, "device_map['lm_head']")


class _Cycle:
    """Kept alive by a reference to itself: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_clear_device_cache_runs_without_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("cuda"))
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the two calls
    try:
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        del cycle
        assert clear_device_cache() is None
        assert alive() is not None  # no garbage collection unless asked for
        clear_device_cache(garbage_collection=True)
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()
    # CUDA's cache is emptied only once CUDA is in use; a CPU-only machine touches nothing.
    assert emptied == (["cuda", "cuda"] if cuda_in_use else [])
