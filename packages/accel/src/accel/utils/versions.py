"""Accelerate's ``accelerate.utils.versions``, re-exported from the packages that own it.

Version comparisons (Accelerate's ``accelerate.utils.versions``).
"""

from __future__ import annotations

from accel_state.imports import (
    compare_versions,
    is_torch_version,
)

__all__ = [
    "compare_versions",
    "is_torch_version",
]
