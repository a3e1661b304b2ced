"""Reading the tensors of one checkpoint file straight into their destinations.

:class:`Source` opens a safetensors file (through
:class:`~accel_bigmodel.safetensors_files.SafetensorsFile`) or memory-maps a pickled one, and
hands out one tensor at a time, already on its device and in its dtype: CPU weights in the
file's dtype are zero-copy views of a safetensors file, and copies to an accelerator go through
one reusable host buffer (:class:`Staging`), so peak memory is one tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from accel_bigmodel.offload import WeightInfo, index_dtype_name
from accel_bigmodel.safetensors_files import SafetensorsFile

from .files import is_safetensors, torch_load


class Staging:
    """One reusable host buffer (pinned when CUDA is available) for copies to an accelerator."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the buffer as a ``dtype`` tensor of ``shape`` (grown when too small)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes:
            # Free the old buffer before allocating the larger one.
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_can_pin())
        return self._buffer[:nbytes].view(dtype).view(shape)


def _can_pin() -> bool:
    return torch.cuda.is_available()


class Source:
    """Reads the tensors of one checkpoint file into destinations chosen by the caller.

    Args:
        path: the file (safetensors, or a pickled state dict).
        staging: the host buffer for copies to an accelerator.
        renamed: ``{model name: checkpoint key}`` for the names a rename changed.
    """

    def __init__(
        self, path: str, staging: Staging, renamed: Mapping[str, str] | None = None
    ) -> None:
        self.path = path
        self._staging = staging
        # model name -> checkpoint key, for the names a rename changed
        self._key = dict(renamed or {})
        self._name = {key: name for name, key in self._key.items()}
        self._safetensors: SafetensorsFile | None = None
        self._pickled: Mapping[str, Any] | None = None
        if is_safetensors(path):
            self._safetensors = SafetensorsFile(path)
        else:
            self._pickled = torch_load(path)

    def key(self, name: str) -> str:
        """The checkpoint key holding the model's ``name``."""
        return self._key.get(name, name)

    def order(self, names: Iterable[str]) -> list[str]:
        """``names`` (the model's) in the order their tensors lie in the file."""
        wanted = set(names)
        keys = (
            self._safetensors.keys_in_file_order()
            if self._safetensors is not None
            else list(self._pickled or ())
        )
        in_order = (self._name.get(key, key) for key in keys)
        return [name for name in in_order if name in wanted]

    def offload_entry(self, name: str) -> WeightInfo:
        """The offload-index entry that serves the model's ``name`` in place from this file.

        Raises:
            ValueError: the file is not a safetensors file (pickles cannot be read in place).
        """
        handle = self._safetensors
        if handle is None:
            raise ValueError(f"{self.path} is not a safetensors file: it cannot be read in place")
        key = self.key(name)
        return {
            "safetensors_file": os.path.abspath(self.path),
            "weight_name": key,
            "dtype": index_dtype_name(handle.dtype(key)),
            "shape": list(handle.shape(key)),
        }

    def value(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on ``device`` in ``dtype`` holding the model's ``name``."""
        name = self.key(name)
        if self._safetensors is not None:
            return self._safetensors_value(self._safetensors, name, device, dtype)
        assert self._pickled is not None
        mapped: torch.Tensor = self._pickled[name]
        if device.type == "cpu" and dtype == mapped.dtype:
            # Copy out of the file mapping so the model never depends on the checkpoint file.
            owned = torch.empty(mapped.shape, dtype=dtype)
            owned.copy_(mapped)
            return owned
        return mapped.to(device=device, dtype=dtype)

    def _safetensors_value(
        self, handle: SafetensorsFile, key: str, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        file_dtype, shape = handle.dtype(key), handle.shape(key)
        if device.type == "cpu":
            if dtype == file_dtype and handle.is_aligned(key):
                # Zero-copy, like safetensors.torch.load_file: the weight is a
                # copy-on-write view of the file, paged in when first used.
                return handle.view(key)
            if dtype == file_dtype:
                return handle.read_into(key, torch.empty(shape, dtype=dtype))
            return handle.read(key).to(dtype)
        staged = self._staging.take(file_dtype, shape)
        if staged.numel():
            handle.read_into(key, staged)
        return staged.to(device=device, dtype=dtype)

    def into(self, name: str, target: torch.Tensor) -> None:
        """Overwrite ``target`` in place with the model's ``name`` (cast and moved)."""
        name = self.key(name)
        if self._safetensors is None:
            assert self._pickled is not None
            target.copy_(self._pickled[name])
            return
        handle = self._safetensors
        if target.device.type == "cpu":
            if target.dtype == handle.dtype(name) and target.is_contiguous():
                handle.read_into(name, target)
            else:
                target.copy_(handle.read(name))
            return
        staged = self._staging.take(handle.dtype(name), handle.shape(name))
        if staged.numel():
            handle.read_into(name, staged)
        target.copy_(staged)

    def close(self) -> None:
        """Close the file (a pickled file's mapping is released once its tensors are)."""
        if self._safetensors is not None:
            self._safetensors.close()
        self._pickled = None
