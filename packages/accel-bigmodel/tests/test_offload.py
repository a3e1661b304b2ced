"""Tests of accel_bigmodel.offload: the folder format, the loaders, confinement and the registry."""

from __future__ import annotations

import gc
import json
import os
import struct
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel_bigmodel.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
    register_offload_index,
    registered_offload_index,
    save_offload_index,
)
from accel_bigmodel.safetensors_files import SafetensorsFile


def _golden_state() -> dict[str, torch.Tensor]:
    return {
        "f32": torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch.float32),
        "f16": torch.tensor([1.0, -0.5, 65504.0], dtype=torch.float16),
        "bf16": torch.tensor([1.0, -3.5, 0.0078125], dtype=torch.bfloat16),
        "f64": torch.tensor([3.141592653589793], dtype=torch.float64),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([-32768, 1, 32767], dtype=torch.int16),
        "i32": torch.tensor([[-1, 2], [3, -4]], dtype=torch.int32),
        "i64": torch.tensor([2**40, -7], dtype=torch.int64),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "b": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "fp8": torch.tensor([0.5, -1.0, 448.0]).to(torch.float8_e4m3fn),
        "fp8b": torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e5m2),
        "layer.0.weight": torch.tensor([[1.0, 2.0, 3.0]]),
        "empty": torch.zeros(0, 3),
    }


# What Accelerate 1.15's offload_state_dict writes for _golden_state() (observed once with its
# side venv; recorded here so these tests do not need it).
GOLDEN_INDEX_TEXT = (
    '{\n  "f32": {\n    "dtype": "float32",\n    "shape": [\n      2,\n      2\n    ]\n  },\n'
    '  "f16": {\n    "dtype": "float16",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "bf16": {\n    "dtype": "bfloat16",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "f64": {\n    "dtype": "float64",\n    "shape": [\n      1\n    ]\n  },\n'
    '  "i8": {\n    "dtype": "int8",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "i16": {\n    "dtype": "int16",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "i32": {\n    "dtype": "int32",\n    "shape": [\n      2,\n      2\n    ]\n  },\n'
    '  "i64": {\n    "dtype": "int64",\n    "shape": [\n      2\n    ]\n  },\n'
    '  "u8": {\n    "dtype": "uint8",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "b": {\n    "dtype": "bool",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "scalar": {\n    "dtype": "float32",\n    "shape": []\n  },\n'
    '  "fp8": {\n    "dtype": "float8_e4m3fn",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "fp8b": {\n    "dtype": "float8_e5m2",\n    "shape": [\n      3\n    ]\n  },\n'
    '  "layer.0.weight": {\n    "dtype": "float32",\n    "shape": [\n      1,\n      3\n    ]\n'
    "  },\n"
    '  "empty": {\n    "dtype": "float32",\n    "shape": [\n      0,\n      3\n    ]\n  }\n}'
)
GOLDEN_FILES = {
    "b.dat": "010001",
    "bf16.dat": "803f60c0003c",
    "empty.dat": "00",
    "f16.dat": "003c00b8ff7b",
    "f32.dat": "0000c03f000000c00000803e00004040",
    "f64.dat": "182d4454fb210940",
    "fp8.dat": "30b87e",
    "fp8b.dat": "38bc40",
    "i16.dat": "00800100ff7f",
    "i32.dat": "ffffffff0200000003000000fcffffff",
    "i64.dat": "0000000000010000f9ffffffffffffff",
    "i8.dat": "80007f",
    "layer.0.weight.dat": "0000803f0000004000004040",
    "scalar.dat": "00002040",
    "u8.dat": "00c8ff",
}


def _same(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.dtype != second.dtype or first.shape != second.shape:
        return False
    if first.numel() == 0:
        return True
    return bool(
        torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8))
    )


