"""Fixtures shared by accel-bigmodel's tests: every test leaves no state behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accel_state.testing import clean_state


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons, destroy the process group and restore the environment."""
    with clean_state():
        yield
