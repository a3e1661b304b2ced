"""Fixtures shared by accel-bigmodel's tests: every test leaves no state behind.

Test files are imported with ``--import-mode=importlib`` and cannot import one another, so the
small models several files share come from fixtures here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

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


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-tensor tests (more threads only add waits on a
    busy machine); a module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ModelForTest(nn.Module):
    """Accelerate's test model: 236 bytes in float32 (linear1 64, batchnorm 72, linear2 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


@pytest.fixture
def model_for_test() -> type[nn.Module]:
    """The class ``ModelForTest`` (its name matters: tests name it in no-split lists)."""
    return ModelForTest
