"""Accelerate's ``accelerate.optimizer`` names, re-exported from accel-amp.

Re-export module only: ``AcceleratedOptimizer`` is implemented in :mod:`accel_amp`; this module
gives it its Accelerate import path.
"""

from __future__ import annotations

from accel_amp import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
