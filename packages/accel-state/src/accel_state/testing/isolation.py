"""Leaving no state behind between tests: singletons, process group, environment, threads."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator, Mapping

import torch.distributed as dist

from accel_state.state import AcceleratorState, GradientState

__all__ = ["LeakError", "clean_state", "restored_variables"]

#: How long the threads a test started get to finish after it, all together, in seconds.
THREAD_GRACE = 2.0

# Written by the tools themselves, not by the test: pytest in every phase of every test;
# torch's inductor (its default cache folder, and a marker when its C++ helpers first load)
# once per process, whichever test first needs it.
_UNCHECKED_VARIABLES = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    }
)
# Threads a library starts once and keeps for the life of the process, by name: tqdm's
# monitor outlives every bar (only ``tqdm.tqdm.monitor.exit()`` stops it).
_PROCESS_THREADS = frozenset({"tqdm_monitor"})


class LeakError(AssertionError):
    """A test left environment variables changed or threads running behind it."""


@contextlib.contextmanager
def clean_state(*, check_leaks: bool = False) -> Iterator[None]:
    """Run a block, then reset every singleton, destroy the process group, restore os.environ.

    Test suites wrap each test in it (an autouse fixture), so no test sees another's state.
    In a pytest fixture the block itself never raises (pytest catches the test's failure
    before the fixture resumes), so a failing test that also leaks reports both.

    Args:
        check_leaks: Also fail, once the block has finished without an exception and after
            everything is reset, when the block left ``os.environ`` different (a variable
            set, changed or removed and not put back), or left a thread it started still
            alive :data:`THREAD_GRACE` seconds later (daemon or not). Threads alive before
            the block and threads not started from Python are ignored. The environment is
            restored either way.

    Raises:
        LeakError: With ``check_leaks``, for each leaked variable and thread by name.
    """
    saved = dict(os.environ)
    threads_before = set(threading.enumerate())
    finished = False
    try:
        yield
        finished = True
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        leaks = []
        if check_leaks and finished:
            leaks = _environment_changes(saved, os.environ)
            leaks += [_describe_thread(t) for t in _leftover_threads(threads_before, THREAD_GRACE)]
        os.environ.clear()
        os.environ.update(saved)
    if leaks:
        raise LeakError("the test left state behind:\n  " + "\n  ".join(leaks))


@contextlib.contextmanager
def restored_variables(*names: str) -> Iterator[None]:
    """Put the environment variables ``names`` back as they were once the block ends.

    For a test of code that exports variables into its own process (rank variables, flags):
    whatever the block sets, changes or removes among ``names`` is undone, even on an
    exception; other variables are left alone.
    """
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _environment_changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """One line per variable that differs between two snapshots of the environment."""
    changes = []
    for name in sorted((before.keys() | after.keys()) - _UNCHECKED_VARIABLES):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None:
            changes.append(f"environment variable {name} set to {new!r}")
        elif new is None:
            changes.append(f"environment variable {name} removed (it was {old!r})")
        else:
            changes.append(f"environment variable {name} changed from {old!r} to {new!r}")
    return changes


def _leftover_threads(before: set[threading.Thread], grace: float) -> list[threading.Thread]:
    """Python threads not in ``before`` still alive once ``grace`` seconds (in all) have passed.

    A thread often lives as long as an object of the test that a reference cycle keeps, so
    the garbage is collected once before waiting.
    """
    started = [t for t in _python_threads() if t not in before]
    if not started:
        return []
    gc.collect()
    deadline = time.monotonic() + grace
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in started if t.is_alive()]


def _describe_thread(thread: threading.Thread) -> str:
    """The line naming a leaked thread."""
    kind = "daemon thread" if thread.daemon else "thread"
    return f"{kind} {thread.name!r} ({type(thread).__qualname__}) still running"


def _python_threads() -> list[threading.Thread]:
    # A _DummyThread stands for a thread started outside Python (torch's own pools calling
    # back into Python): it cannot be joined and lives as long as the process.
    return [
        t
        for t in threading.enumerate()
        if t.is_alive()
        and not isinstance(t, threading._DummyThread)
        and t.name not in _PROCESS_THREADS
    ]
