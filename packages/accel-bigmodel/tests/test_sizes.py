"""Sizes: dtype byte sizes, size strings, per-module sizes and the largest layer."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from accel_bigmodel.empty_init import init_empty_weights
from accel_bigmodel.sizes import (
    CustomDtype,
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    get_max_layer_size,
    get_module_size_with_ties,
)

EXPECTED_SIZES = {
    "": 236,
    "linear1": 64,
    "linear1.weight": 48,
    "linear1.bias": 16,
    "batchnorm": 72,
    "batchnorm.weight": 16,
    "batchnorm.bias": 16,
    "batchnorm.running_mean": 16,
    "batchnorm.running_var": 16,
    "batchnorm.num_batches_tracked": 8,
    "linear2": 100,
    "linear2.weight": 80,
    "linear2.bias": 20,
}


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        (torch.float32, 4),
        (torch.float16, 2),
        (torch.bfloat16, 2),
        (torch.float64, 8),
        (torch.int64, 8),
        (torch.int8, 1),
        (torch.uint8, 1),
        (torch.complex64, 8),
        (torch.bool, 1 / 8),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        (CustomDtype.FP8, 1),
        (CustomDtype.INT4, 1 / 2),
        (CustomDtype.INT2, 1 / 4),
        ("float16", 2),
        ("torch.bfloat16", 2),
    ],
)
def test_dtype_byte_size(dtype: object, size: float) -> None:
    assert dtype_byte_size(dtype) == size  # type: ignore[arg-type]


def test_dtype_byte_size_rejects_non_dtypes() -> None:
    with pytest.raises(ValueError, match="'float17' is not a torch dtype"):
        dtype_byte_size("float17")
    with pytest.raises(TypeError, match="has type int"):
        dtype_byte_size(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0MB", 0),
        ("100MB", 100 * 10**6),
        ("2GiB", 2 * 2**30),
        ("512KiB", 512 * 2**10),
        ("3MiB", 3 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("100KB", 100_000),
        ("10gb", 10 * 10**9 // 8),
        ("8Gb", 10**9),
        ("8Mb", 10**6),
        ("8Kb", 1000),
        ("2gib", 2 * 2**30),
        ("2 GB", 2 * 10**9),
        (500, 500),
        (0, 0),
    ],
)
def test_convert_file_size_to_int(text: int | str, expected: int) -> None:
    assert convert_file_size_to_int(text) == expected


@pytest.mark.parametrize(
    "text", ["5MBB", "5k0MB", "-1GB", "100", "5TB", "GB", "nanGB", "infGB", ""]
)
def test_convert_file_size_to_int_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError, match="GiB/MiB/KiB are powers of 1024") as raised:
        convert_file_size_to_int(text)
    assert repr(text) in str(raised.value)


def test_convert_file_size_to_int_rejects_bad_types() -> None:
    with pytest.raises(ValueError, match="negative"):
        convert_file_size_to_int(-1)
    with pytest.raises(TypeError, match="has type float"):
        convert_file_size_to_int(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has type bool"):
        convert_file_size_to_int(True)


def test_compute_module_sizes(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    sizes = compute_module_sizes(model)
    assert sizes == EXPECTED_SIZES
    # Missing names read as 0 (a module without tensors).
    assert sizes["no_such_module"] == 0

    model.half()
    halved = {name: size // 2 for name, size in EXPECTED_SIZES.items()}
    halved["batchnorm.num_batches_tracked"] = 8  # integers are not halved
    halved["batchnorm"] += 4
    halved[""] += 4
    assert compute_module_sizes(model) == halved


def test_compute_module_sizes_on_meta_device(model_for_test: type[nn.Module]) -> None:
    with init_empty_weights():
        model = model_for_test()
    assert compute_module_sizes(model) == EXPECTED_SIZES


def test_compute_module_sizes_key_order_follows_parameters_then_buffers(
    model_for_test: type[nn.Module],
) -> None:
    sizes = compute_module_sizes(model_for_test())
    assert list(sizes)[:4] == ["", "linear1", "linear1.weight", "linear1.bias"]
    assert list(sizes)[-3:] == [
        "batchnorm.running_mean",
        "batchnorm.running_var",
        "batchnorm.num_batches_tracked",
    ]


def test_compute_module_sizes_with_dtype(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    sizes = compute_module_sizes(model, dtype=torch.float16)
    assert sizes["linear1"] == 32
    assert sizes["batchnorm.num_batches_tracked"] == 8  # int64 keeps its size
    assert sizes[""] == 236 // 2 + 4
    # A larger dtype never grows a tensor: min(target, own).
    assert compute_module_sizes(model, dtype="float64") == EXPECTED_SIZES
    assert compute_module_sizes(model, dtype="torch.float16") == sizes
    int4 = compute_module_sizes(model, dtype=CustomDtype.INT4)
    assert int4["linear1.weight"] == 12 * 0.5


def test_compute_module_sizes_with_special_dtypes(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    sizes = compute_module_sizes(
        model, dtype=torch.float16, special_dtypes={"linear2.weight": torch.float32}
    )
    assert sizes["linear2.weight"] == 80
    assert sizes["linear2.bias"] == 10
    assert sizes["linear2"] == 90
    # Special dtypes win even over integer tensors.
    sizes = compute_module_sizes(model, special_dtypes={"batchnorm.num_batches_tracked": "int32"})
    assert sizes["batchnorm.num_batches_tracked"] == 4


def test_compute_module_sizes_bad_dtype(model_for_test: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match=r"dtype='half_float'"):
        compute_module_sizes(model_for_test(), dtype="half_float")
    with pytest.raises(ValueError, match=r"special_dtypes\['linear1.weight'\]"):
        compute_module_sizes(model_for_test(), special_dtypes={"linear1.weight": "nope"})


def test_compute_module_sizes_counts_tied_parameters_once(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    model.linear1 = nn.Linear(4, 5)
    model.linear2.weight = model.linear1.weight
    sizes = compute_module_sizes(model)
    assert sizes["linear1"] == 100
    assert "linear2.weight" not in sizes
    assert sizes["linear2"] == 20
    assert sizes[""] == 100 + 72 + 20


def test_compute_module_sizes_bool_is_fractional() -> None:
    module = nn.Module()
    module.register_buffer("mask", torch.ones(16, dtype=torch.bool))
    assert compute_module_sizes(module) == {"": 2.0, "mask": 2.0}


def test_buffers_only_and_total_buffer_size(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    model.linear1.register_buffer("test_buffer", torch.zeros(10, 10))
    model.register_buffer("test_buffer2", torch.zeros(20, 10))
    assert compute_module_total_buffer_size(model) == 1240
    buffers = compute_module_sizes(model, buffers_only=True)
    assert "linear1.weight" not in buffers
    assert buffers["linear1"] == 400
    model.half()
    assert compute_module_total_buffer_size(model) == 624
    assert compute_module_total_buffer_size(nn.Linear(2, 2)) == 0


def test_get_max_layer_size(model_for_test: type[nn.Module]) -> None:
    model = nn.Sequential(model_for_test(), model_for_test())
    sizes = compute_module_sizes(model)
    entries = list(model.named_children())
    assert get_max_layer_size(entries, sizes, []) == (100, ["0.linear2", "1.linear2"])
    assert get_max_layer_size(entries, sizes, ["ModelForTest"]) == (236, ["0", "1"])
    # Bare tensors are layers too.
    assert get_max_layer_size([("0.linear2.weight", model[0].linear2.weight)], sizes, []) == (
        80,
        ["0.linear2.weight"],
    )
    # Modules without tensors have size 0.
    assert get_max_layer_size([("act", nn.ReLU())], sizes, []) == (0, ["act"])
    assert get_max_layer_size([], sizes, []) == (0, [])


def test_calculate_maximum_sizes(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    assert calculate_maximum_sizes(model) == (236, (100, ["linear2"]))
    model._no_split_modules = ["BatchNorm1d", "Linear"]  # type: ignore[assignment]
    assert calculate_maximum_sizes(model) == (236, (100, ["linear2"]))

    seq = nn.Sequential(model_for_test(), model_for_test())
    seq._no_split_modules = ["ModelForTest"]  # type: ignore[assignment]
    assert calculate_maximum_sizes(seq) == (472, (236, ["0", "1"]))


def test_get_module_size_with_ties(model_for_test: type[nn.Module]) -> None:
    model = nn.Sequential(
        OrderedDict([("a", nn.Linear(4, 4)), ("b", nn.Linear(4, 4)), ("c", model_for_test())])
    )
    model.b.weight = model.a.weight
    sizes = compute_module_sizes(model)
    entries = list(model.named_children())[1:]
    assert get_module_size_with_ties([], 80, sizes, entries) == (80, [], [])
    total, names, holders = get_module_size_with_ties(["b.weight"], sizes["a"], sizes, entries)
    assert total == 80 + 16  # a, plus b without its (shared, already counted) weight
    assert names == ["b"]
    assert holders == [model.b]
    # A holder that is the tied parameter itself (a split module's direct parameter).
    entries = [("b.weight", model.b.weight), ("b.bias", model.b.bias)]
    assert get_module_size_with_ties(["b.weight"], 80, sizes, entries) == (
        80,
        ["b.weight"],
        [model.b.weight],
    )
    # A tied parameter with no holder among the entries adds nothing.
    assert get_module_size_with_ties(["zzz.weight"], 80, sizes, entries) == (80, [], [])
