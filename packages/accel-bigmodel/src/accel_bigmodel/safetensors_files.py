"""Reading ``.safetensors`` files tensor by tensor, by header offsets, without a second copy.

:class:`SafetensorsFile` owns everything accel-bigmodel does with a safetensors file: it
validates the header (length, JSON, shapes and byte ranges through
:mod:`accel_state.safetensors_header`, then the dtypes this torch can hold) before any tensor is
read, then serves each tensor in one of three ways:

- :meth:`SafetensorsFile.read_into` reads a tensor's bytes straight into the storage of a CPU
  tensor the caller allocated (positional reads, no intermediate buffer), which is how streaming
  checkpoint loading puts a weight into its final place;
- :meth:`SafetensorsFile.read` does the same into a new tensor;
- :meth:`SafetensorsFile.view` returns a zero-copy tensor over one copy-on-write memory map of the
  whole file (created once per file and shared by all views), which is how disk-offloaded weights
  are served on CPU without reading them ahead of time.

The ``safetensors`` package writes these files; reading goes through this module so that the
bytes land exactly where they are needed.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from collections.abc import Iterator
from types import TracebackType

import torch

from accel_state.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeaderError,
    TensorEntry,
    read_safetensors_header,
)

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "SafetensorsFile", "safetensors_dtype_name"]


def _build_dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "C64": torch.complex64,
    }
    optional = {
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
    for code, attribute in optional.items():
        dtype = getattr(torch, attribute, None)
        if isinstance(dtype, torch.dtype):
            table[code] = dtype
    return table


SAFETENSORS_DTYPES: dict[str, torch.dtype] = _build_dtype_table()
"""The safetensors dtype codes this torch can hold, e.g. ``{"F32": torch.float32, ...}``."""

_CODE_OF_DTYPE = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (``torch.bfloat16`` -> ``"BF16"``).

    Raises:
        ValueError: safetensors has no code for this dtype.
    """
    try:
        return _CODE_OF_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype} cannot be stored in a safetensors file: use one of "
            f"{sorted(str(d) for d in _CODE_OF_DTYPE)}."
        ) from None


