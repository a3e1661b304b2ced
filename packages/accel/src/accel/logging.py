"""Accelerate's ``accelerate.logging`` names, re-exported from accel-state.

Re-export module only: the multi-process logger adapter is implemented in
:mod:`accel_state.logging`; this module gives it its Accelerate import path. Imports in accel
are absolute, so ``import logging`` elsewhere in the package still means the standard library.
"""

from __future__ import annotations

from accel_state import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
