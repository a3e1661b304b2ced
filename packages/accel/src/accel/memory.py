"""Memory helpers: retry a function with smaller batches on out-of-memory, free references.

:func:`find_executable_batch_size` wraps a training (or evaluation) function whose first
parameter is the batch size. It calls the function with ``starting_batch_size`` and, each
time the call fails with an out-of-memory error, collects garbage, empties the device cache
and tries again with a smaller batch (90% of the previous one by default), until a call
succeeds or the batch size reaches zero. :func:`release_memory` and
:func:`clear_device_cache` hand memory back to the allocator between attempts or phases.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from accel_state.devices import clear_device_cache

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]

_R = TypeVar("_R")

#: Fragments of the messages torch and its device runtimes use when an allocation fails.
_OOM_MESSAGES: tuple[str, ...] = (
    " out of memory.",  # CUDA / XPU caching allocators: "CUDA out of memory. Tried to ..."
    "CUDA error: out of memory",  # raised by the CUDA runtime itself, outside the allocator
    "MPS backend out of memory",  # Apple MPS
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN refuses a too-large workspace
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Habana HPU
)

#: The factor the default policy multiplies the batch size by after a failure.
_DEFAULT_REDUCTION = 0.9


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects`` and free the device memory they held.

    The caller's own names still point at the objects, so use the result to rebind them::

        model, optimizer = release_memory(model, optimizer)

    The objects themselves are freed when that rebinding drops the last reference (an object
    caught in a reference cycle waits for the next garbage collection); the collection and
    cache clearing done here release whatever earlier work left unreachable.

    Args:
        *objects: Models, optimizers, tensors or anything else holding memory.

    Returns:
        A list with one ``None`` per object passed.
    """
    released: list[Any] = list(objects)
    for index in range(len(released)):
        released[index] = None
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` means "the batch did not fit in memory".

    True for ``torch.OutOfMemoryError`` and for a ``RuntimeError`` whose message contains one
    of the out-of-memory texts of CUDA, XPU, MPS, cuDNN, the CPU allocator or Habana HPU.

    Args:
        exception: The exception raised by an attempt.
    """
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    if exception.args and isinstance(exception.args[0], str):
        message = exception.args[0]
    else:
        message = str(exception)
    return any(fragment in message for fragment in _OOM_MESSAGES)


def _positional_capacity(function: Callable[..., Any]) -> int | None:
    """How many positional arguments ``function`` accepts (``None``: unlimited or unknown)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    count = 0
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            count += 1
    return count


def _positional_names(function: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def _make_reducer(reduce_batch_size_fn: Callable[..., int] | None) -> Callable[[int], int]:
    """Turn the user's reduction policy into ``current batch size -> next batch size``.

    Accelerate's callbacks take no argument (they keep the batch size in a closure); accel
    also accepts one that takes the current batch size.
    """
    if reduce_batch_size_fn is None:
        return lambda batch_size: int(batch_size * _DEFAULT_REDUCTION)
    capacity = _positional_capacity(reduce_batch_size_fn)
    takes_batch_size = capacity is None or capacity >= 1
    user_fn = reduce_batch_size_fn

    def reduce(batch_size: int) -> int:
        return user_fn(batch_size) if takes_batch_size else user_fn()

    return reduce


@overload
def find_executable_batch_size(
    function: Callable[..., _R],
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Callable[..., _R]: ...


@overload
def find_executable_batch_size(
    function: None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Callable[[Callable[..., _R]], Callable[..., _R]]: ...


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Any:
    """Retry ``function`` with a smaller batch size each time it runs out of memory.

    Use it bare (``@find_executable_batch_size``) or with arguments
    (``@find_executable_batch_size(starting_batch_size=64)``). The decorated function must
    take the batch size as its first parameter, and callers must *not* pass it: the
    decorator does. Everything that holds device memory (model, optimizer, data loaders)
    should be created inside the function so a failed attempt can release it.

    After an out-of-memory failure (see :func:`should_reduce_batch_size`) the wrapper runs
    the garbage collector, empties the device cache and sets the batch size to
    ``int(batch_size * 0.9)`` (from 128: 128, 115, 103, 92, ...), or to what
    ``reduce_batch_size_fn`` returns. The wrapper remembers the last batch size it tried, so
    calling it again starts there instead of at ``starting_batch_size``.

    Args:
        function: The function to wrap; ``None`` when the decorator is used with arguments.
        starting_batch_size: The first batch size tried.
        reduce_batch_size_fn: Chooses the next batch size after a failure. It is called with
            the failed batch size, or with no argument if it takes none (Accelerate's form,
            which keeps the batch size in a closure). It must return a smaller non-negative
            ``int``.

    Returns:
        The wrapped function (or, without ``function``, a decorator producing it). Calling
        it returns what ``function`` returns for the first batch size that fits.

    Raises:
        TypeError: ``starting_batch_size`` is not an ``int``; or (when called) the caller
            passed the batch size too, i.e. more positional arguments than ``function`` takes
            after its batch-size parameter.
        RuntimeError: (when called) every batch size down to zero ran out of memory (or
            ``starting_batch_size`` was 0).
        ValueError: ``starting_batch_size`` is negative, or (when called)
            ``reduce_batch_size_fn`` returned something other than a smaller non-negative
            ``int``.
        Exception: any exception of ``function`` that is not an out-of-memory error is
            re-raised unchanged, on the first attempt that raises it.
    """
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int):
        raise TypeError(
            f"starting_batch_size must be an int, got {starting_batch_size!r} "
            f"({type(starting_batch_size).__name__})"
        )
    if starting_batch_size < 0:
        raise ValueError(
            f"starting_batch_size must not be negative, got {starting_batch_size}: "
            "pass the largest batch size worth trying, e.g. starting_batch_size=128"
        )
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )

    wrapped: Callable[..., Any] = function
    reduce = _make_reducer(reduce_batch_size_fn)
    capacity = _positional_capacity(wrapped)
    name = getattr(wrapped, "__name__", repr(wrapped))
    batch_size = starting_batch_size

    @functools.wraps(wrapped)
    def with_batch_size(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        if capacity is not None and len(args) + 1 > capacity:
            names = _positional_names(wrapped)[1:]
            shown = ", ".join(
                f"{param}={value!r}" for param, value in zip(names, args[1:], strict=False)
            )
            raise TypeError(
                f"Batch size was passed into `{name}` as the first argument when called. "
                f"Remove it, the decorator already passes the batch size: call "
                f"`{name}({shown})`"
            )
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return wrapped(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
            # Outside the except block: the traceback (and the frames holding the failed
            # attempt's tensors) is released before the cache is emptied.
            clear_device_cache(garbage_collection=True)
            batch_size = _checked_next(reduce(batch_size), batch_size, reduce_batch_size_fn)

    return with_batch_size


def _checked_next(
    proposed: Any, current: int, reduce_batch_size_fn: Callable[..., int] | None
) -> int:
    """Validate the next batch size chosen by the reduction policy."""
    valid = isinstance(proposed, int) and not isinstance(proposed, bool)
    if valid and 0 <= proposed < current:
        return int(proposed)
    raise ValueError(
        f"reduce_batch_size_fn={reduce_batch_size_fn!r} returned {proposed!r} after batch size "
        f"{current} ran out of memory: it must return an int smaller than {current} and not "
        "negative, otherwise the search would never end"
    )
