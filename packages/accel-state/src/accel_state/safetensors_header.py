"""The header of a ``.safetensors`` file, read and checked without reading any tensor.

A safetensors file is an 8-byte little-endian header length, a UTF-8 JSON header, then the
tensor data. The header maps each tensor name to ``{"dtype", "shape", "data_offsets"}`` (byte
offsets into the data area) and may hold a ``"__metadata__"`` object of strings.

:func:`read_safetensors_header` is the one parser of that header for every accel package:
accel-bigmodel's reader adds its torch dtypes on top, checkpoint loading checks a file before
reading it, and ``accel estimate-memory`` sizes a model from headers alone. A malformed header
raises :class:`SafetensorsHeaderError` naming the file and what is wrong with it.

Standard library only: no torch, no ``safetensors`` package.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "SafetensorsHeaderError",
    "TensorEntry",
    "read_safetensors_header",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest JSON header accepted (the ``safetensors`` library uses the same bound)."""


class SafetensorsHeaderError(ValueError):
    """A file is not a valid safetensors file.

    Attributes:
        path: The file.
        problem: What is wrong with it, without the file name.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"{path} is not a valid safetensors file: {problem}. Re-save it with "
            "safetensors.torch.save_file (or check that the download is complete)."
        )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header.

    Attributes:
        dtype: The safetensors dtype code (``"F32"``, ``"BF16"``, ...), as written.
        shape: The shape.
        start: Absolute offset of its first byte in the file.
        end: Absolute offset just past its last byte.
    """

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """How many bytes the tensor's data takes in the file."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """The number of elements its shape holds."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header.

    Attributes:
        data_start: Absolute offset of the data area (8 plus the header length).
        metadata: The ``__metadata__`` object, or ``None`` when the file has none.
        tensors: The tensors by name, in header order.
    """

    data_start: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the header names {key!r} twice")
        result[key] = value
    return result


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Parser:
    """Checks one header; ``data_size`` is ``None`` when the data area is not checked."""

    def __init__(self, path: str, data_start: int, data_size: int | None) -> None:
        self.path = path
        self.data_start = data_start
        self.data_size = data_size

    def bad(self, problem: str) -> SafetensorsHeaderError:
        return SafetensorsHeaderError(self.path, problem)

    def metadata(self, value: Any) -> dict[str, str] | None:
        if value is not None and not (
            isinstance(value, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            raise self.bad("__metadata__ must be an object mapping strings to strings")
        return value

    def entry(self, name: str, info: Any) -> TensorEntry:
        if not isinstance(info, dict):
            raise self.bad(f"the entry of {name!r} is not an object")
        missing = {"dtype", "shape", "data_offsets"} - set(info)
        if missing:
            raise self.bad(f"the entry of {name!r} lacks {sorted(missing)}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str):
            raise self.bad(f"{name!r} has dtype {code!r}; expected a string such as 'F32'")
        if not isinstance(shape, list) or not all(_is_count(d) and d >= 0 for d in shape):
            raise self.bad(f"{name!r} has shape {shape!r}; expected a list of integers >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
            raise self.bad(f"{name!r} has data_offsets {offsets!r}; expected [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end or (self.data_size is not None and end > self.data_size):
            area = "" if self.data_size is None else f" {self.data_size}-byte"
            raise self.bad(
                f"{name!r} has data_offsets {offsets!r} outside the{area} data area (the file "
                "is truncated or damaged)"
            )
        return TensorEntry(code, tuple(shape), self.data_start + begin, self.data_start + end)

    def check_overlaps(self, tensors: dict[str, TensorEntry]) -> None:
        ranges = sorted((e.start, e.end, n) for n, e in tensors.items() if e.end > e.start)
        for (_, first_end, first), (second_start, _, second) in zip(
            ranges, ranges[1:], strict=False
        ):
            if second_start < first_end:
                raise self.bad(f"the bytes of {first!r} and {second!r} overlap")


def _read_json(stream: IO[bytes], path: str, size: int) -> tuple[int, Any]:
    """The header length and the decoded JSON header, with its framing checked."""
    if size < 8:
        raise SafetensorsHeaderError(
            path, f"it has {size} bytes, fewer than the 8-byte header length"
        )
    stream.seek(0)
    (length,) = struct.unpack("<Q", stream.read(8))
    if length > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(
            path,
            f"the header length field says {length} bytes, more than the "
            f"{MAX_HEADER_BYTES}-byte limit",
        )
    if 8 + length > size:
        raise SafetensorsHeaderError(
            path,
            f"the header length field says {length} bytes but the file has only {size - 8} "
            "bytes after it",
        )
    raw = stream.read(length)
    if len(raw) != length:
        raise SafetensorsHeaderError(path, "the file ended while reading the header")
    try:
        return length, json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as err:
        raise SafetensorsHeaderError(
            path, f"the header is not JSON (not valid UTF-8 JSON: {err})"
        ) from None


def read_safetensors_header(
    path: str | os.PathLike[str],
    *,
    stream: IO[bytes] | None = None,
    check_data: bool = True,
) -> SafetensorsHeader:
    """Read and check the header of a safetensors file; no tensor data is read.

    Checked: the length field (at most :data:`MAX_HEADER_BYTES`, within the file), UTF-8 JSON
    without repeated names, an object; ``__metadata__`` maps strings to strings; every tensor
    has a string dtype, a shape of integers >= 0 and ``[begin, end]`` offsets; with
    ``check_data``, the offsets lie inside the data area; no two tensors' bytes overlap. The
    dtype codes themselves and the byte count of each shape are the caller's to check (they
    depend on which dtypes it supports).

    Args:
        path: The file (also the name used in error messages).
        stream: An open binary file of ``path`` to read from instead of opening it; it is
            left open, positioned after the header.
        check_data: Check that every tensor's bytes lie inside the file. Pass ``False`` to
            read a header whose data is absent or not needed.

    Returns:
        The header, with each tensor's absolute byte range.

    Raises:
        FileNotFoundError: There is no such file.
        SafetensorsHeaderError: The header is malformed (a ``ValueError``).
    """
    name = os.fspath(path)
    if stream is None:
        with open(name, "rb") as opened:
            return read_safetensors_header(name, stream=opened, check_data=check_data)
    size = os.fstat(stream.fileno()).st_size
    length, header = _read_json(stream, name, size)
    data_start = 8 + length
    parser = _Parser(name, data_start, size - data_start if check_data else None)
    if not isinstance(header, dict):
        raise parser.bad(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = parser.metadata(header.pop("__metadata__", None))
    tensors = {key: parser.entry(key, info) for key, info in header.items()}
    parser.check_overlaps(tensors)
    return SafetensorsHeader(data_start, metadata, tensors)
