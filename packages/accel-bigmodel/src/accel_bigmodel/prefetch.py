"""The offload engine: bring the next offloaded blocks in while the current one runs.

:class:`PrefetchingMaterializer` is a :class:`~accel_bigmodel.hooks.WeightMaterializer` that
overlaps loading offloaded weights with compute. ``dispatch_model``, ``cpu_offload``,
``disk_offload`` and ``load_checkpoint_and_dispatch`` install one (``prefetch_depth``, default
1 or ``ACCEL_OFFLOAD_PREFETCH_DEPTH``) whenever the model has offloaded weights.

Units and order
---------------
The unit of prefetching is a device-map block with offloaded weights (the block hooks of
:func:`~accel_bigmodel.hooks.attach_align_device_hook_on_blocks`); in a model hooked by
``cpu_offload`` / ``disk_offload``, which has no blocks, every offloading hook is its own unit.
When unit k starts, units k+1 .. k+``prefetch_depth`` are handed to one background thread. The
order is the model's real call order, recorded on each forward (forward boundaries come from a
pre-hook and an ``always_call`` forward hook on the model); before the first forward it is the
device map's order. When a unit starts that the order did not predict, everything prefetched is
dropped, the rest of that forward loads synchronously, and the order seen in that forward
replaces the learned one. ``prefetch_depth=0`` loads every unit when it starts, as Accelerate's
hooks do. Units run outside a forward of the model (e.g. a submodule called directly, or
``align_module_device``) load synchronously.

What a prefetch does
--------------------
- Always: checks that each file holding the unit's weights still exists and is long enough
  (one ``stat`` per file), so that a file deleted or truncated under a running model raises an
  error naming it instead of a ``SIGBUS``; then pages the unit's byte ranges in: ``madvise``
  ``MADV_WILLNEED`` (read-ahead) and ``MADV_POPULATE_READ`` (Linux >= 5.14; reads the pages and
  maps them into the very memory maps the weight views use, so the block's compute takes no
  page faults; it fails with ``EFAULT`` instead of raising ``SIGBUS``). The GIL is released
  during these calls. On CPU execution the block then runs on the same zero-copy views as the
  synchronous path: outputs are bit-identical.
- Execution on a CUDA device, additionally: the thread reads each weight (casting it to the
  model's dtype as the synchronous path does), copies it into a pinned staging buffer and from
  there, with ``non_blocking=True`` on a side stream, into a new device tensor; an event is
  recorded after the unit's copies. ``materialize`` makes the current stream wait for that event
  and calls ``record_stream`` on the tensors it uses. A staging buffer is refilled only after
  the event of its previous copies has completed. Tied weights are left to the synchronous path
  (their one shared device copy).

Memory bound
------------
At most ``prefetch_depth + 1`` units are held at any time: the running one and the ones
prefetched ahead (the rest are dropped when a unit starts; a prefetched-but-unused unit is
dropped on a mismatch, at the end of a forward, or when a forward raises). On CPU execution
the weights are views of the files' memory maps (page cache, not anonymous memory), so the
engine adds no anonymous memory. On a CUDA device: device memory <= ``(prefetch_depth + 1)``
x the largest offloaded unit, plus a pinned host staging pool of ``min(prefetch_depth, 2)``
buffers of the largest unit's size, allocated on first use and reused for every forward.

When a forward raises, the pipeline drains (queued prefetches are cancelled, a running one is
awaited, everything prefetched is dropped) and any weights the failed modules left
materialised are put back on ``meta``, so the next forward starts clean.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import logging
import mmap
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from accel_state.environment import ACCEL_OFFLOAD_PREFETCH_DEPTH

from .hooks import (
    AlignDevicesHook,
    _align_hooks,
    _hook_of,
    _materialize_weights,
    _release_weights,
    set_weight_materializer,
)
from .offload import WeightLocation
from .tensors import castable, module_tensor

__all__ = ["DEFAULT_PREFETCH_DEPTH", "PREFETCH_DEPTH_ENV", "PrefetchingMaterializer"]

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH_DEPTH = 1
"""``prefetch_depth`` when neither the argument nor ``ACCEL_OFFLOAD_PREFETCH_DEPTH`` sets it."""

PREFETCH_DEPTH_ENV = ACCEL_OFFLOAD_PREFETCH_DEPTH
"""The environment variable giving the default ``prefetch_depth`` (an int >= 0)."""

_PAGE = mmap.PAGESIZE
_ALIGNMENT = 256  # byte alignment of tensors inside a staging buffer


# -- argument checks ------------------------------------------------------------------------


def _check_prefetch_depth(value: Any, argument: str = "prefetch_depth") -> int:
    """Return ``value`` if it is an int >= 0 (not a bool), else raise a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{argument}={value!r} is not a prefetch depth: use an int >= 0 (0 loads each "
            "offloaded block when it starts, as Accelerate does; 1, the default, loads the "
            "next offloaded block while the current one runs; N loads N blocks ahead)."
        )
    return value


