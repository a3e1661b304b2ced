"""``accel estimate-memory``: sizes from safetensors headers and from meta-device models."""

from __future__ import annotations

import json
import math
import struct
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_launch.cli import main
from accel_launch.estimate import (
    ModelSizes,
    estimate_rows,
    format_bytes,
    format_estimate_table,
    load_sizes,
    sizes_from_callable,
    sizes_from_safetensors,
)

_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, list[int]]], with_data: bool = True
) -> Path:
    """A safetensors file written by hand: header length, JSON header, zeroed data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * _ITEM[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + (b"\0" * offset if with_data else b""))
    return path


MODEL = {
    "model.embed.weight": ("F16", [100, 8]),  # 800 elements
    "model.layers.0.attn.weight": ("F16", [8, 8]),
    "model.layers.0.mlp.weight": ("BF16", [8, 32]),  # layer 0: 64 + 256 elements
    "model.layers.1.attn.weight": ("F16", [8, 8]),
    "model.layers.1.mlp.weight": ("BF16", [8, 32]),
    "position_ids": ("I64", [16]),  # 128 bytes, kept at its own size
    "lm_head.weight": ("F32", [10, 8]),
}
TOTAL = (800 + 2 * (64 + 256) + 80) * 4 + 16 * 8


def test_a_file_is_measured_from_its_header_only(tmp_path: Path) -> None:
    # No tensor data at all after the header: only the header is read.
    path = write_safetensors(tmp_path / "model.safetensors", MODEL, with_data=False)
    sizes = sizes_from_safetensors(path)
    assert sizes.total == TOTAL
    assert sizes.largest_layer == 800 * 4
    assert sizes.largest_layer_names == ("model.embed",)
    assert sizes.tensors == 7
    assert sizes.stored_dtypes == {"F16": 3, "BF16": 2, "I64": 1, "F32": 1}


def test_numbered_blocks_are_one_layer(tmp_path: Path) -> None:
    model = {
        "h.0.a.weight": ("F32", [16, 16]),
        "h.0.b.weight": ("F32", [16, 16]),
        "h.1.a.weight": ("F32", [16, 16]),
        "h.1.b.weight": ("F32", [16, 16]),
        "head.weight": ("F32", [16, 20]),
        "scale": ("F32", [1]),
    }
    sizes = sizes_from_safetensors(write_safetensors(tmp_path / "m.safetensors", model))
    assert sizes.largest_layer == 2 * 256 * 4
    assert sizes.largest_layer_names == ("h.0", "h.1")


def _sharded(folder: Path) -> Path:
    folder.mkdir()
    first = {k: v for k, v in MODEL.items() if "layers.1" not in k}
    second = {k: v for k, v in MODEL.items() if "layers.1" in k}
    write_safetensors(folder / "model-00001-of-00002.safetensors", first)
    write_safetensors(folder / "model-00002-of-00002.safetensors", second)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in second}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def test_an_index_and_its_folder_give_the_whole_model(tmp_path: Path) -> None:
    index = _sharded(tmp_path / "ckpt")
    assert sizes_from_safetensors(index).total == TOTAL
    assert sizes_from_safetensors(index.parent).total == TOTAL
    (index.parent / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        sizes_from_safetensors(index)


def test_a_folder_without_index_reads_every_file(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x.weight": ("F32", [4])})
    write_safetensors(tmp_path / "b.safetensors", {"y.weight": ("F32", [6])})
    assert sizes_from_safetensors(tmp_path).total == 40


def test_unusable_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        sizes_from_safetensors(tmp_path)
    (tmp_path / "a.safetensors.index.json").write_text("{}")
    (tmp_path / "b.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="several indexes"):
        sizes_from_safetensors(tmp_path)
    with pytest.raises(ValueError, match="weight_map"):
        sizes_from_safetensors(tmp_path / "a.safetensors.index.json")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="header length field"):
        sizes_from_safetensors(garbage)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="fewer than the 8"):
        sizes_from_safetensors(short)
    not_json = tmp_path / "notjson.safetensors"
    not_json.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(ValueError, match="not JSON"):
        sizes_from_safetensors(not_json)
    with pytest.raises(FileNotFoundError, match="neither an existing path nor module:callable"):
        load_sizes(str(tmp_path / "missing.safetensors"))


@pytest.fixture
def models_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"estimate_models_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Block(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.a = torch.nn.Linear(64, 64)
                    self.b = torch.nn.Linear(64, 64)

            class Net(torch.nn.Module):
                _no_split_modules = ["Block"]

                def __init__(self):
                    super().__init__()
                    self.emb = torch.nn.Embedding(100, 64)
                    self.layers = torch.nn.ModuleList(Block() for _ in range(2))
                    self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))

            def huge():
                # 40 GB in float32: only the meta device makes this instant.
                return torch.nn.Linear(100_000, 100_000, bias=False)

            def where():
                return torch.nn.Linear(2, 2).weight.device.type

            def broken():
                raise RuntimeError("no config")

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_callable_is_built_on_the_meta_device(models_module: str) -> None:
    sizes = sizes_from_callable(f"{models_module}:Net")
    block = (64 * 64 + 64) * 2 * 4
    assert sizes.total == 100 * 64 * 4 + 2 * block + 4 * 8
    assert sizes.largest_layer == block  # a whole Block, listed in _no_split_modules
    assert sizes.largest_layer_names == ("layers.0", "layers.1")
    huge = sizes_from_callable(f"{models_module}:huge")
    assert huge.total == 100_000 * 100_000 * 4
    assert huge.stored_dtypes == {"float32": 1}


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("nope", "has no attribute 'nope'"),
        ("NOT_CALLABLE", "not callable"),
        ("broken", "RuntimeError: no config"),
        ("where", "returned a str, not a torch.nn.Module"),
    ],
)
def test_bad_callables_are_named(models_module: str, attribute: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sizes_from_callable(f"{models_module}:{attribute}")


def test_a_missing_module_is_named() -> None:
    with pytest.raises(ValueError, match="cannot import the module 'no_such_module_here'"):
        load_sizes("no_such_module_here:build")


def test_rows_follow_accelerate() -> None:
    sizes = ModelSizes(1024**3, 1024**2, ("x",), 1, {"F32": 1})
    rows = estimate_rows(sizes, ["float32", "float16", "int8", "int4"])
    assert rows == [
        ("float32", "1.0 MB", "1.0 GB", "4.0 GB"),
        ("float16", "512.0 KB", "512.0 MB", "2.0 GB"),
        ("int8", "256.0 KB", "256.0 MB", "N/A"),
        ("int4", "128.0 KB", "128.0 MB", "N/A"),
    ]
    with pytest.raises(ValueError, match="'bf16' is not one of float32, float16, int8, int4"):
        estimate_rows(sizes, ["bf16"])
    assert format_bytes(437_929_984) == "417.64 MB"
    assert format_bytes(12) == "12 bytes"


def test_table_is_boxed_with_the_title() -> None:
    table = format_estimate_table("Memory Usage for loading `m`", [("int4", "1", "2", "N/A")])
    lines = table.splitlines()
    assert lines[0].startswith("┌") and lines[-1].startswith("└")
    assert "Memory Usage for loading `m`" in lines[1]
    assert len({len(line) for line in lines}) == 1  # every line equally wide


def test_cli_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_safetensors(tmp_path / "model.safetensors", MODEL)
    assert main(["estimate-memory", str(path), "--dtypes", "float32", "int4"]) == 0
    out = capsys.readouterr().out
    assert "Training using Adam" in out and "float32" in out and "int4" in out
    assert "float16" not in out.split("└")[0]  # only the dtypes asked for
    assert "Largest layer: model.embed." in out
    assert main(["estimate-memory", str(tmp_path / "missing")]) == 2
    assert "neither an existing path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate-memory", str(path), "--dtypes", "bfloat16"])