def _all_dtypes() -> dict[str, torch.Tensor]:
    tensors = dict(_golden_state())
    tensors["c64"] = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)
    tensors["bool0d"] = torch.tensor(True)
    tensors["bf16_0d"] = torch.tensor(-1.25, dtype=torch.bfloat16)
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            tensors[name] = torch.tensor([0.5, 2.0]).to(dtype)
    for name in ("uint16", "uint32", "uint64"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            tensors[name] = torch.tensor([1, 7], dtype=torch.int32).to(dtype)
    return tensors


def test_folder_matches_accelerate_byte_for_byte(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, _golden_state())
    assert (tmp_path / "index.json").read_text() == GOLDEN_INDEX_TEXT
    written = sorted(name for name in os.listdir(tmp_path) if name.endswith(".dat"))
    assert written == sorted(GOLDEN_FILES)
    for name, hex_bytes in GOLDEN_FILES.items():
        assert (tmp_path / name).read_bytes().hex() == hex_bytes, name
    assert sorted(os.listdir(tmp_path)) == sorted([*GOLDEN_FILES, "index.json"])


def test_round_trip_in_every_dtype(tmp_path: Path) -> None:
    tensors = _all_dtypes()
    offload_state_dict(tmp_path, tensors)
    index = json.loads((tmp_path / "index.json").read_text())
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    assert sorted(loader) == sorted(tensors)
    for name, tensor in tensors.items():
        assert index[name]["shape"] == list(tensor.shape)
        fresh = load_offloaded_weight(tmp_path / f"{name}.dat", index[name])
        assert _same(fresh, tensor), name
        assert _same(loader[name], tensor), name


def test_offload_weight_updates_the_index_and_accepts_no_index(tmp_path: Path) -> None:
    index: dict[str, dict[str, object]] = {}
    returned = offload_weight(torch.ones(2, 2), "w", tmp_path, index=index)
    assert returned is index
    assert index == {"w": {"dtype": "float32", "shape": [2, 2]}}
    assert offload_weight(torch.ones(1), "v", tmp_path) is None
    assert (tmp_path / "v.dat").read_bytes() == struct.pack("<f", 1.0)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_offload_weight_refuses_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="would leave the folder"):
        offload_weight(torch.ones(1), "../escape", tmp_path)
    with pytest.raises(ValueError, match="would leave the folder"):
        offload_weight(torch.ones(1), "/abs", tmp_path)
    with pytest.raises(ValueError, match="meta device"):
        offload_weight(torch.empty(2, device="meta"), "m", tmp_path)
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        offload_weight([1.0], "l", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        offload_state_dict(tmp_path / "sd", {"a": torch.ones(1), "b": 3})  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []


def test_non_contiguous_and_grad_tensors_are_written_in_c_order(tmp_path: Path) -> None:
    weight = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    offload_weight(weight.t(), "t", tmp_path, index=(index := {}))
    assert _same(
        load_offloaded_weight(tmp_path / "t.dat", index["t"]), weight.detach().t().contiguous()
    )


def test_save_offload_index_merges_and_skips_empty(tmp_path: Path) -> None:
    save_offload_index({}, tmp_path)
    save_offload_index(None, tmp_path)
    assert not (tmp_path / "index.json").exists()
    save_offload_index({"a": {"dtype": "float32", "shape": [1]}}, tmp_path)
    save_offload_index({"b": {"dtype": "int8", "shape": []}}, tmp_path)
    save_offload_index({"a": {"dtype": "float16", "shape": [1]}}, tmp_path)
    text = (tmp_path / "index.json").read_text()
    assert json.loads(text) == {
        "a": {"dtype": "float16", "shape": [1]},
        "b": {"dtype": "int8", "shape": []},
    }
    assert text == json.dumps(json.loads(text), indent=2)
    assert sorted(os.listdir(tmp_path)) == ["index.json"]
    (tmp_path / "index.json").write_text("[]")
    with pytest.raises(ValueError, match="not an object"):
        save_offload_index({"c": {"dtype": "int8", "shape": []}}, tmp_path)
    (tmp_path / "index.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        save_offload_index({"c": {"dtype": "int8", "shape": []}}, tmp_path)


def test_dat_entries_are_cached_zero_copy_and_copy_on_write(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {"w": torch.arange(4.0)})
    before = (tmp_path / "w.dat").read_bytes()
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    first, second = loader["w"], loader["w"]
    assert first.data_ptr() == second.data_ptr()  # one mapping, opened once
    first.add_(10)
    assert (tmp_path / "w.dat").read_bytes() == before
    assert torch.equal(
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [4]}),
        torch.arange(4.0),
    )