def resolve_prefetch_depth(value: int | None) -> int:
    """The prefetch depth to use: ``value``, else ``ACCEL_OFFLOAD_PREFETCH_DEPTH``, else 1.

    Args:
        value: the ``prefetch_depth`` argument (``None``: not given).

    Raises:
        ValueError: ``value`` or the environment variable is not an int >= 0.
    """
    if value is not None:
        return _check_prefetch_depth(value)
    raw = os.environ.get(PREFETCH_DEPTH_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_PREFETCH_DEPTH
    try:
        parsed = int(raw.strip())
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(
            f"{PREFETCH_DEPTH_ENV}={raw!r} is not a prefetch depth: set it to an int >= 0 "
            f"(e.g. 0, 1 or 2) or unset it (default {DEFAULT_PREFETCH_DEPTH})."
        )
    return parsed


# -- files: checks and paging in ------------------------------------------------------------


def _missing_file(path: str, name: str) -> FileNotFoundError:
    return FileNotFoundError(
        errno.ENOENT,
        f"{path} no longer exists: it holds the offloaded weight {name!r}, which is read from "
        "it at every forward. It was deleted or moved while the model was dispatched; put it "
        "back, or load and dispatch the model again from where the weights are now.",
    )


def _shrunk_file(path: str, name: str, size: int, needed: int) -> ValueError:
    return ValueError(
        f"{path} has {size} bytes but the offloaded weight {name!r} needs its first {needed} "
        "bytes: the file was truncated or rewritten while the model was dispatched. Restore "
        "it, or load and dispatch the model again."
    )


def _check_files(files: Sequence[tuple[str, int, str]]) -> None:
    """Check that each ``(path, bytes needed, a weight read from it)`` file is still usable."""
    for path, needed, name in files:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise _missing_file(path, name) from None
        if size < needed:
            raise _shrunk_file(path, name, size, needed)


def _load_libc_function(name: str, third: Any) -> Callable[[int, int, Any], int] | None:
    """``madvise`` / ``mincore`` from the C library (ctypes releases the GIL during calls)."""
    if sys.platform == "win32":
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    function.restype = ctypes.c_int
    return function


_MADVISE = _load_libc_function("madvise", ctypes.c_int)
_MINCORE = _load_libc_function("mincore", ctypes.c_void_p)
_MADV_WILLNEED: int | None = getattr(mmap, "MADV_WILLNEED", None)
_MADV_POPULATE_READ: int | None = getattr(
    mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None
)
_POPULATE_WORKS = [_MADV_POPULATE_READ is not None]  # cleared when the kernel refuses it


def _resident(address: int, length: int) -> bool:
    """Whether every page of a page-aligned mapped range is in memory (``mincore``)."""
    mincore = _MINCORE
    if mincore is None:
        return False
    pages = -(-length // _PAGE)
    vector = ctypes.create_string_buffer(pages)
    if mincore(address, length, vector) != 0:
        return False
    return ctypes.string_at(vector, pages).count(0) == 0


def _page_in(ranges: Sequence[tuple[int, int, str]], skip_resident: bool) -> None:
    """Read the pages of ``(page-aligned address, length, path)`` memory-map ranges.

    With ``skip_resident`` a range whose pages are all in memory (one cheap ``mincore``) is
    left alone; the caller sets it once the ranges were populated, as populating pages that
    are already mapped still costs a page-table walk with reference counting.
    ``MADV_POPULATE_READ`` fails with ``EFAULT`` where touching the pages would raise
    ``SIGBUS`` (the file shrank under its map): that becomes an error naming the file.
    """
    madvise = _MADVISE
    if madvise is None:
        return
    for address, length, path in ranges:
        if skip_resident and _resident(address, length):
            continue
        if _MADV_WILLNEED is not None:
            madvise(address, length, _MADV_WILLNEED)
        populate = _MADV_POPULATE_READ
        if populate is None or not _POPULATE_WORKS[0]:
            continue
        if madvise(address, length, populate) != 0:
            code = ctypes.get_errno()
            if code == errno.EFAULT:
                raise ValueError(
                    f"{path} is shorter than when it was mapped: paging in {length} bytes of "
                    "offloaded weights from it failed (the file was truncated or rewritten "
                    "while the model was dispatched). Restore it, or load and dispatch the "
                    "model again."
                )
            if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                _POPULATE_WORKS[0] = False  # older kernel: read-ahead only


def page_in_background(spans: Sequence[tuple[int, int, str]]) -> threading.Thread | None:
    """Page in ``(address, length, path)`` memory-map spans, in this order, on a daemon thread.

    For weights that are zero-copy views of their files and will be used soon (the first
    forward of a freshly loaded model): the reads run ahead of the compute instead of as page
    faults inside it. Spans already in memory are skipped (one ``mincore`` each), so a warm
    page cache costs next to nothing. Failures are logged at debug level only: the forward
    reads the pages itself anyway. Returns the thread, or ``None`` when there is nothing to do
    or no ``madvise`` here.
    """
    if _MADVISE is None or not spans:
        return None
    ranges = []
    for address, length, path in spans:
        start = address - address % _PAGE
        end = address + length
        end += -end % _PAGE
        ranges.append((start, end - start, path))

    def run() -> None:
        try:
            _page_in(ranges, skip_resident=True)
        except (OSError, ValueError) as error:
            logger.debug("Paging in the weights ahead of the first forward stopped: %s", error)

    thread = threading.Thread(target=run, name="accel-page-in", daemon=True)
    thread.start()
    return thread


def _merge_spans(spans: Sequence[tuple[int, int, str]]) -> tuple[tuple[int, int, str], ...]:
    """Page-align ``(address, length, path)`` spans and merge those of one file that touch."""
    merged: list[list[Any]] = []
    for address, length, path in sorted(spans):
        start = address - address % _PAGE
        end = address + length
        end += -end % _PAGE
        if merged and merged[-1][2] == path and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, path])
    return tuple((start, end - start, path) for start, end, path in merged)


