"""The prefetch depth: its default, its environment variable and its checks."""

from __future__ import annotations

from typing import Any

from accel_state.environment import ACCEL_OFFLOAD_PREFETCH_DEPTH, read_variable

DEFAULT_PREFETCH_DEPTH = 1
"""``prefetch_depth`` when neither the argument nor ``ACCEL_OFFLOAD_PREFETCH_DEPTH`` sets it."""

PREFETCH_DEPTH_ENV = ACCEL_OFFLOAD_PREFETCH_DEPTH
"""The environment variable giving the default ``prefetch_depth`` (an int >= 0)."""


def check_prefetch_depth(value: Any, argument: str = "prefetch_depth") -> int:
    """Return ``value`` if it is an int >= 0 (not a bool).

    Raises:
        ValueError: it is not; the message names ``argument``.
    """
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
        return check_prefetch_depth(value)
    raw = read_variable(PREFETCH_DEPTH_ENV)
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
