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


def _tensor_parallel_peers() -> dict[str, list[list[int]]]:
    from torch.distributed.device_mesh import init_device_mesh

    state = PartialState()
    torch.manual_seed(1000 + state.process_index)  # different global generators per rank
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    data = DataLoader(list(range(24)), batch_size=4, shuffle=True)
    shard = prepare_data_loader(data, torch_device_mesh=mesh)
    dispatched = prepare_data_loader(
        DataLoader(list(range(24)), batch_size=4),
        torch_device_mesh=mesh,
        put_on_device=True,
        dispatch_batches=True,
    )
    return {
        "shard": [[int(x) for x in batch] for epoch in range(2) for batch in shard],
        "dispatched": [[int(x) for x in batch] for batch in dispatched],
    }


def test_tensor_parallel_peers_read_the_same_batches_sharded_or_dispatched() -> None:
    """A mesh of one ``tp`` dimension is one data shard: both ranks get every batch alike."""
    first, second = run_on_cpu(_tensor_parallel_peers)
    assert first == second
    assert sorted(x for batch in first["shard"][:6] for x in batch) == list(range(24))
    assert first["shard"][:6] != first["shard"][6:]  # each epoch shuffled anew, alike
    assert first["dispatched"] == [list(range(i, i + 4)) for i in range(0, 24, 4)]