class _Plan:
    """What loading some offloaded weights ahead involves, worked out once on the main thread.

    Attributes:
        files: ``(path, bytes the file must have, a weight read from it)`` per file.
        ranges: page-aligned ``(address, length, path)`` ranges of the loader's memory maps.
        spans: the unaligned ``(address, length, path)`` spans the ranges were merged from.
        keep: the mapped byte views behind the ranges (they keep the maps alive).
        populated: the background thread paged the ranges in once (it then skips ranges
            that are still resident).
    """

    __slots__ = ("files", "keep", "populated", "ranges", "spans")

    def __init__(
        self,
        files: Sequence[tuple[str, int, str]],
        spans: Sequence[tuple[int, int, str]],
        keep: Sequence[torch.Tensor],
    ) -> None:
        self.files = tuple(files)
        self.spans = tuple(spans)
        self.ranges = _merge_spans(spans)
        self.keep = tuple(keep)
        self.populated = False

    @property
    def empty(self) -> bool:
        """Whether there is nothing on disk to check or page in."""
        return not self.files and not self.ranges


def _needed_sizes(
    locations: Sequence[tuple[WeightLocation, str]],
) -> list[tuple[str, int, str]]:
    sizes: dict[str, tuple[int, str]] = {}
    for location, name in locations:
        end = location.offset + location.length
        known = sizes.get(location.path)
        if known is None or end > known[0]:
            sizes[location.path] = (end, name)
    return [(path, end, name) for path, (end, name) in sizes.items()]


def _hook_plan(hook: AlignDevicesHook) -> _Plan:
    """The files and mapped ranges behind the offloaded weights of one hook."""
    weights = hook.weights_map
    locate = getattr(weights, "weight_location", None)
    if weights is None or locate is None:
        return _Plan((), (), ())
    mapped_bytes = getattr(weights, "mapped_bytes", None)
    locations: list[tuple[WeightLocation, str]] = []
    spans: list[tuple[int, int, str]] = []
    keep: list[torch.Tensor] = []
    for name in hook.offloaded_names:
        try:
            location = locate(name)
            view = None if location is None or mapped_bytes is None else mapped_bytes(name)
        except KeyError:
            continue  # the synchronous path reports the missing entry with its context
        except FileNotFoundError as error:
            raise _missing_file(str(error.filename), name) from None
        if location is None:
            continue
        locations.append((location, name))
        if view is not None:
            if view is not None:
                keep.append(view)
                spans.append((view.data_ptr(), view.numel(), location.path))
    return _Plan(_needed_sizes(locations), spans, keep)


