"""Tests of accel_bigmodel.safetensors_files: header checks and the three ways to read a tensor."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from accel_bigmodel.safetensors_files import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsFile,
    safetensors_dtype_name,
)


def _sample() -> dict[str, torch.Tensor]:
    tensors = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
        "f16": torch.tensor([1.0, -0.5, 65504.0], dtype=torch.float16),
        "bf16": torch.tensor([1.0, -3.5, 0.0078125], dtype=torch.bfloat16),
        "f64": torch.tensor([3.141592653589793], dtype=torch.float64),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([-32768, 1, 32767], dtype=torch.int16),
        "i32": torch.tensor([[-1, 2], [3, -4]], dtype=torch.int32),
        "i64": torch.tensor([2**40, -7], dtype=torch.int64),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            tensors[name] = torch.tensor([0.5, -1.0, 2.0]).to(dtype)
    if hasattr(torch, "uint16"):
        tensors["u16"] = torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16)
    return tensors


def _bits(tensor: torch.Tensor) -> list[int]:
    """Raw bytes of a tensor (comparable for every dtype, fp8 included)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).tolist() if flat.numel() else []


@pytest.fixture
def sample_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = _sample()
    path = tmp_path / "sample.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "hi"})
    return path, tensors


def _write_raw(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + text + data)
    return path


