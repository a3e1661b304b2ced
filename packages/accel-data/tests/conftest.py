"""Fixtures shared by accel-data's tests: every test leaves no state behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from accel_state import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons, destroy the process group and restore the environment."""
    saved = dict(os.environ)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
