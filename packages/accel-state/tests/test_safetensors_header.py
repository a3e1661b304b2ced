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


_TWICE = b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {}}'
# What is wrong -> (header, data after it, what the message says).
BAD: dict[str, tuple[Any, bytes, str]] = {
    "json-list": (b"[1, 2]", b"", "JSON list, not an object"),
    "not-json": (b"{not json", b"", "not JSON (not valid UTF-8 JSON"),
    "not-utf8": (b"\xff\xfe{}", b"", "not valid UTF-8 JSON"),
    "duplicate": (_TWICE, b"", "names 'a' twice"),
    "dtype-type": ({"a": _entry(dtype=3)}, bytes(8), "has dtype 3"),
    "negative-shape": ({"a": _entry(shape=[-2])}, bytes(8), "has shape [-2]"),
    "bool-shape": ({"a": _entry(shape=[True])}, bytes(8), "has shape [True]"),
    "string-shape": ({"a": _entry(shape="2")}, bytes(8), "has shape '2'"),
    "offsets-length": ({"a": _entry(offsets=[0])}, bytes(8), "expected [begin, end]"),
    "past-end": ({"a": _entry(offsets=[0, 16])}, bytes(8), "the file is truncated"),
    "reversed": ({"a": _entry(offsets=[4, 2])}, bytes(8), "outside the 8-byte"),
    "overlap": (
        {"a": _entry(offsets=[0, 8]), "b": _entry(offsets=[4, 12])},
        bytes(12),
        "bytes of 'a' and 'b' overlap",
    ),
    "entry-type": ({"a": "oops"}, b"", "entry of 'a' is not an object"),
    "missing-fields": ({"a": {"dtype": "F32"}}, b"", "lacks ['data_offsets', 'shape']"),
    "metadata-values": ({"__metadata__": {"format": 1}}, b"", "__metadata__ must be"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_headers_name_the_file_and_the_problem(tmp_path: Path, case: str) -> None:
    header, data, message = BAD[case]
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsHeaderError) as info:
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
