"""Accelerate's ``accelerate.utils.tqdm``, re-exported from the packages that own it.

A progress bar on the local main process (Accelerate's ``accelerate.utils.tqdm``).
"""

from __future__ import annotations

from accel_state.logging import (
    tqdm,
)

__all__ = [
    "tqdm",
]