def test_header_matches_safe_open(sample_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = sample_file
    with SafetensorsFile(path) as ours, safe_open(str(path), framework="pt") as theirs:
        assert ours.keys() == list(theirs.keys())
        assert ours.metadata == theirs.metadata() == {"format": "pt", "note": "hi"}
        assert len(ours) == len(tensors)
        for name in theirs.keys():
            reference = theirs.get_tensor(name)
            assert ours.dtype(name) == reference.dtype
            assert ours.shape(name) == tuple(reference.shape)
            assert ours.nbytes(name) == reference.numel() * reference.element_size()
            assert name in ours
        assert "nope" not in ours


def test_read_read_into_and_view_agree_with_safe_open(
    sample_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = sample_file
    with SafetensorsFile(path) as ours, safe_open(str(path), framework="pt") as theirs:
        for name in ours.keys():
            reference = theirs.get_tensor(name)
            read = ours.read(name)
            into = torch.empty(ours.shape(name), dtype=ours.dtype(name))
            returned = ours.read_into(name, into)
            view = ours.view(name)
            assert returned is into
            for got in (read, into, view):
                assert got.dtype == reference.dtype and got.shape == reference.shape
                assert _bits(got) == _bits(reference) == _bits(tensors[name])


def test_file_order_lists_tensors_by_offset(
    sample_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = sample_file
    with SafetensorsFile(path) as handle:
        ordered = handle.keys_in_file_order()
        assert sorted(ordered) == handle.keys()
        starts = [handle.offsets(name)[0] for name in ordered]
        assert starts == sorted(starts)


def test_views_share_one_copy_on_write_map(
    sample_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = sample_file
    before = path.read_bytes()
    handle = SafetensorsFile(path)
    first, again, other = handle.view("f32"), handle.view("f32"), handle.view("i64")
    assert first.data_ptr() == again.data_ptr()
    # Both tensors point into the same mapping, at the distance their offsets say.
    distance = handle.offsets("i64")[0] - handle.offsets("f32")[0]
    assert other.data_ptr() - first.data_ptr() == distance
    first.add_(100)
    assert torch.equal(again, tensors["f32"] + 100)  # same process-private pages
    assert path.read_bytes() == before  # the file never changes
    handle.close()
    assert handle.closed
    assert torch.equal(first, tensors["f32"] + 100)  # views outlive close()
    with SafetensorsFile(path) as fresh:
        assert torch.equal(fresh.view("f32"), tensors["f32"])


def test_read_into_checks_the_destination(
    sample_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = sample_file
    with SafetensorsFile(path) as handle:
        with pytest.raises(ValueError, match="dtype torch.float64 and shape"):
            handle.read_into("f32", torch.empty(3, 4, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"shape \(4, 3\)"):
            handle.read_into("f32", torch.empty(4, 3))
        with pytest.raises(ValueError, match="contiguous"):
            handle.read_into("f32", torch.empty(4, 3).t())
        with pytest.raises(ValueError, match="CPU tensor"):
            handle.read_into("f32", torch.empty(3, 4, device="meta"))
        with pytest.raises(KeyError, match="no tensor named 'missing'"):
            handle.read("missing")


def test_read_into_fills_a_slice_of_a_larger_buffer(
    sample_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = sample_file
    buffer = torch.full((5, 4), -1.0)
    with SafetensorsFile(path) as handle:
        handle.read_into("f32", buffer[1:4])
    assert torch.equal(buffer[1:4], tensors["f32"])
    assert torch.equal(buffer[0], torch.full((4,), -1.0))
    assert torch.equal(buffer[4], torch.full((4,), -1.0))


def test_closed_file_refuses_reads(sample_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = sample_file
    handle = SafetensorsFile(path)
    handle.close()
    with pytest.raises(ValueError, match="was closed"):
        handle.read("f32")
    with pytest.raises(ValueError, match="was closed"):
        handle.view("f32")


def test_truncated_after_opening(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.ones(1000)}, str(path))
    handle = SafetensorsFile(path)
    with open(path, "r+b") as stream:
        stream.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="ended while reading 'w'"):
        handle.read("w")
    handle.close()


def test_no_metadata_gives_none(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    with SafetensorsFile(path) as handle:
        assert handle.metadata is None


def test_dtype_codes() -> None:
    assert SAFETENSORS_DTYPES["BF16"] is torch.bfloat16
    assert SAFETENSORS_DTYPES["F8_E4M3"] is torch.float8_e4m3fn
    assert safetensors_dtype_name(torch.float32) == "F32"
    with pytest.raises(ValueError, match="cannot be stored"):
        safetensors_dtype_name(torch.quint8)


def _entry(dtype: str = "F32", shape: list[int] | None = None, offsets: Any = None) -> Any:
    return {
        "dtype": dtype,
        "shape": [2] if shape is None else shape,
        "data_offsets": [0, 8] if offsets is None else offsets,
    }


BAD_HEADERS = [
    pytest.param(b"[1, 2]", b"", "JSON list, not an object", id="json-list"),
    pytest.param(b"{not json", b"", "not valid UTF-8 JSON", id="not-json"),
    pytest.param(b"\xff\xfe{}", b"", "not valid UTF-8 JSON", id="not-utf8"),
    pytest.param(
        b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, '
        b'"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}',
        b"",
        "names 'a' twice",
        id="duplicate",
    ),
    pytest.param({"a": _entry(dtype="F4")}, bytes(8), "has dtype 'F4'", id="dtype"),
    pytest.param({"a": _entry(shape=[-2])}, bytes(8), "has shape", id="negative-shape"),
    pytest.param({"a": _entry(shape=[True])}, bytes(8), "has shape", id="bool-shape"),
    pytest.param({"a": _entry(shape="2")}, bytes(8), "has shape", id="string-shape"),
    pytest.param({"a": _entry(offsets=[0])}, bytes(8), "data_offsets", id="offsets-length"),
    pytest.param({"a": _entry(offsets=[0, 16])}, bytes(8), "outside the 8-byte", id="past-end"),
    pytest.param({"a": _entry(offsets=[4, 2])}, bytes(8), "outside", id="reversed"),
    pytest.param({"a": _entry(offsets=[0, 4])}, bytes(8), "spans 4 bytes", id="inconsistent"),
    pytest.param(
        {"a": _entry(offsets=[0, 8]), "b": _entry(offsets=[4, 12])},
        bytes(12),
        "overlap",
        id="overlap",
    ),
    pytest.param({"a": "oops"}, b"", "entry of 'a' is not an object", id="entry-type"),
    pytest.param({"a": {"dtype": "F32"}}, b"", "lacks", id="missing-fields"),
    pytest.param(
        {"__metadata__": {"format": 1}}, b"", "__metadata__ must be", id="metadata-values"
    ),
]


@pytest.mark.parametrize(("header", "data", "message"), BAD_HEADERS)
def test_bad_headers_are_refused(tmp_path: Path, header: Any, data: bytes, message: str) -> None:
    path = _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match=message) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_short_file_and_huge_header_length(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="fewer than the 8-byte"):
        SafetensorsFile(short)
    huge = _write_raw(tmp_path / "huge.safetensors", {}, length=MAX_HEADER_BYTES + 1)
    with pytest.raises(ValueError, match="more than the"):
        SafetensorsFile(huge)
    beyond = _write_raw(tmp_path / "beyond.safetensors", {}, length=1000)
    with pytest.raises(ValueError, match="only 2 bytes after it"):
        SafetensorsFile(beyond)


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        SafetensorsFile("/nonexistent/model.safetensors")


def test_hand_written_header_with_padding(tmp_path: Path) -> None:
    header = json.dumps({"w": _entry(shape=[2], offsets=[0, 8])}).encode() + b"   "
    data = struct.pack("<2f", 1.5, -2.0)
    path = _write_raw(tmp_path / "padded.safetensors", header, data)
    with SafetensorsFile(path) as handle, safe_open(str(path), framework="pt") as theirs:
        assert torch.equal(handle.read("w"), torch.tensor([1.5, -2.0]))
        assert torch.equal(handle.view("w"), theirs.get_tensor("w"))
