"""Checkpoints written in the background: the host snapshot and the writer thread.

``save_state(async_save=True)`` splits a save in two. On the caller's thread, every process
captures what the checkpoint holds into host memory (:class:`HostSnapshot`): tensors are
copied into buffers kept from one save to the next (pinned, and copied on a side stream that
the training stream then waits for, on CUDA), everything else is deep-copied, so training may
change the model and optimizer as soon as the call returns. Then :class:`BackgroundSaver`
runs the writes on one thread per process, and the commit (manifest, rename, pruning) once
every process has written its files.

The processes agree on the outcome over a process group of their own (gloo), created at the
first asynchronous save, so that the writer thread never shares a group with the training
loop's collectives. A process whose writes fail tells the others; nothing is committed, the
previous checkpoints stay as they were, and the error is raised by the next call into the
Accelerator that checks it (``backward``, ``save_state``, ``load_state``,
``wait_for_checkpoint``, ``end_training``). At most one save is in flight: the next one
waits for it. The thread is not a daemon, so interpreter exit waits for the checkpoint too.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .checkpointing import CheckpointError

__all__ = ["BackgroundSaver", "HostSnapshot"]

logger = logging.getLogger("accel.checkpointing")

WRITER_THREAD_NAME = "accel-checkpoint-writer"
WRITER_NICE = 19


class HostSnapshot:
    """Host-memory copies of states, in buffers reused between saves.

    Each tensor storage is copied whole, once, into a byte buffer kept for the position of
    the first tensor using it (``"optimizer.bin/state/0/exp_avg"``) and reused while that
    position's storage has the same size, so the memory held is one snapshot of the
    checkpoint (:attr:`nbytes`: the bytes ``torch.save`` would write) and later saves allocate
    nothing. Tensors sharing a storage (tied weights, views) share it in the copy with the
    same offsets and strides, so the files written are the same bytes.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}
        self._events: list[Any] = []
        self._used: set[str] = set()
        self._storages: dict[tuple[torch.device, int, int], torch.UntypedStorage] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the buffers."""
        return sum(buffer.untyped_storage().nbytes() for buffer in self._buffers.values())

    def capture(self, states: dict[str, Any]) -> dict[str, Any]:
        """Copy ``states`` (a name per state) into host memory; return the copies.

        Buffers of positions that no longer hold a tensor are let go.
        """
        self._events = []
        self._used = set()
        self._storages = {}
        memo: dict[int, Any] = {}
        copies = {name: self._copy(state, name, memo) for name, state in states.items()}
        self._storages = {}  # the copies keep what they need
        for stale in set(self._buffers) - self._used:
            del self._buffers[stale]
        for device, stream in self._streams.items():
            event = torch.cuda.Event()
            event.record(stream)
            self._events.append(event)
            # Later work on the training stream waits for the copies: the weights it changes
            # next are read by them first. The caller's thread does not wait.
            torch.cuda.current_stream(device).wait_stream(stream)
        return copies

    def wait_copied(self) -> None:
        """Block until the device-to-host copies of the last capture are done."""
        for event in self._events:
            event.synchronize()

    def _copy(self, value: Any, key: str, memo: dict[int, Any]) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if _is_dtensor(value):
            # This rank's shard, in a host buffer, wrapped again with the same layout (what
            # DCP writes from: it reads the local shard and the placement metadata).
            from torch.distributed.tensor import DTensor

            local = self._copy_tensor(value.to_local(), key)
            copied: Any = DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        elif isinstance(value, torch.Tensor):
            copied = self._copy_tensor(value, key)
        elif isinstance(value, dict):
            copied = copy.copy(value)
            for name, item in value.items():
                copied[name] = self._copy(item, f"{key}/{name}", memo)
            for attribute, item in vars(value).items() if hasattr(value, "__dict__") else ():
                setattr(copied, attribute, copy.deepcopy(item))
        elif isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            items = [self._copy(item, f"{key}/{index}", memo) for index, item in enumerate(value)]
            copied = items if isinstance(value, list) else type(value)(items)
        else:
            copied = copy.deepcopy(value)
        memo[id(value)] = copied
        return copied

    def _copy_tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """A host tensor equal to ``tensor``, a view of a host copy of its whole storage.

        Storages are copied once per capture, so tensors sharing one (views, tied weights, a
        gathered state split into pieces) share it in the copy too, with the same offsets and
        strides: ``torch.save`` and the safetensors writer then write the same bytes as from
        the originals.
        """
        source = tensor.detach()
        storage = source.untyped_storage()
        identity = (source.device, storage.data_ptr(), storage.nbytes())
        host = self._storages.get(identity)
        if host is None:
            host = self._copy_storage(source, storage, key)
            self._storages[identity] = host
        view = torch.empty(0, dtype=source.dtype)
        view.set_(host, source.storage_offset(), source.size(), source.stride())
        return view

    def _copy_storage(
        self, source: torch.Tensor, storage: torch.UntypedStorage, key: str
    ) -> torch.UntypedStorage:
        pinned = source.device.type == "cuda"
        size = storage.nbytes()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != size or buffer.is_pinned() != pinned:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._buffers[key] = buffer
        self._used.add(key)
        whole = torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage)
        if pinned:
            stream = self._streams.get(source.device)
            if stream is None:
                stream = self._streams[source.device] = torch.cuda.Stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                buffer.copy_(whole, non_blocking=True)
        else:
            buffer.copy_(whole)
        return buffer.untyped_storage()


def _is_dtensor(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("torch.distributed") and type(value).__name__ == "DTensor"


class BackgroundSaver:
    """One checkpoint written at a time, on a thread, with the outcome agreed by all processes."""

    def __init__(self) -> None:
        self.snapshot = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        self._label = ""

    @property
    def in_flight(self) -> bool:
        """Whether a checkpoint is being written now."""
        return self._thread is not None and self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raise the error of a finished background save (once); do not wait."""
        if self._error is not None and not self.in_flight:
            error, self._error = self._error, None
            raise error

    def wait(self) -> None:
        """Wait for the checkpoint in flight, then raise its error if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        self.raise_if_failed()

    def submit(self, label: str, write: Callable[[Any], None], commit: Callable[[], None]) -> None:
        """Start writing a checkpoint; called by every process at the same point.

        Args:
            label: The checkpoint directory, for messages.
            write: Writes and fsyncs this process's files (the snapshot has been captured);
                called with the writer threads' process group (``None`` with one process),
                the only group it may run collectives on (DCP's planning, say).
            commit: Run once every process has written: the manifest, the rename and the
                pruning on the processes that commit a folder; nothing on the others.
        """
        self.wait()
        group = self._agreement_group()
        self._label = label
        thread = threading.Thread(
            target=self._run, args=(write, commit, group), name=WRITER_THREAD_NAME
        )
        self._thread = thread
        thread.start()

    def close(self) -> None:
        """Wait for the checkpoint in flight and let go of the agreement group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def _agreement_group(self) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if self._group is None:
            # A group of its own: the writer thread's collectives never interleave with the
            # training loop's. gloo agrees on CPU tensors whatever the training backend is.
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
        return self._group

    def _run(self, write: Callable[[Any], None], commit: Callable[[], None], group: Any) -> None:
        _yield_to_training()
        failed: BaseException | None = None
        try:
            self.snapshot.wait_copied()
            write(group)
        except BaseException as error:  # noqa: BLE001 - told to the peers, raised later
            failed = error
        if not self._agree(failed is None, group):
            self._error = failed or _peer_failure(self._label, "writing its files")
            return
        try:
            commit()
        except BaseException as error:  # noqa: BLE001 - told to the peers, raised later
            failed = error
        if not self._agree(failed is None, group):
            self._error = failed or _peer_failure(self._label, "committing the checkpoint")

    def _agree(self, ok: bool, group: Any) -> bool:
        """Whether every process succeeded (a collective over the agreement group)."""
        if group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        except Exception as error:  # noqa: BLE001 - a peer died: nothing is committed
            logger.error(f"asynchronous save of {self._label}: processes lost: {error}")
            return False
        return bool(flag.item())


def _yield_to_training() -> None:
    """Give the writer thread the lowest CPU priority (Linux: the nice value is per thread).

    Writing copies every byte into the page cache, CPU time charged to this thread; at nice
    19 it takes the cores only when training leaves them idle, and the write takes longer
    instead of slowing the steps. Elsewhere (the value is per process) it is left alone.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except OSError:  # not permitted in this sandbox: keep the default priority
        pass


def _peer_failure(label: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"asynchronous save of {label}: another process failed {what}, so the checkpoint was "
        "not committed (the previous checkpoints are untouched); its error is raised on that "
        "process"
    )
