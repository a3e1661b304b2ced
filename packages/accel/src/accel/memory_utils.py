"""Accelerate's deprecated ``accelerate.memory_utils``: importing it only warns, as there.

``find_executable_batch_size`` is in :mod:`accel` (and :mod:`accel.utils.memory`).
"""

from __future__ import annotations

import warnings

__all__: list[str] = []

warnings.warn(
    "accel.memory_utils (Accelerate's accelerate.memory_utils) is deprecated and holds nothing: "
    "import find_executable_batch_size from accel (or accel.utils.memory) instead",
    FutureWarning,
    stacklevel=2,
)
