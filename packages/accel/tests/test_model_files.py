"""Tests for accel.model_files: size parsing, shard planning, atomic save and load."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from accel import model_files
from accel.model_files import (
    ShardPlan,
    load_model_files,
    parse_size,
    save_model_files,
    split_state_dict_into_shards,
)


def _bytes(n: int, fill: int = 0) -> torch.Tensor:
    """A uint8 tensor of exactly ``n`` bytes."""
    return torch.full((n,), fill, dtype=torch.uint8)


def _state_dict() -> dict[str, torch.Tensor]:
    """Six float32 tensors of 40, 40, 40, 80, 16 and 4 bytes with distinct values."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"w1": (10,), "w2": (2, 5), "w3": (10,), "big": (4, 5), "b": (4,), "s": (1,)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


# _state_dict() with a 100-byte limit: [w1 w2] [w3] [big b s].
_THREE_SHARDS = 100


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# ---------------------------------------------------------------------------------------------
# parse_size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("10GB", 10 * 10**9),
        ("5MB", 5 * 10**6),
        ("500KB", 500 * 10**3),
        ("2TB", 2 * 10**12),
        ("1GiB", 2**30),
        ("3MiB", 3 * 2**20),
        ("4KiB", 4 * 2**10),
        ("1TiB", 2**40),
        ("10gb", 10 * 10**9),
        ("1gib", 2**30),
        ("5Mb", 5 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("4.35MB", 4_350_000),
        ("0.5KiB", 512),
        (" 7 MB ", 7 * 10**6),
        ("0GB", 0),
        (123, 123),
        (0, 0),
    ],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize(
    "size",
    ["10", "GB", "ten GB", "10XB", "10 G", "-1GB", "nanGB", "infGB", "", "1.2.3MB", -5, True],
)
def test_parse_size_rejects_bad_values(size: Any) -> None:
    with pytest.raises(ValueError, match="max_shard_size") as info:
        parse_size(size)
    assert "10GB" in str(info.value) and "GiB" in str(info.value)


def test_parse_size_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="max_shard_size"):
        parse_size(1.5e9)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# split_state_dict_into_shards
# ---------------------------------------------------------------------------------------------


def test_split_golden_fills_shards_in_order() -> None:
    sd = {"a": _bytes(10), "b": _bytes(10), "c": _bytes(10), "d": _bytes(12)}
    plan = split_state_dict_into_shards(sd, max_shard_size=24)
    assert plan.filename_to_tensors == {
        "model-00001-of-00002.safetensors": ["a", "b"],
        "model-00002-of-00002.safetensors": ["c", "d"],
    }
    assert plan.tensor_to_filename == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
        "d": "model-00002-of-00002.safetensors",
    }
    assert plan.metadata == {"total_size": 42}
    assert plan.is_sharded is True


def test_split_golden_oversize_tensor_is_placed_before_the_open_shard() -> None:
    # huggingface_hub's order: the oversize tensor's shard is appended as soon as it is seen,
    # before the shard still being filled (here [c]).
    sd = {"a": _bytes(10), "b": _bytes(10), "c": _bytes(10), "d": _bytes(25)}
    plan = split_state_dict_into_shards(sd, max_shard_size=24)
    assert plan.filename_to_tensors == {
        "model-00001-of-00003.safetensors": ["a", "b"],
        "model-00002-of-00003.safetensors": ["d"],
        "model-00003-of-00003.safetensors": ["c"],
    }
    assert plan.metadata == {"total_size": 55}


def test_split_oversize_tensor_gets_its_own_shard() -> None:
    sd = {"a": _bytes(10), "big": _bytes(30), "b": _bytes(10)}
    plan = split_state_dict_into_shards(sd, max_shard_size=24)
    assert plan.filename_to_tensors == {
        "model-00001-of-00002.safetensors": ["big"],
        "model-00002-of-00002.safetensors": ["a", "b"],
    }
    assert plan.metadata == {"total_size": 50}


def test_split_exact_fit_stays_in_one_shard() -> None:
    sd = {"a": _bytes(12), "b": _bytes(12)}
    plan = split_state_dict_into_shards(sd, max_shard_size=24)
    assert plan.filename_to_tensors == {"model.safetensors": ["a", "b"]}
    assert plan.is_sharded is False


