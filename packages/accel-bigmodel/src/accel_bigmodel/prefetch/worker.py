"""The background thread that runs prefetch jobs, one at a time, in submission order."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

THREAD_NAME = "accel-offload-prefetch"
"""The name of every prefetch thread (they are daemon threads)."""


class _Task:
    """One queued job; it lets go of the job as soon as it is cancelled, run or failed.

    The job references the engine's units (their modules and hooks, hence the engine), so
    holding it one moment longer than needed would keep a dropped engine, and through the
    engine's finalizer this thread, alive until the next garbage collection after that.
    """

    __slots__ = ("function", "future")

    def __init__(self, future: concurrent.futures.Future[Any], function: Callable[[], Any]) -> None:
        self.future = future
        self.function: Callable[[], Any] | None = function

    def drop(self, future: concurrent.futures.Future[Any]) -> None:
        """Let go of the job (the future's done-callback: a cancel drops it at once)."""
        self.function = None

    def run(self) -> None:
        """Run the job unless it was cancelled; its outcome goes to the future."""
        function = self.function
        self.function = None
        # First, even for a dropped job: a cancelled future is "done" for
        # concurrent.futures.wait() only once this has notified its waiters.
        if not self.future.set_running_or_notify_cancel() or function is None:
            return
        try:
            result = function()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            del function
            self.future.set_exception(error)
        else:
            del function
            self.future.set_result(result)


def _run_tasks(tasks: queue.SimpleQueue[_Task | None]) -> None:
    """Run tasks until ``None`` arrives; holds no reference to a task once it is done."""
    while True:
        task = tasks.get()
        if task is None:
            return
        task.run()
        del task


class Worker:
    """One daemon thread that runs prefetch jobs in submission order.

    The thread holds only its queue, so an engine that owns a worker can be collected while
    the thread waits; the finalizer of the engine's binding calls ``shutdown(wait=False)``.

    Attributes:
        pid: the process that started the thread (a forked child has no such thread).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_run_tasks, args=(self._tasks,), name=THREAD_NAME, daemon=True
        )
        self._thread.start()

    def submit(self, function: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Queue ``function``; its future is cancelled only while it waits in the queue."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        task = _Task(future, function)
        future.add_done_callback(task.drop)
        self._tasks.put(task)
        return future

    def shutdown(self, *, wait: bool = True) -> None:
        """Let the thread finish its queue and exit.

        Args:
            wait: also wait for the thread to exit (never done from the thread itself, nor in
                a forked child, where the thread does not exist).
        """
        self._tasks.put(None)
        if wait and threading.current_thread() is not self._thread and self.owned:
            self._thread.join()

    @property
    def owned(self) -> bool:
        """Whether this process started the thread (``False`` in a forked child)."""
        return self.pid == os.getpid()

    @property
    def alive(self) -> bool:
        """Whether the thread runs, in this process."""
        return self.owned and self._thread.is_alive()
