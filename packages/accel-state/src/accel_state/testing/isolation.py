"""Leaving no state behind between tests: singletons, process group, environment."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from accel_state.state import AcceleratorState, GradientState

__all__ = ["clean_state"]


@contextlib.contextmanager
def clean_state() -> Iterator[None]:
    """Run a block, then reset every singleton, destroy the process group, restore os.environ.

    Test suites wrap each test in it (an autouse fixture), so no test sees another's state.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
