"""accel_state.safetensors_header: the one safetensors header parser."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accel_state.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeaderError,
    TensorEntry,
    read_safetensors_header,
)


def _write(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + text + data)
    return path


def _entry(dtype: Any = "F32", shape: Any = None, offsets: Any = None) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "shape": [2] if shape is None else shape,
        "data_offsets": [0, 8] if offsets is None else offsets,
    }


def test_a_valid_header(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "b": _entry("BF16", [2, 2], [8, 16]),
        "a": _entry(),
        "empty": _entry("I64", [0, 3], [16, 16]),
    }
    path = _write(tmp_path / "m.safetensors", header, bytes(16))
    parsed = read_safetensors_header(path)
    start = 8 + len(json.dumps(header).encode())
    assert parsed.data_start == start
    assert parsed.metadata == {"format": "pt"}
    assert list(parsed.tensors) == ["b", "a", "empty"]
    assert parsed.tensors["b"] == TensorEntry("BF16", (2, 2), start + 8, start + 16)
    assert parsed.tensors["b"].numel == 4
    assert parsed.tensors["b"].nbytes == 8
    assert parsed.tensors["empty"].numel == 0


def test_unknown_dtype_codes_are_the_callers_to_judge(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.safetensors", {"a": _entry("F4", [16], [0, 8])}, bytes(8))
    assert read_safetensors_header(path).tensors["a"].dtype == "F4"


def test_an_open_stream_is_read_and_left_open(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.safetensors", {"a": _entry()}, bytes(8))
    with open(path, "rb") as stream:
        parsed = read_safetensors_header(str(path), stream=stream)
        assert not stream.closed
    assert parsed.metadata is None
    assert list(parsed.tensors) == ["a"]


def test_without_check_data_the_data_may_be_absent(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.safetensors", {"a": _entry(offsets=[0, 8])})
    with pytest.raises(SafetensorsHeaderError, match="outside the 0-byte data area"):
        read_safetensors_header(path)
    assert read_safetensors_header(path, check_data=False).tensors["a"].nbytes == 8
    reversed_offsets = _write(tmp_path / "r.safetensors", {"a": _entry(offsets=[8, 0])})
    with pytest.raises(SafetensorsHeaderError, match="outside the data area"):
        read_safetensors_header(reversed_offsets, check_data=False)


BAD = [
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
    pytest.param({"a": _entry(dtype=3)}, bytes(8), "has dtype 3", id="dtype-type"),
    pytest.param({"a": _entry(shape=[-2])}, bytes(8), "has shape", id="negative-shape"),
    pytest.param({"a": _entry(shape=[True])}, bytes(8), "has shape", id="bool-shape"),
    pytest.param({"a": _entry(shape="2")}, bytes(8), "has shape", id="string-shape"),
    pytest.param({"a": _entry(offsets=[0])}, bytes(8), "data_offsets", id="offsets-length"),
    pytest.param({"a": _entry(offsets=[0, 16])}, bytes(8), "truncated", id="past-end"),
    pytest.param({"a": _entry(offsets=[4, 2])}, bytes(8), "outside", id="reversed"),
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


@pytest.mark.parametrize(("header", "data", "message"), BAD)
def test_bad_headers_name_the_file_and_the_problem(
    tmp_path: Path, header: Any, data: bytes, message: str
) -> None:
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsHeaderError, match=message) as info:
        read_safetensors_header(path)
    assert isinstance(info.value, ValueError)
    assert info.value.path == str(path)
    assert message in info.value.problem
    assert str(info.value).startswith(f"{path} is not a valid safetensors file: ")


def test_length_field_problems(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsHeaderError, match="2 bytes, fewer than the 8-byte"):
        read_safetensors_header(short)
    huge = _write(tmp_path / "huge.safetensors", {}, length=MAX_HEADER_BYTES + 1)
    with pytest.raises(SafetensorsHeaderError, match="header length field says .* more than"):
        read_safetensors_header(huge)
    beyond = _write(tmp_path / "beyond.safetensors", {}, length=1000)
    with pytest.raises(SafetensorsHeaderError, match="only 2 bytes after it"):
        read_safetensors_header(beyond)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_safetensors_header(tmp_path / "nope.safetensors")


def test_the_module_needs_no_torch() -> None:
    code = (
        "import importlib.util, sys\n"
        "path = sys.argv[1]\n"
        "spec = importlib.util.spec_from_file_location('header_alone', path)\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['header_alone'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    import accel_state.safetensors_header as module

    assert module.__file__ is not None
    subprocess.run([sys.executable, "-c", code, module.__file__], check=True)