def _combine(plans: Sequence[_Plan]) -> _Plan:
    sizes: dict[str, tuple[int, str]] = {}
    for plan in plans:
        for path, needed, name in plan.files:
            known = sizes.get(path)
            if known is None or needed > known[0]:
                sizes[path] = (needed, name)
    return _Plan(
        [(path, needed, name) for path, (needed, name) in sizes.items()],
        [span for plan in plans for span in plan.spans],
        [view for plan in plans for view in plan.keep],
    )


# -- the background thread ------------------------------------------------------------------

_Task = tuple["concurrent.futures.Future[Any]", Callable[[], Any]]


def _worker_loop(tasks: queue.SimpleQueue[_Task | None]) -> None:
    """Run tasks until ``None`` arrives; holds no reference to the materialiser between tasks."""
    while True:
        task = tasks.get()
        if task is None:
            return
        future, function = task
        del task
        if future.set_running_or_notify_cancel():
            try:
                result = function()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(error)
            else:
                future.set_result(result)
                del result
        del future, function


class _Worker:
    """One daemon thread that runs prefetch tasks in submission order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_worker_loop, args=(self._tasks,), name="accel-offload-prefetch", daemon=True
        )
        self._thread.start()

    def submit(self, function: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._tasks.put((future, function))
        return future

    def stop(self) -> None:
        """Let the thread finish its queue and exit; wait for it unless called from it."""
        self._tasks.put(None)
        if threading.current_thread() is not self._thread and self.pid == os.getpid():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()


def _stop_queue(tasks: queue.SimpleQueue[_Task | None]) -> None:
    tasks.put(None)


# -- CUDA staging ---------------------------------------------------------------------------


def _aligned(nbytes: int) -> int:
    return nbytes + (-nbytes % _ALIGNMENT)


class _CudaStager:
    """Copies host tensors to one CUDA device through pinned staging buffers on a side stream.

    Used by the background thread only. ``slots`` buffers of at least ``capacity`` bytes are
    pinned on first use; a buffer is refilled only after the event recorded behind its previous
    copies has completed.
    """

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        self._next = 0

    def stage(
        self, items: Sequence[tuple[AlignDevicesHook, str, torch.Tensor]], capacity: int
    ) -> tuple[dict[AlignDevicesHook, dict[str, torch.Tensor]], Any]:
        """Start copying ``items`` to the device; returns the device tensors and the event."""
        offsets: list[int] = []
        total = 0
        for _, _, host in items:
            offsets.append(total)
            total += _aligned(host.numel() * host.element_size())
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        previous = self._events[slot]
        if previous is not None:
            previous.synchronize()  # the last copies out of this buffer are done
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < total:
            self._buffers[slot] = None
            buffer = torch.empty(max(total, capacity), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        staged: dict[AlignDevicesHook, dict[str, torch.Tensor]] = {}
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for (hook, name, host), offset in zip(items, offsets, strict=True):
                if host.is_pinned():
                    source = host
                else:
                    nbytes = host.numel() * host.element_size()
                    source = buffer[offset : offset + nbytes].view(host.dtype).view(host.shape)
                    source.copy_(host)
                target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                target.copy_(source, non_blocking=True)
                staged.setdefault(hook, {})[name] = target
            done = torch.cuda.Event()
            done.record(self.stream)
        self._events[slot] = done
        return staged, done


def _cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` means the calling thread's current device)."""
    if device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _stageable(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.is_quantized
        and value.numel() > 0
    )


# -- the materialiser -----------------------------------------------------------------------


