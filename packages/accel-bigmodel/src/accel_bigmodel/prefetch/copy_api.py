"""The device calls staging makes, behind one small interface.

:class:`CopyApi` is everything :mod:`.cuda_staging` and :mod:`.host_pinning` ask of a device:
streams, asynchronous copies and casts, events, pinned buffers and page-locking memory in
place. :class:`CudaCopyApi` is the real one; the tests drive the same staging code with a fake
that runs on the CPU and records the order of every call.

Page-locking in place goes through the CUDA *driver* (``cuMemHostRegister`` in ``libcuda``,
read-only and portable): the runtime's ``cudaHostRegister`` would leave its error, when it
refuses, in the thread's last-error slot, where torch's next kernel-launch check would report
it as that kernel's failure. Read-only matters: the weights are copy-on-write maps of the user's
files, and pinning them writable would copy every page into anonymous memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
CUDA_SUCCESS = 0
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
REGISTER_FLAGS = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY
"""Pinned for every context, and read-only (the device only reads the weights)."""


class CopyEvent(Protocol):
    """A marker recorded on a stream behind some work."""

    def synchronize(self) -> None:
        """Block the calling thread until the work before the marker is done."""

    def query(self) -> bool:
        """Whether the work before the marker is done."""


class CopyApi(Protocol):
    """What staging needs from a device (see the module documentation)."""

    def new_stream(self, device: torch.device) -> Any:
        """A new side stream on ``device``."""

    def on_stream(
        self, device: torch.device, stream: Any
    ) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` (of ``device``) current for the calling thread inside the block."""

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """An uninitialised flat ``uint8`` tensor on ``device``."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` host tensor in page-locked memory."""

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``target`` asynchronously, on the current stream."""

    def cast(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``source`` (on the device) cast to ``dtype``, on the current stream."""

    def record(self, stream: Any) -> CopyEvent:
        """An event recorded on ``stream`` now."""

    def hand_over(
        self, device: torch.device, event: CopyEvent, tensors: list[torch.Tensor]
    ) -> None:
        """Order the consumer's current stream after ``event``.

        Also tells the allocator that ``tensors`` (allocated on the side stream) are used there.
        """

    def mark(self, device: torch.device) -> CopyEvent:
        """An event recorded now on the calling thread's current stream of ``device``."""

    def synchronize(self, stream: Any) -> None:
        """Block until everything queued on ``stream`` is done."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is page-locked (a device can read it directly)."""

    def register(self, address: int, nbytes: int, device: torch.device) -> int:
        """Page-lock ``[address, address + nbytes)`` in place, read-only; 0 or an error code.

        The range is pinned for every device; ``device``'s context is made current first.
        """

    def unregister(self, address: int) -> int:
        """Undo :meth:`register` of the range starting at ``address``; 0 or an error code."""

    def error_name(self, code: int) -> str:
        """A readable name for an error code of :meth:`register`."""


class _Driver:
    """``cuMemHostRegister`` / ``cuMemHostUnregister`` / ``cuGetErrorName`` from ``libcuda``."""

    def __init__(self) -> None:
        self.library: Any = None
        self.problem = ""
        try:
            library = ctypes.CDLL("libcuda.so.1")
            register = library.cuMemHostRegister_v2
            unregister = library.cuMemHostUnregister
            error_name = library.cuGetErrorName
        except (OSError, AttributeError) as error:
            self.problem = f"the CUDA driver library could not be loaded ({error})"
            return
        register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        register.restype = ctypes.c_int
        unregister.argtypes = [ctypes.c_void_p]
        unregister.restype = ctypes.c_int
        error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        error_name.restype = ctypes.c_int
        self.library = library
        self._register, self._unregister, self._error_name = register, unregister, error_name

    def register(self, address: int, nbytes: int) -> int:
        if self.library is None:
            return -1
        return int(self._register(address, nbytes, REGISTER_FLAGS))

    def unregister(self, address: int) -> int:
        if self.library is None:
            return -1
        return int(self._unregister(address))

    def error_name(self, code: int) -> str:
        if code == -1:
            return self.problem or "no CUDA driver"
        if self.library is None:
            return f"CUDA error {code}"
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUDA error {code}"
        return f"{name.value.decode(errors='replace')} ({code})"


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class CudaCopyApi:
    """:class:`CopyApi` on CUDA (torch's streams, events and caching allocator)."""

    def new_stream(self, device: torch.device) -> Any:
        """See :meth:`CopyApi.new_stream`."""
        return torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def on_stream(self, device: torch.device, stream: Any) -> Iterator[None]:
        """See :meth:`CopyApi.on_stream`."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """See :meth:`CopyApi.empty`."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        """See :meth:`CopyApi.pinned`."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """See :meth:`CopyApi.copy`."""
        target.copy_(source, non_blocking=True)

    def cast(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`CopyApi.cast`."""
        return source.to(dtype)

    def record(self, stream: Any) -> CopyEvent:
        """See :meth:`CopyApi.record`."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def hand_over(
        self, device: torch.device, event: CopyEvent, tensors: list[torch.Tensor]
    ) -> None:
        """See :meth:`CopyApi.hand_over`."""
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)  # type: ignore[arg-type]
        for tensor in tensors:
            tensor.record_stream(stream)

    def mark(self, device: torch.device) -> CopyEvent:
        """See :meth:`CopyApi.mark`."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def synchronize(self, stream: Any) -> None:
        """See :meth:`CopyApi.synchronize`."""
        stream.synchronize()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """See :meth:`CopyApi.is_pinned`."""
        return bool(tensor.is_pinned())

    def register(self, address: int, nbytes: int, device: torch.device) -> int:
        """See :meth:`CopyApi.register`."""
        # The driver call needs a current context on this (background) thread.
        torch.cuda.set_device(device)
        return _driver().register(address, nbytes)

    def unregister(self, address: int) -> int:
        """See :meth:`CopyApi.unregister`."""
        return _driver().unregister(address)

    def error_name(self, code: int) -> str:
        """See :meth:`CopyApi.error_name`."""
        return _driver().error_name(code)