def test_state_dict_wins_and_device_moves(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {"w": torch.ones(2), "v": torch.zeros(2)})
    override = torch.full((2,), 7.0)
    loader = OffloadedWeightsLoader(
        state_dict={"w": override, "x": torch.ones(1)}, save_folder=tmp_path
    )
    assert loader["w"] is override
    assert list(loader) == ["w", "x", "v"]
    assert len(loader) == 3
    assert "v" in loader and "nope" not in loader
    with pytest.raises(KeyError):
        loader["nope"]
    on_meta = OffloadedWeightsLoader(save_folder=tmp_path, device="meta")
    assert on_meta["v"].device.type == "meta"


def test_loader_needs_something_and_a_folder_for_dat_entries(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs at least one"):
        OffloadedWeightsLoader()
    with pytest.raises(ValueError, match="save_folder is None"):
        OffloadedWeightsLoader(index={"w": {"dtype": "float32", "shape": [1]}})
    with pytest.raises(FileNotFoundError, match="index.json does not exist"):
        OffloadedWeightsLoader(save_folder=tmp_path)
    (tmp_path / "index.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        OffloadedWeightsLoader(save_folder=tmp_path)


def test_short_dat_file_is_reported(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {"w": torch.ones(4)})
    (tmp_path / "w.dat").write_bytes(bytes(8))
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    with pytest.raises(ValueError, match="has 8 bytes but its index entry needs 16"):
        loader["w"]
    with pytest.raises(ValueError, match="ends after 8 bytes"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [4]})
    with pytest.raises(ValueError, match="not a torch dtype name"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float128", "shape": [1]})
    with pytest.raises(ValueError, match="has shape"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [-1]})


def test_safetensors_entries_are_views_of_one_map(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4, dtype=torch.int64)}
    save_file(tensors, str(path))
    before = path.read_bytes()
    index = {
        "layer.a": {
            "safetensors_file": str(path),
            "weight_name": "a",
            "dtype": "float32",
            "shape": [2, 3],
        },
        "b": {"safetensors_file": str(path)},
        "half": {"safetensors_file": str(path), "weight_name": "a", "dtype": "float16"},
    }
    loader = OffloadedWeightsLoader(index=index)
    first, again, other = loader["layer.a"], loader["layer.a"], loader["b"]
    assert torch.equal(first, tensors["a"]) and torch.equal(other, tensors["b"])
    assert first.data_ptr() == again.data_ptr()
    with SafetensorsFile(path) as handle:
        distance = handle.offsets("b")[0] - handle.offsets("a")[0]
    assert other.data_ptr() - first.data_ptr() == distance  # one map of the file, shared
    assert loader["half"].dtype == torch.float16
    first.mul_(0)
    assert path.read_bytes() == before
    bad = OffloadedWeightsLoader(
        index={"x": {"safetensors_file": str(path), "weight_name": "a", "shape": [3, 2]}}
    )
    with pytest.raises(ValueError, match="index is stale"):
        bad["x"]


def _write_index(folder: Path, index: dict[str, object]) -> None:
    (folder / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param({"../outside": {"dtype": "float32", "shape": [1]}}, id="dotdot-name"),
        pytest.param({"a/../../outside": {"dtype": "float32", "shape": [1]}}, id="nested-dotdot"),
        pytest.param({"/etc/passwd": {"dtype": "float32", "shape": [1]}}, id="absolute-name"),
        pytest.param({"w": {"safetensors_file": "/etc/passwd"}}, id="absolute-file"),
        pytest.param({"w": {"safetensors_file": "../model.safetensors"}}, id="dotdot-file"),
        pytest.param({"w": {"safetensors_file": "sub/../../model.safetensors"}}, id="nested-file"),
    ],
)
def test_disk_index_entries_may_not_leave_the_folder(
    tmp_path: Path, entry: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "offload"
    folder.mkdir()
    _write_index(folder, entry)
    opened: list[object] = []
    monkeypatch.setattr(torch, "from_file", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match="outside the offload folder") as info:
        OffloadedWeightsLoader(save_folder=folder)
    message = str(info.value)
    assert repr(next(iter(entry))) in message and str(folder) in message
    assert "regenerate the folder" in message
    assert opened == []


def test_symlinked_dat_leaving_the_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.dat"
    outside.write_bytes(bytes(4))
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "w.dat").symlink_to(outside)
    _write_index(folder, {"w": {"dtype": "float32", "shape": [1]}})
    with pytest.raises(ValueError, match="entry 'w' points to 'w.dat'"):
        OffloadedWeightsLoader(save_folder=folder)
    linked = folder / "link.safetensors"
    linked.symlink_to(outside)
    _write_index(folder, {"w": {"safetensors_file": "link.safetensors"}})
    with pytest.raises(ValueError, match="outside the offload folder"):
        OffloadedWeightsLoader(save_folder=folder)


