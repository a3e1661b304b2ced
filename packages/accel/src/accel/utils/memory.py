"""Accelerate's ``accelerate.utils.memory``, re-exported from the packages that own it.

Memory helpers (Accelerate's ``accelerate.utils.memory``).
"""

from __future__ import annotations

from accel.memory import (
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)
from accel_state.devices import (
    clear_device_cache,
)

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]
