"""Fixtures shared by accel-amp's tests: every test leaves no state behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accel_state.testing import clean_state, require_reasons


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the singletons and the process group; fail on leaked variables or threads."""
    with clean_state(check_leaks=True):
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``torch_feature(...)`` on a torch without those features."""
    for mark in item.iter_markers("torch_feature"):
        reasons = require_reasons(torch_features=tuple(mark.args))
        if reasons:
            pytest.skip("; ".join(reasons))