class _Entry:
    """One tensor of the header: dtype, shape and absolute byte range in the file."""

    __slots__ = ("dtype", "end", "shape", "start")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int) -> None:
        self.dtype = dtype
        self.shape = shape
        self.start = start
        self.end = end


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy, no numpy)."""
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


class SafetensorsFile:
    """A ``.safetensors`` file opened for reading tensor by tensor.

    The header is parsed and checked when the object is created; tensors are read only on
    request. Use it as a context manager, or call :meth:`close`.

    Example:
        >>> with SafetensorsFile("model.safetensors") as f:  # doctest: +SKIP
        ...     weight = torch.empty(f.shape("lm.weight"), dtype=f.dtype("lm.weight"))
        ...     f.read_into("lm.weight", weight)

    Args:
        path: the file to open.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: the file is not a valid safetensors file; the message names the file and
            what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._mmap: mmap.mmap | None = None
        self._file = open(self.path, "rb")  # closed by close()
        try:
            self._size = os.fstat(self._file.fileno()).st_size
            self._metadata, self._entries = self._parse_header()
        except BaseException:
            self._file.close()
            raise

    # -- header -----------------------------------------------------------------------------

    def _parse_header(self) -> tuple[dict[str, str] | None, dict[str, _Entry]]:
        header = read_safetensors_header(self.path, stream=self._file)
        entries = {name: self._typed(name, raw) for name, raw in header.tensors.items()}
        return header.metadata, entries

    def _typed(self, name: str, raw: TensorEntry) -> _Entry:
        """Add the torch dtype to a checked header entry; refuse codes torch cannot hold."""
        dtype = SAFETENSORS_DTYPES.get(raw.dtype)
        if dtype is None:
            raise SafetensorsHeaderError(
                self.path,
                f"{name!r} has dtype {raw.dtype!r}; this reader supports "
                f"{sorted(SAFETENSORS_DTYPES)} with torch {torch.__version__}",
            )
        expected = raw.numel * dtype.itemsize
        if raw.nbytes != expected:
            raise SafetensorsHeaderError(
                self.path,
                f"{name!r} spans {raw.nbytes} bytes but its shape {list(raw.shape)} of "
                f"{raw.dtype} needs {expected}",
            )
        return _Entry(dtype, raw.shape, raw.start, raw.end)

    # -- queries ----------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"{self.path} has no tensor named {name!r} (it has {len(self._entries)} "
                "tensors; see keys())"
            ) from None

    @property
    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` object of the header, or ``None`` when the file has none."""
        return None if self._metadata is None else dict(self._metadata)

    def keys(self) -> list[str]:
        """Names of the tensors in the file, sorted (as ``safe_open(...).keys()`` gives them)."""
        return sorted(self._entries)

    def keys_in_file_order(self) -> list[str]:
        """Names of the tensors in the order their bytes appear in the file (sequential reads)."""
        return sorted(self._entries, key=lambda n: (self._entries[n].start, n))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype of tensor ``name``.

        Raises:
            KeyError: the file has no such tensor.
        """
        return self._entry(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``.

        Raises:
            KeyError: the file has no such tensor.
        """
        return self._entry(name).shape

    def nbytes(self, name: str) -> int:
        """How many bytes tensor ``name`` occupies in the file.

        Raises:
            KeyError: the file has no such tensor.
        """
        entry = self._entry(name)
        return entry.end - entry.start

    def offsets(self, name: str) -> tuple[int, int]:
        """The absolute byte range ``[start, end)`` of tensor ``name`` in the file.

        Raises:
            KeyError: the file has no such tensor.
        """
        entry = self._entry(name)
        return entry.start, entry.end

    # -- reading ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._file.closed:
            raise ValueError(f"{self.path} was closed: open a new SafetensorsFile to read it.")

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Read tensor ``name`` straight into the memory of ``out`` and return ``out``.

        The bytes go from the file into ``out``'s storage with positional reads; nothing else
        is allocated.

        Args:
            name: the tensor to read.
            out: a contiguous CPU tensor with the tensor's dtype and shape.

        Raises:
            KeyError: the file has no such tensor.
            ValueError: ``out`` is not contiguous, not on the CPU, or has another dtype or
                shape; or the file ended early (it changed after it was opened).
        """
        entry = self._entry(name)
        if out.device.type != "cpu":
            raise ValueError(
                f"out must be a CPU tensor to read {name!r} into, got one on {out.device}: read "
                "into a CPU (ideally pinned) tensor and copy it to the device."
            )
        if out.dtype != entry.dtype or tuple(out.shape) != entry.shape:
            raise ValueError(
                f"out has dtype {out.dtype} and shape {tuple(out.shape)} but {name!r} in "
                f"{self.path} has dtype {entry.dtype} and shape {entry.shape}: allocate out "
                "with the file's dtype and shape (see dtype() and shape())."
            )
        if not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous to read {name!r} into; pass out.contiguous() or a "
                "freshly allocated tensor."
            )
        self._check_open()
        size = entry.end - entry.start
        if size == 0:
            return out
        self._read_exact(tensor_buffer(out), entry.start, name)
        return out

    def _read_exact(self, buffer: memoryview, offset: int, name: str) -> None:
        fd = self._file.fileno()
        done = 0
        total = len(buffer)
        preadv = getattr(os, "preadv", None)
        while done < total:
            chunk = buffer[done:]
            if preadv is not None:
                count = preadv(fd, [chunk], offset + done)
            else:
                with self._lock:
                    self._file.seek(offset + done)
                    count = self._file.readinto(chunk)
            if not count:
                raise ValueError(
                    f"{self.path} ended while reading {name!r} ({done} of {total} bytes): the "
                    "file was truncated or replaced after it was opened."
                )
            done += count

    def read(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` into a new CPU tensor (one read, no intermediate copy).

        Raises:
            KeyError: the file has no such tensor.
        """
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        return self.read_into(name, out)

    def is_aligned(self, name: str) -> bool:
        """Whether tensor ``name`` starts at a multiple of its element size in the file.

        safetensors' own writer aligns every tensor; a file from another writer may not, and
        a view of a misaligned tensor is then better replaced by a copy (:meth:`read`).
        """
        entry = self._entry(name)
        return entry.start % entry.dtype.itemsize == 0

    def view(self, name: str) -> torch.Tensor:
        """A zero-copy CPU tensor over tensor ``name`` in a copy-on-write map of the file.

        The map is created on first use and shared by every view; pages are read by the OS
        when touched. Writing to a view changes only this process's copy, never the file.
        Views stay valid after :meth:`close`.

        Raises:
            KeyError: the file has no such tensor.
        """
        entry = self._entry(name)
        numel = math.prod(entry.shape)
        if numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        mapping = self._mapping()
        flat = torch.frombuffer(mapping, dtype=entry.dtype, count=numel, offset=entry.start)
        return flat.view(entry.shape)

    def _mapping(self) -> mmap.mmap:
        with self._lock:
            if self._mmap is None:
                self._check_open()
                self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            return self._mmap

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file. Tensors returned by :meth:`view` keep their memory map alive."""
        with self._lock:
            # The map is not closed explicitly: views hold a reference to it (torch.frombuffer
            # keeps its buffer object alive), so it is unmapped when the last of them is freed.
            self._mmap = None
            self._file.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._file.closed

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, tensors={len(self._entries)})"