def test_split_sizes_use_element_size_and_string_limits() -> None:
    sd = {
        "f32": torch.zeros(100),  # 400 bytes
        "f16": torch.zeros(200, dtype=torch.float16),  # 400 bytes
        "i64": torch.zeros(50, dtype=torch.int64),  # 400 bytes
    }
    plan = split_state_dict_into_shards(sd, max_shard_size="1KB")
    assert list(plan.filename_to_tensors.values()) == [["f32", "f16"], ["i64"]]
    assert plan.metadata == {"total_size": 1200}


def test_split_view_counts_its_own_bytes() -> None:
    base = torch.zeros(100)
    plan = split_state_dict_into_shards({"view": base[:10]}, max_shard_size=40)
    assert plan.metadata == {"total_size": 40}
    assert plan.filename_to_tensors == {"model.safetensors": ["view"]}


def test_split_tied_tensors_counted_once_and_kept_together() -> None:
    shared = _bytes(10, 1)
    sd = {"a": shared, "x": _bytes(10), "tied": shared, "y": _bytes(10), "a_view": shared[:5]}
    plan = split_state_dict_into_shards(sd, max_shard_size=24)
    assert plan.filename_to_tensors == {
        "model-00001-of-00002.safetensors": ["a", "x", "tied", "a_view"],
        "model-00002-of-00002.safetensors": ["y"],
    }
    assert plan.metadata == {"total_size": 30}
    assert plan.tensor_to_filename["tied"] == plan.tensor_to_filename["a"]


def test_split_single_shard_lists_state_dict_order_with_tied() -> None:
    shared = _bytes(4)
    sd = {"a": shared, "b": _bytes(4), "a2": shared, "c": _bytes(4)}
    plan = split_state_dict_into_shards(sd, max_shard_size="1MB")
    assert plan.filename_to_tensors == {"model.safetensors": ["a", "b", "a2", "c"]}
    assert plan.metadata == {"total_size": 12}


def test_split_single_shard_naming_with_custom_pattern() -> None:
    plan = split_state_dict_into_shards(
        {"a": _bytes(3)}, filename_pattern="pytorch_model{suffix}.bin"
    )
    assert plan.filename_to_tensors == {"pytorch_model.bin": ["a"]}
    assert plan.tensor_to_filename == {"a": "pytorch_model.bin"}
    assert plan.is_sharded is False


def test_split_single_oversize_tensor_is_one_unsharded_file() -> None:
    plan = split_state_dict_into_shards({"a": _bytes(100)}, max_shard_size=10)
    assert plan.filename_to_tensors == {"model.safetensors": ["a"]}
    assert plan.is_sharded is False


def test_split_skips_non_tensors_and_handles_empty() -> None:
    plan = split_state_dict_into_shards({"a": _bytes(3), "note": "bnb", "n": 3})
    assert plan.filename_to_tensors == {"model.safetensors": ["a"]}
    assert plan.metadata == {"total_size": 3}
    empty = split_state_dict_into_shards({})
    assert empty.filename_to_tensors == {"model.safetensors": []}
    assert empty.metadata == {"total_size": 0}
    assert empty.is_sharded is False


def test_split_meta_tensors_are_planned_by_size() -> None:
    sd = {"a": torch.empty(10, dtype=torch.uint8, device="meta"), "b": _bytes(10)}
    plan = split_state_dict_into_shards(sd, max_shard_size=15)
    assert list(plan.filename_to_tensors.values()) == [["a"], ["b"]]


def test_split_validates_arguments() -> None:
    with pytest.raises(ValueError, match="filename_pattern"):
        split_state_dict_into_shards({"a": _bytes(1)}, filename_pattern="model.safetensors")
    with pytest.raises(ValueError, match="max_shard_size"):
        split_state_dict_into_shards({"a": _bytes(1)}, max_shard_size="lots")