class _Unit:
    """A unit of prefetching: one device-map block, or one offloading hook outside blocks.

    Attributes:
        key: the hook whose start starts the unit (the block hook, or the offloading hook).
        members: ``(module, offloading hook)`` pairs whose weights the unit holds.
        name: the block (or module) name, for logs and introspection.
        is_block: started by ``block_started`` (else by the key hook's ``materialize``).
        dtypes: ``{hook: {tensor name: the model's dtype}}`` of the offloaded tensors.
        nbytes: the bytes of its offloaded tensors (aligned as in a staging buffer).
    """

    __slots__ = ("dtypes", "is_block", "key", "members", "name", "nbytes")

    def __init__(
        self,
        key: AlignDevicesHook,
        members: Sequence[tuple[nn.Module, AlignDevicesHook]],
        name: str,
        is_block: bool,
    ) -> None:
        self.key = key
        self.members = tuple(members)
        self.name = name
        self.is_block = is_block
        self.dtypes: dict[AlignDevicesHook, dict[str, torch.dtype]] = {}
        self.nbytes = 0
        for module, hook in self.members:
            table: dict[str, torch.dtype] = {}
            for tensor_name in hook.offloaded_names:
                try:
                    tensor = module_tensor(module, tensor_name)
                except (KeyError, AttributeError):
                    continue
                table[tensor_name] = tensor.dtype
                self.nbytes += _aligned(tensor.numel() * tensor.element_size())
            self.dtypes[hook] = table

    def __repr__(self) -> str:
        return f"_Unit({self.name!r})"


class _Loaded:
    """What a finished prefetch produced: device tensors per hook and their copy events."""

    __slots__ = ("events", "values")

    def __init__(
        self,
        values: dict[AlignDevicesHook, dict[str, torch.Tensor]],
        events: dict[torch.device, Any],
    ) -> None:
        self.values = values
        self.events = events

    def take(self, hook: AlignDevicesHook) -> dict[str, torch.Tensor] | None:
        """Hand over ``hook``'s device tensors, ordered after their copies on the current stream."""
        values = self.values.pop(hook, None)
        if not values:
            return None
        device = hook.target_device
        if device is None or device.type != "cuda":
            return values
        device = _cuda_device(device)
        event = self.events.get(device)
        if event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            for tensor in values.values():
                tensor.record_stream(stream)
        return values


class _Prefetch:
    """One scheduled prefetch of a unit."""

    __slots__ = ("failed", "future", "loaded", "unit")

    def __init__(self, unit: _Unit, future: concurrent.futures.Future[Any]) -> None:
        self.unit = unit
        self.future = future
        self.loaded: _Loaded | None = None
        self.failed = False


def _find_units(model: nn.Module) -> list[_Unit]:
    """The model's prefetch units in the device map's (module registration) order."""
    units: list[_Unit] = []
    in_blocks: set[AlignDevicesHook] = set()
    free: list[tuple[int, str, nn.Module, AlignDevicesHook]] = []
    block_positions: list[int] = []
    for position, (name, module) in enumerate(model.named_modules()):
        for hook in _align_hooks(_hook_of(module)):
            if hook.block_index is not None and hook.block_offload_hooks:
                units.append(_Unit(hook, hook.block_offload_hooks, hook.block_name or name, True))
                block_positions.append(position)
                in_blocks.update(member for _, member in hook.block_offload_hooks)
            if hook.offload and hook.offloaded_names:
                free.append((position, name, module, hook))
    ordered = list(zip(block_positions, units, strict=True))
    for position, name, module, hook in free:
        if hook not in in_blocks:
            ordered.append((position, _Unit(hook, [(module, hook)], name, False)))
    ordered.sort(key=lambda item: item[0])
    return [unit for _, unit in ordered]


def _has_offloaded_weights(model: nn.Module) -> bool:
    return any(
        hook.offload for module in model.modules() for hook in _align_hooks(_hook_of(module))
    )


