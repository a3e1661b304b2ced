"""Fixtures shared by accel's tests: every test leaves no state behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accel_state.testing import clean_state


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons and the process group; fail on leaked variables or threads."""
    with clean_state(check_leaks=True):
        yield
