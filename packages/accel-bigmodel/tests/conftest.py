"""Fixtures shared by accel-bigmodel's tests: every test leaves no state behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from accel_state.testing import clean_state


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons, destroy the process group and restore the environment."""
    with clean_state():
        yield


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-tensor tests (more threads only add waits on a
    busy machine); a module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