class PrefetchingMaterializer:
    """Load offloaded weights ahead: the next ``prefetch_depth`` blocks while one runs.

    Install it with :func:`~accel_bigmodel.hooks.set_weight_materializer` (one instance per
    model; the dispatch functions do this for you). It learns the model's block order on each
    forward, pages the next blocks' file ranges in (and, for CUDA execution, copies them to the
    device on a side stream) from one background thread, and hands the weights to each module
    exactly as the synchronous path would, so outputs are bit-identical. See the module
    documentation for the order, the memory bound and the failure behaviour.

    Args:
        prefetch_depth: how many offloaded blocks to load ahead of the running one; ``0`` is
            Accelerate's synchronous behaviour.

    Raises:
        ValueError: ``prefetch_depth`` is not an int >= 0 (bools are refused too).

    Example::

        model = load_checkpoint_and_dispatch(model, "ckpt/", device_map=device_map)
        set_weight_materializer(model, PrefetchingMaterializer(prefetch_depth=2))
    """

    def __init__(self, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> None:
        self.prefetch_depth = _check_prefetch_depth(prefetch_depth)
        self._reset()

    def _reset(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._units: list[_Unit] = []
        self._unit_of_key: dict[AlignDevicesHook, _Unit] = {}
        self._unit_of_member: dict[AlignDevicesHook, _Unit] = {}
        self._handles: list[Any] = []
        self._hook_plans: dict[AlignDevicesHook, _Plan] = {}
        self._unit_plans: dict[_Unit, _Plan] = {}
        self._order: list[_Unit] | None = None
        self._seen: list[_Unit] = []
        self._forward_depth = 0
        self._synchronous_rest = False
        self._inflight: dict[int, _Prefetch] = {}
        self._current: _Prefetch | None = None
        self._loaded: dict[AlignDevicesHook, nn.Module] = {}
        self._worker: _Worker | None = None
        self._stagers: dict[torch.device, _CudaStager] = {}
        self._staging_bytes = 0
        self._warned = False

    def __repr__(self) -> str:
        return f"PrefetchingMaterializer(prefetch_depth={self.prefetch_depth})"

    # A dispatched model may be deep-copied or pickled: the copy gets a fresh, unbound engine
    # (its hooks load synchronously until set_weight_materializer binds one).
    def __deepcopy__(self, memo: dict[int, Any]) -> PrefetchingMaterializer:
        clone = PrefetchingMaterializer(self.prefetch_depth)
        memo[id(self)] = clone
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {"prefetch_depth": self.prefetch_depth}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.prefetch_depth = _check_prefetch_depth(state["prefetch_depth"])
        self._reset()

    # -- binding ----------------------------------------------------------------------------

    def bind(self, model: nn.Module) -> None:
        """Learn ``model``'s offloaded units and watch its forwards (called on installation).

        Raises:
            ValueError: this materialiser is bound to another model.
        """
        bound = self._model() if self._model is not None else None
        if bound is not None and bound is not model:
            raise ValueError(
                f"{self!r} is already bound to a {type(bound).__name__}, and a prefetching "
                "materialiser follows the blocks of one model: install a new one on this "
                f"{type(model).__name__}, e.g. set_weight_materializer(model, "
                f"PrefetchingMaterializer(prefetch_depth={self.prefetch_depth}))."
            )
        units = _find_units(model)
        self.close()
        self._model = weakref.ref(model)
        self._units = units
        for unit in units:
            self._unit_of_key[unit.key] = unit
            for _, member in unit.members:
                self._unit_of_member[member] = unit
        self._staging_bytes = max((unit.nbytes for unit in units), default=0)
        self._handles = [
            model.register_forward_pre_hook(self._forward_started, prepend=True),
            model.register_forward_hook(self._forward_finished, always_call=True),
        ]

    def close(self) -> None:
        """Stop the background thread, drop everything prefetched and forget the model.

        Hooks that still point here afterwards load synchronously.
        """
        self._drain()
        for handle in self._handles:
            handle.remove()
        worker = self._worker
        self._worker = None
        if worker is not None:
            worker.stop()
        self._model = None
        self._units = []
        self._unit_of_key = {}
        self._unit_of_member = {}
        self._handles = []
        self._hook_plans = {}
        self._unit_plans = {}
        self._order = None
        self._seen = []
        self._forward_depth = 0
        self._stagers = {}

    # -- introspection ----------------------------------------------------------------------

    def block_order(self) -> list[str]:
        """The unit (block or module) names in the order prefetching follows now."""
        return [unit.name for unit in self._sequence()]

    def prefetched_blocks(self) -> list[str]:
        """The units whose weights the engine holds or is loading now, in order.

        That is the running unit (when it was prefetched) and those prefetched ahead of it: at
        most ``prefetch_depth + 1`` names.
        """
        names = [] if self._current is None else [self._current.unit.name]
        names.extend(self._inflight[position].unit.name for position in sorted(self._inflight))
        return names

    # -- WeightMaterializer -----------------------------------------------------------------

    def block_started(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """A device-map block starts: take its prefetch and start loading the next ones."""
        unit = self._unit_of_key.get(hook)
        if unit is not None and unit.is_block:
            self._unit_started(unit)

    def materialize(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Set the offloaded tensors of ``module``, from its block's prefetch when there is one.

        Raises:
            FileNotFoundError: a file holding these weights was deleted (the message names it).
            ValueError: such a file is shorter than the weights need (truncated).
            KeyError: the weights map has no entry for one of the tensors.
        """
        unit = self._unit_of_member.get(hook)
        if unit is not None and not unit.is_block and unit.key is hook:
            self._unit_started(unit)
        self._loaded[hook] = module
        record = self._current
        loaded = None
        if record is not None and record.unit is unit:
            loaded = self._result(record)
        if loaded is None:
            _check_files(self._plan_of_hook(hook).files)
            _materialize_weights(hook, module)
            return
        _materialize_weights(hook, module, loaded.take(hook))

    def release(self, hook: AlignDevicesHook, module: nn.Module) -> None:
        """Put the offloaded tensors of ``module`` back on ``meta``."""
        self._loaded.pop(hook, None)
        _release_weights(hook, module)

    # -- forwards ---------------------------------------------------------------------------

    def _forward_started(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        if self._worker is not None and self._worker.pid != os.getpid():
            # A forked child: the parent's thread and its queued work are not here.
            self._worker = None
            self._inflight.clear()
            self._stagers = {}
        self._drain()
        self._seen = []
        self._synchronous_rest = False
        self._schedule(0, self.prefetch_depth - 1)

    def _forward_finished(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_depth == 0:
            return
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return
        self._drain()
        # Modules whose forward raised never ran post_forward: put their weights back.
        leftovers = list(self._loaded.items())
        self._loaded.clear()
        for hook, owner in leftovers:
            _release_weights(hook, owner)
        self._learn(self._seen)
        self._seen = []

    def _learn(self, seen: list[_Unit]) -> None:
        if not seen:
            return
        order = self._order
        if order is not None and (seen == order or seen == order[: len(seen)]):
            return  # same order, or the same start of it (a forward that ended early)
        if order is not None:
            logger.debug(
                "Offload prefetch: the blocks ran in a new order (%d units); following it from "
                "the next forward.",
                len(seen),
            )
        self._order = list(seen)

    def _sequence(self) -> list[_Unit]:
        return self._order if self._order is not None else self._units

    def _unit_started(self, unit: _Unit) -> None:
        if self._forward_depth == 0:
            self._current = None  # outside a forward of the model: synchronous
            return
        position = len(self._seen)
        self._seen.append(unit)
        record = self._inflight.pop(position, None)
        for stale in [earlier for earlier in self._inflight if earlier < position]:
            self._discard(self._inflight.pop(stale))
        self._current = None
        if self._synchronous_rest:
            if record is not None:
                self._discard(record)
            return
        sequence = self._sequence()
        expected = sequence[position] if position < len(sequence) else None
        if expected is not unit:
            if record is not None:
                self._discard(record)
            if expected is not None:
                logger.debug(
                    "Offload prefetch: %r started where %r was expected; loading synchronously "
                    "until the end of this forward, then following the new order.",
                    unit.name,
                    expected.name,
                )
                self._drain()
                self._synchronous_rest = True
            return
        self._current = record
        self._schedule(position + 1, position + self.prefetch_depth)

    # -- prefetching ------------------------------------------------------------------------

    def _schedule(self, first: int, last: int) -> None:
        if self.prefetch_depth == 0:
            return
        sequence = self._sequence()
        for position in range(max(first, 0), min(last, len(sequence) - 1) + 1):
            if position in self._inflight:
                continue
            unit = sequence[position]
            job = self._job(unit)
            if job is not None:
                self._inflight[position] = _Prefetch(unit, self._submit(job))

    def _submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        worker = self._worker
        if worker is None or not worker.alive:
            worker = _Worker()
            self._worker = worker
            weakref.finalize(self, _stop_queue, worker._tasks)
        return worker.submit(job)

    def _job(self, unit: _Unit) -> Callable[[], _Loaded] | None:
        try:
            plan = self._plan_of_unit(unit)
        except (OSError, ValueError, KeyError):
            return None  # the synchronous path reports it when the unit runs
        staging: tuple[tuple[AlignDevicesHook, torch.device], ...] = ()
        on_cuda = [
            (hook, hook.target_device)
            for _, hook in unit.members
            if hook.target_device is not None and hook.target_device.type == "cuda"
        ]
        if on_cuda and torch.cuda.is_available():
            # Device indexes are resolved here: the current device is per thread.
            staging = tuple((hook, _cuda_device(device)) for hook, device in on_cuda)
        if plan.empty and not staging:
            return None
        return functools.partial(self._load_unit, unit, plan, staging)

    def _plan_of_hook(self, hook: AlignDevicesHook) -> _Plan:
        plan = self._hook_plans.get(hook)
        if plan is None:
            plan = _hook_plan(hook)
            if self._model is not None:
                self._hook_plans[hook] = plan
        return plan

    def _plan_of_unit(self, unit: _Unit) -> _Plan:
        plan = self._unit_plans.get(unit)
        if plan is None:
            plan = _combine([self._plan_of_hook(hook) for _, hook in unit.members])
            self._unit_plans[unit] = plan
        return plan

    def _load_unit(
        self,
        unit: _Unit,
        plan: _Plan,
        staging: Sequence[tuple[AlignDevicesHook, torch.device]],
    ) -> _Loaded:
        """Runs on the background thread: check the files, page in, stage to the device."""
        _check_files(plan.files)
        _page_in(plan.ranges, plan.populated)
        plan.populated = True
        values: dict[AlignDevicesHook, dict[str, torch.Tensor]] = {}
        events: dict[torch.device, Any] = {}
        if not staging:
            return _Loaded(values, events)
        by_device: dict[torch.device, list[tuple[AlignDevicesHook, str, torch.Tensor]]] = {}
        with torch.no_grad():
            for hook, device in staging:
                weights = hook.weights_map
                if weights is None:
                    continue
                tied = hook.tied_params_map
                dtypes = unit.dtypes.get(hook, {})
                for name in hook.offloaded_names:
                    try:
                        host = weights[name]
                    except KeyError:
                        continue
                    if not _stageable(host):
                        continue
                    if tied is not None and (
                        name in hook.tied_params_names or host.data_ptr() in tied
                    ):
                        continue  # tied weights share one device copy: the synchronous path
                    wanted = dtypes.get(name)
                    if wanted is not None and castable(host.dtype) and host.dtype != wanted:
                        host = host.to(wanted)
                    by_device.setdefault(device, []).append((hook, name, host))
        for device, items in by_device.items():
            stager = self._stagers.get(device)
            if stager is None:
                stager = _CudaStager(device, min(self.prefetch_depth, 2))
                self._stagers[device] = stager
            staged, event = stager.stage(items, self._staging_bytes)
            for hook, tensors in staged.items():
                values.setdefault(hook, {}).update(tensors)
            events[device] = event
        return _Loaded(values, events)

    def _result(self, record: _Prefetch) -> _Loaded | None:
        if record.loaded is None and not record.failed:
            try:
                record.loaded = record.future.result()
            except Exception as error:  # noqa: BLE001 - the synchronous path takes over
                record.failed = True
                file_problem = isinstance(error, (OSError, ValueError))
                if not file_problem and not self._warned:
                    self._warned = True
                    logger.warning(
                        "Offload prefetch of %r failed (%s: %s); loading synchronously.",
                        record.unit.name,
                        type(error).__name__,
                        error,
                    )
                else:
                    logger.debug("Offload prefetch of %r failed: %s", record.unit.name, error)
        return record.loaded

    def _discard(self, record: _Prefetch) -> None:
        """Drop a prefetch: cancel it if queued, else wait for it so its memory goes now."""
        worker = self._worker
        if not record.future.cancel() and worker is not None and worker.alive:
            concurrent.futures.wait([record.future])
        record.loaded = None

    def _drain(self) -> None:
        self._current = None
        pending = list(self._inflight.values())
        self._inflight.clear()
        for record in pending:
            self._discard(record)


def _install_prefetch(model: nn.Module, prefetch_depth: int, caller: str) -> None:
    """Install a :class:`PrefetchingMaterializer` on a freshly hooked model, if it offloads."""
    if not _has_offloaded_weights(model):
        logger.debug(
            "%s(prefetch_depth=%d): no block of this model is offloaded, so there is nothing "
            "to prefetch.",
            caller,
            prefetch_depth,
        )
        return
    set_weight_materializer(model, PrefetchingMaterializer(prefetch_depth))
