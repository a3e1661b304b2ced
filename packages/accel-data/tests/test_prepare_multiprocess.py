"""prepare_data_loader on 2 real processes when the caller passes no rng_types."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from accel_data import prepare_data_loader
from accel_state import PartialState
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess


def _shuffled_without_rng_types() -> list[list[int]]:
    state = PartialState()
    torch.manual_seed(1000 + state.process_index)  # different global generators per rank
    loader = prepare_data_loader(DataLoader(list(range(24)), batch_size=4, shuffle=True))
    return [[int(x) for x in batch] for epoch in range(2) for batch in loader]


def test_fresh_sampler_generator_is_shared_so_shards_do_not_overlap() -> None:
    first, second = run_on_cpu(_shuffled_without_rng_types)
    for epoch in range(2):
        mine = first[epoch * 3 : epoch * 3 + 3] + second[epoch * 3 : epoch * 3 + 3]
        assert sorted(x for batch in mine for x in batch) == list(range(24))
    assert first[:3] != first[3:]  # the epochs are shuffled differently