def test_shard_plan_is_frozen() -> None:
    plan = split_state_dict_into_shards({"a": _bytes(1)})
    assert isinstance(plan, ShardPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.is_sharded = True  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# save_model_files / load_model_files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("safe", "single", "index"),
    [
        (True, "model.safetensors", "model.safetensors.index.json"),
        (False, "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ],
)
def test_round_trip_single_file(tmp_path: Path, safe: bool, single: str, index: str) -> None:
    sd = _state_dict()
    written = save_model_files(sd, tmp_path / "out", safe_serialization=safe)
    assert written == [single]
    assert sorted(os.listdir(tmp_path / "out")) == [single]
    _assert_same(load_model_files(tmp_path / "out"), sd)


@pytest.mark.parametrize(
    ("safe", "ext", "index"),
    [
        (True, ".safetensors", "model.safetensors.index.json"),
        (False, ".bin", "pytorch_model.bin.index.json"),
    ],
)
def test_round_trip_sharded(tmp_path: Path, safe: bool, ext: str, index: str) -> None:
    sd = _state_dict()
    prefix = "model" if safe else "pytorch_model"
    # 40 | 40 | 40 + 16 + 4, and big (80 > 70) alone, placed before the open [w3 b s] shard.
    written = save_model_files(sd, tmp_path, max_shard_size=70, safe_serialization=safe)
    shards = [f"{prefix}-0000{i}-of-00004{ext}" for i in (1, 2, 3, 4)]
    assert written == [*shards, index]
    assert sorted(os.listdir(tmp_path)) == sorted(written)
    index_data = json.loads((tmp_path / index).read_text())
    assert index_data["metadata"] == {"total_size": 220}
    assert index_data["weight_map"] == {
        "w1": shards[0],
        "w2": shards[1],
        "big": shards[2],
        "w3": shards[3],
        "b": shards[3],
        "s": shards[3],
    }
    _assert_same(load_model_files(tmp_path), sd)


def test_each_safetensors_shard_is_readable_by_plain_safetensors(tmp_path: Path) -> None:
    sd = _state_dict()
    written = save_model_files(sd, tmp_path, max_shard_size=_THREE_SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    seen: dict[str, torch.Tensor] = {}
    for filename in written[:-1]:
        shard = load_file(tmp_path / filename)
        assert sorted(shard) == sorted(k for k, f in index["weight_map"].items() if f == filename)
        with safe_open(tmp_path / filename, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        seen.update(shard)
    _assert_same(seen, sd)
    assert index["metadata"] == {"total_size": 220}


def test_index_json_exact_bytes(tmp_path: Path) -> None:
    save_model_files({"b": _bytes(10, 1), "a": _bytes(10, 2)}, tmp_path, max_shard_size=10)
    expected = (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 20\n'
        "  },\n"
        '  "weight_map": {\n'
        '    "a": "model-00002-of-00002.safetensors",\n'
        '    "b": "model-00001-of-00002.safetensors"\n'
        "  }\n"
        "}\n"
    )
    assert (tmp_path / "model.safetensors.index.json").read_bytes() == expected.encode()


def test_index_json_exact_bytes_torch(tmp_path: Path) -> None:
    save_model_files(
        {"b": _bytes(10, 1), "a": _bytes(10, 2)},
        tmp_path,
        max_shard_size=10,
        safe_serialization=False,
    )
    text = (tmp_path / "pytorch_model.bin.index.json").read_bytes().decode()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert '"a": "pytorch_model-00002-of-00002.bin"' in text
    assert text.index('"a"') < text.index('"b"')


def test_stale_shards_removed_unrelated_files_kept(tmp_path: Path) -> None:
    sd = _state_dict()
    save_model_files(sd, tmp_path, max_shard_size=_THREE_SHARDS)
    unrelated = [
        "README.md",
        "optimizer.bin",
        "pytorch_model-00001-of-00002.bin",  # other format: not ours to delete
        "model-1-of-2.safetensors",  # not the shard naming scheme
        "model-00001-of-00003.safetensors.bak",
        "mymodel-00001-of-00003.safetensors",
    ]
    for name in unrelated:
        (tmp_path / name).write_text("keep me")

    # A smaller sharded save: every -of-00003 shard is stale.
    written = save_model_files(sd, tmp_path, max_shard_size=130)
    assert written == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert sorted(os.listdir(tmp_path)) == sorted([*unrelated, *written])
    _assert_same(load_model_files(tmp_path), sd)

    # An unsharded save: the shards and the index go.
    assert save_model_files(sd, tmp_path) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == sorted([*unrelated, "model.safetensors"])
    for name in unrelated:
        assert (tmp_path / name).read_text() == "keep me"
    _assert_same(load_model_files(tmp_path), sd)


def test_sharded_save_removes_stale_single_file(tmp_path: Path) -> None:
    old = {"w": torch.zeros(3)}
    save_model_files(old, tmp_path)
    sd = _state_dict()
    written = save_model_files(sd, tmp_path, max_shard_size=_THREE_SHARDS)
    assert sorted(os.listdir(tmp_path)) == sorted(written)
    assert "model.safetensors" not in written
    _assert_same(load_model_files(tmp_path), sd)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4, bias=False)
        self.hidden = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4, bias=False)
        self.decoder.weight = self.encoder.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.hidden(self.encoder(x)))


@pytest.mark.parametrize("max_shard_size", ["10GB", 70])
def test_tied_weights_safetensors_saved_once_and_retied(
    tmp_path: Path, max_shard_size: int | str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = _Tied()
    with caplog.at_level("WARNING"):
        written = save_model_files(model.state_dict(), tmp_path, max_shard_size=max_shard_size)
    assert "decoder.weight" in caplog.text  # logged, as Accelerate does
    stored: set[str] = set()
    for filename in written:
        if filename.endswith(".safetensors"):
            stored.update(load_file(tmp_path / filename))
    assert stored == {"encoder.weight", "hidden.weight", "hidden.bias"}

    torch.manual_seed(1)
    fresh = _Tied()
    fresh.decoder.weight = nn.Parameter(torch.zeros(4, 4))  # untie, as a loader would see it
    result = fresh.load_state_dict(load_model_files(tmp_path), strict=False)
    assert result.missing_keys == ["decoder.weight"]
    assert result.unexpected_keys == []
    fresh.decoder.weight = fresh.encoder.weight  # re-tie
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


def test_tied_weights_torch_format_stay_shared(tmp_path: Path) -> None:
    model = _Tied()
    written = save_model_files(
        model.state_dict(), tmp_path, max_shard_size=80, safe_serialization=False
    )
    assert written == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert index["weight_map"] == {
        "encoder.weight": written[0],
        "decoder.weight": written[0],
        "hidden.weight": written[1],
        "hidden.bias": written[1],
    }
    assert index["metadata"] == {"total_size": 64 + 64 + 16}
    loaded = load_model_files(tmp_path)
    assert loaded["decoder.weight"].data_ptr() == loaded["encoder.weight"].data_ptr()
    fresh = _Tied()
    fresh.load_state_dict(loaded)
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


def test_meta_tensors_are_rejected(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"weight.*meta|meta.*weight") as info:
        save_model_files(model.state_dict(), tmp_path / "out")
    assert "bias" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_save_directory_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_text("not a directory")
    with pytest.raises(ValueError, match="save_directory") as info:
        save_model_files(_state_dict(), target)
    assert str(target) in str(info.value)
    assert target.read_text() == "not a directory"


def test_non_main_process_writes_nothing(tmp_path: Path) -> None:
    assert save_model_files(_state_dict(), tmp_path / "out", is_main_process=False) == []
    assert not (tmp_path / "out").exists()
    save_model_files(_state_dict(), tmp_path, max_shard_size=_THREE_SHARDS)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert save_model_files({"w": torch.ones(2)}, tmp_path, is_main_process=False) == []
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_non_main_process_still_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="meta"):
        save_model_files(
            {"w": torch.empty(2, device="meta")}, tmp_path / "out", is_main_process=False
        )
    with pytest.raises(ValueError, match="max_shard_size"):
        save_model_files({"w": torch.ones(2)}, tmp_path, "big", is_main_process=False)


def test_non_tensor_entries_are_skipped_with_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="_extra_state"):
        save_model_files({"w": torch.ones(2), "_extra_state": {"k": 1}}, tmp_path)
    assert list(load_model_files(tmp_path)) == ["w"]