def test_relative_safetensors_file_inside_the_folder_is_served(tmp_path: Path) -> None:
    folder = tmp_path / "offload"
    (folder / "shards").mkdir(parents=True)
    save_file({"a": torch.ones(3)}, str(folder / "shards" / "s.safetensors"))
    _write_index(folder, {"x": {"safetensors_file": "shards/s.safetensors", "weight_name": "a"}})
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert torch.equal(loader["x"], torch.ones(3))


def test_disk_index_with_malformed_entries(tmp_path: Path) -> None:
    _write_index(tmp_path, {"w": [1, 2]})
    with pytest.raises(ValueError, match="entry 'w' is"):
        OffloadedWeightsLoader(save_folder=tmp_path)
    _write_index(tmp_path, {"w": {"dtype": "nope", "shape": [1]}})
    with pytest.raises(ValueError, match="not a torch dtype"):
        OffloadedWeightsLoader(save_folder=tmp_path)
    (tmp_path / "index.json").write_text("[1]")
    with pytest.raises(ValueError, match="not an object"):
        OffloadedWeightsLoader(save_folder=tmp_path)


def test_prefixed_dataset() -> None:
    data = {"block.0.weight": 1, "block.0.bias": 2, "block.1.weight": 3}
    view = PrefixedDataset(data, "block.0.")
    assert view["weight"] == 1
    assert "bias" in view and "block.0.bias" not in view and 3 not in view
    assert sorted(view) == ["bias", "weight"]
    assert len(view) == 2
    assert dict(view.items()) == {"weight": 1, "bias": 2}
    with pytest.raises(KeyError):
        view["missing"]


def test_extract_submodules_state_dict_respects_boundaries() -> None:
    state = {"h.1.w": 1, "h.10.w": 2, "h.1": 3, "h.2.w": 4}
    assert extract_submodules_state_dict(state, ["h.1"]) == {"h.1.w": 1, "h.1": 3}
    assert extract_submodules_state_dict(state, ["h.1", "h.2"]) == {
        "h.1.w": 1,
        "h.1": 3,
        "h.2.w": 4,
    }


def test_load_offloaded_weights_into_a_meta_model(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    offload_state_dict(tmp_path, source.state_dict())
    target = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to("meta")
    index = json.loads((tmp_path / "index.json").read_text())
    load_offloaded_weights(target, index, tmp_path)
    for (name, got), want in zip(
        target.state_dict().items(), source.state_dict().values(), strict=True
    ):
        assert got.device.type == "cpu" and torch.equal(got, want), name
    load_offloaded_weights(target, {}, tmp_path)
    with pytest.raises(ValueError, match="bitsandbytes"):
        load_offloaded_weights(target, {"0.SCB": {"dtype": "float32", "shape": [2]}}, tmp_path)


def test_load_offloaded_weights_from_safetensors_entries(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(path))
    target = nn.Linear(3, 2).to("meta")
    index = {
        name: {"safetensors_file": str(path), "weight_name": name} for name in ("weight", "bias")
    }
    load_offloaded_weights(target, index, tmp_path)
    assert torch.equal(target.weight, torch.ones(2, 3)) and torch.equal(target.bias, torch.zeros(2))


def test_registry_merges_copies_and_holds_models_weakly() -> None:
    model = nn.Linear(2, 2)
    assert registered_offload_index(model) is None
    register_offload_index(model, {"weight": {"safetensors_file": "/a", "weight_name": "weight"}})
    register_offload_index(model, {"bias": {"safetensors_file": "/a", "weight_name": "bias"}})
    entries = registered_offload_index(model)
    assert entries is not None and sorted(entries) == ["bias", "weight"]
    entries["weight"]["weight_name"] = "changed"
    assert registered_offload_index(model)["weight"]["weight_name"] == "weight"  # type: ignore[index]
    assert registered_offload_index(nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match="nn.Module"):
        register_offload_index("model", {})  # type: ignore[arg-type]
    reference = weakref.ref(model)
    del model, entries
    gc.collect()
    assert reference() is None
