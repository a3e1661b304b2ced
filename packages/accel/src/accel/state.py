"""Accelerate's ``accelerate.state`` names, re-exported from accel-state.

Re-export module only: the shared process, accelerator and gradient state are implemented in
:mod:`accel_state`; this module gives them their Accelerate import path.
"""

from __future__ import annotations

from accel_state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    PartialState,
    is_initialized,
)

__all__ = [
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "PartialState",
    "is_initialized",
]
