"""Accelerate's ``accelerate.scheduler`` names, re-exported from accel-amp.

Re-export module only: ``AcceleratedScheduler`` is implemented in :mod:`accel_amp`; this module
gives it its Accelerate import path.
"""

from __future__ import annotations

from accel_amp import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
