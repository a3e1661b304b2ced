"""Test helpers for accel packages: run a function on several CPU processes, skip reasons.

Importing this module does not import pytest.
"""

from __future__ import annotations

from .isolation import LeakError, clean_state, restored_variables
from .launch import MultiProcessError, free_port, run_on_cpu
from .requirements import require_reasons

__all__ = [
    "LeakError",
    "MultiProcessError",
    "clean_state",
    "free_port",
    "require_reasons",
    "restored_variables",
    "run_on_cpu",
]