def test_empty_state_dict_round_trips(tmp_path: Path) -> None:
    assert save_model_files({}, tmp_path) == ["model.safetensors"]
    assert load_model_files(tmp_path) == {}


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_written_files_get_default_permissions(tmp_path: Path) -> None:
    save_model_files(_state_dict(), tmp_path, max_shard_size=_THREE_SHARDS)
    reference = tmp_path / "reference.txt"
    reference.write_text("x")
    expected = reference.stat().st_mode & 0o777
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o777 == expected, path.name


def test_missing_safetensors_gives_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install "accel-state\[safetensors\]"'):
        save_model_files(_state_dict(), tmp_path)
    assert os.listdir(tmp_path) == []
    assert save_model_files(_state_dict(), tmp_path, safe_serialization=False) == [
        "pytorch_model.bin"
    ]


# ---------------------------------------------------------------------------------------------
# Atomicity
# ---------------------------------------------------------------------------------------------


def test_failed_rename_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(src: Any, dst: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        save_model_files(_state_dict(), tmp_path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_previous_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    old = {"w": torch.arange(4.0)}
    save_model_files(old, tmp_path)

    def partial_then_fail(tensors: Any, filename: Any, metadata: Any = None) -> None:
        with open(filename, "wb") as stream:
            stream.write(b"\x00" * 7)
        raise RuntimeError("crashed mid-write")

    monkeypatch.setattr(safetensors.torch, "save_file", partial_then_fail)
    with pytest.raises(RuntimeError, match="crashed mid-write"):
        save_model_files({"w": torch.zeros(4)}, tmp_path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    _assert_same(load_model_files(tmp_path), old)


def test_failure_on_second_shard_leaves_no_partial_or_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save
    calls: list[str] = []

    def flaky_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(str(f))
        if len(calls) == 2:
            with open(f, "wb") as stream:
                stream.write(b"partial")
            raise OSError("no space left")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(OSError, match="no space left"):
        save_model_files(
            _state_dict(), tmp_path, max_shard_size=_THREE_SHARDS, safe_serialization=False
        )
    monkeypatch.undo()
    assert all(Path(c).parent == tmp_path and Path(c).name.endswith(".tmp") for c in calls)
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model-00001-of-00003.bin"]
    assert _temp_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# load_model_files errors and preferences
# ---------------------------------------------------------------------------------------------


def test_load_missing_shard_names_it_before_reading_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    save_model_files(_state_dict(), tmp_path, max_shard_size=_THREE_SHARDS)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    reads: list[Any] = []
    real_load = safetensors.torch.load_file

    def spy(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", spy)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load_model_files(tmp_path)
    assert reads == []


def test_load_missing_bin_shard(tmp_path: Path) -> None:
    save_model_files(
        _state_dict(), tmp_path, max_shard_size=_THREE_SHARDS, safe_serialization=False
    )
    (tmp_path / "pytorch_model-00003-of-00003.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00003-of-00003.bin"):
        load_model_files(tmp_path)


def test_load_without_weights_or_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model_files(tmp_path / "nowhere")


def test_load_corrupt_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model_files(tmp_path)


def test_load_corrupt_or_escaping_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_files(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_model_files(tmp_path)
    index.write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(ValueError, match="outside"):
        load_model_files(tmp_path)


def test_load_shard_lacking_an_indexed_tensor(tmp_path: Path) -> None:
    save_model_files(_state_dict(), tmp_path, max_shard_size=_THREE_SHARDS)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="ghost"):
        load_model_files(tmp_path)


def test_load_refuses_pickles_that_are_not_weights(tmp_path: Path) -> None:
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="mapping of names to tensors"):
        load_model_files(tmp_path)

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("pwned",))

    torch.save({"w": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_model_files(tmp_path)


def test_load_prefers_safetensors_over_bin(tmp_path: Path) -> None:
    save_model_files({"w": torch.zeros(2)}, tmp_path, safe_serialization=False)
    save_model_files({"w": torch.ones(2)}, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "pytorch_model.bin"]
    _assert_same(load_model_files(tmp_path), {"w": torch.ones(2)})


def test_public_names() -> None:
    assert set(model_files.__all__) >= {
        "ShardPlan",
        "load_model_files",
        "parse_size",
        "save_model_files",
        "split_state_dict_into_shards",
    }
    assert model_files.SAFE_WEIGHTS_INDEX_NAME == "model.safetensors.index.json"
    assert model_files.WEIGHTS_INDEX_NAME == "pytorch_model.bin.index.json"


class _Terminal:
    """A stderr that says it is a terminal and keeps what was written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_saving_shows_a_progress_bar_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR", raising=False)
    written = save_model_files(state, tmp_path / "a", max_shard_size=300)
    assert len(written) == 5  # four shards and the index
    assert "Saving model shards" in terminal.text and "/4 " in terminal.text
    terminal.text = ""
    monkeypatch.setenv("ACCEL_DISABLE_PROGRESS_BAR", "1")
    save_model_files(state, tmp_path / "b", max_shard_size=300)
    assert terminal.text == ""
    # a log file or CI output is not a terminal: nothing goes there
    monkeypatch.delenv("ACCEL_DISABLE_PROGRESS_BAR")
    monkeypatch.setattr(terminal, "isatty", lambda: False)
    save_model_files(state, tmp_path / "c", max_shard_size=300)
    assert terminal.text == ""
    assert load_file(str(tmp_path / "c" / written[0])).keys() == {"w0"}
