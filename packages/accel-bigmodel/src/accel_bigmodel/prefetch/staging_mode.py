"""How host weights reach a GPU: the staging mode and the ring's copy threads, and their checks.

Both are read from the environment once, when an engine first stages weights to a GPU.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from accel_state.environment import (
    ACCEL_OFFLOAD_COPY_THREADS,
    ACCEL_OFFLOAD_STAGING,
    read_variable,
)

StagingMode = Literal["auto", "register", "ring"]
"""``auto``: page-lock CPU-resident weights in place (``cuMemHostRegister``, read-only) and copy
them straight to the device, falling back to the pinned ring where the driver refuses (logged
once at INFO); ``register``: the same, but a refusal is a warning; ``ring``: always copy
through the pinned ring (disk weights always go through it)."""

STAGING_MODES: tuple[str, ...] = get_args(StagingMode)
DEFAULT_STAGING_MODE: StagingMode = "auto"
STAGING_ENV = ACCEL_OFFLOAD_STAGING
COPY_THREADS_ENV = ACCEL_OFFLOAD_COPY_THREADS
MAX_DEFAULT_COPY_THREADS = 4
"""The default number of ring-filling threads is ``min(4, CPUs)``: each memcpy thread moves
several GB/s, and more would take cores from the compute on a busy machine."""


def resolve_staging_mode(value: str | None = None) -> StagingMode:
    """The staging mode: ``value``, else ``ACCEL_OFFLOAD_STAGING``, else ``auto``.

    Raises:
        ValueError: the value is not one of ``auto``, ``register``, ``ring`` (names where it
            came from).
    """
    source = "staging" if value is not None else STAGING_ENV
    raw = value if value is not None else read_variable(STAGING_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_STAGING_MODE
    mode = raw.strip().lower()
    if mode not in STAGING_MODES:
        raise ValueError(
            f"{source}={raw!r} is not a staging mode: use one of {', '.join(STAGING_MODES)} "
            f"(default {DEFAULT_STAGING_MODE}: page-lock CPU weights in place, else copy "
            "through a pinned ring)."
        )
    return mode  # type: ignore[return-value]


def resolve_copy_threads(value: int | None = None) -> int:
    """The number of ring-filling threads: ``value``, else the environment, else min(4, CPUs).

    Raises:
        ValueError: the value is not an int >= 1 (names where it came from).
    """
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"copy_threads={value!r} is not a thread count: use an int >= 1.")
        return value
    raw = read_variable(COPY_THREADS_ENV)
    if raw is None or not raw.strip():
        return max(1, min(MAX_DEFAULT_COPY_THREADS, os.cpu_count() or 1))
    try:
        parsed = int(raw.strip())
    except ValueError:
        parsed = 0
    if parsed < 1:
        raise ValueError(
            f"{COPY_THREADS_ENV}={raw!r} is not a thread count: set it to an int >= 1 or unset "
            f"it (default min({MAX_DEFAULT_COPY_THREADS}, CPUs))."
        )
    return parsed
