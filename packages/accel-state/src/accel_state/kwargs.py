"""Kwargs handlers: small dataclasses that carry keyword arguments to a torch object.

:class:`KwargsHandler` is the base of every handler accel accepts in
``Accelerator(kwargs_handlers=[...])``; :class:`InitProcessGroupKwargs` configures
``torch.distributed.init_process_group`` (backend, init method, timeout).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from datetime import timedelta
from typing import Any

from .environment import ACCEL_PROCESS_GROUP_TIMEOUT, environment_hidden, read_variable

__all__ = ["InitProcessGroupKwargs", "KwargsHandler"]


class KwargsHandler:
    """Base class for dataclasses that forward keyword arguments to a torch object."""

    def to_dict(self) -> dict[str, Any]:
        """Return a deep copy of every field."""
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """Return the fields whose values differ from a default-constructed handler.

        The default instance is built as if no environment variable were set, so a default
        read from one never hides a value the user set on purpose. Only this thread's readers
        are blinded (:func:`~accel_state.environment.environment_hidden`): ``os.environ`` is
        left alone, so other threads keep seeing it whole.
        """
        with environment_hidden():
            default = self.__class__().to_dict()
        mine = self.to_dict()
        return {key: value for key, value in mine.items() if default.get(key) != value}


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``.

    Args:
        backend: Backend to use. ``"nccl"`` is the default as in Accelerate; on a process
            without CUDA the state replaces it with the backend of the chosen device (gloo on
            CPU), so the same handler works on both.
        init_method: URL telling the processes how to find each other (default: ``env://``).
        timeout: How long a collective waits for the other ranks. ``None`` means the
            ``ACCEL_PROCESS_GROUP_TIMEOUT`` environment variable (seconds) when set, else
            600 s for nccl and 1800 s for other backends.

    Raises:
        ValueError: ``timeout`` is not positive.
        TypeError: ``timeout`` is neither a ``timedelta`` nor a number of seconds.
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            raw = read_variable(ACCEL_PROCESS_GROUP_TIMEOUT)
            if raw:
                self.timeout = _seconds_to_timedelta(raw, ACCEL_PROCESS_GROUP_TIMEOUT)
            else:
                self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)
        elif isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            self.timeout = _seconds_to_timedelta(self.timeout, "timeout")
        elif not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}): expected a datetime.timedelta "
                "or a number of seconds"
            )
        if self.timeout.total_seconds() <= 0:
            raise ValueError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}): the timeout must be positive"
            )


def _seconds_to_timedelta(value: str | float, name: str) -> timedelta:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}={value!r} is not a number of seconds: give a positive number such as 1800"
        ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{name}={value!r}: the timeout must be a positive, finite number of seconds"
        )
    return timedelta(seconds=seconds)
