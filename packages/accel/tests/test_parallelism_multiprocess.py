"""ParallelismConfig on gloo CPU ranks: DDP, FSDP2 and HSDP on a named mesh train like one process.

Oracle: a plain single-process torch loop over the global batch (every rank's micro-batches of
a window, averaged), AdamW, clipping at 1.0. On 2 ranks: ``dp_shard_size=2`` (FSDP2 over the
mesh's ``dp_shard_cp``) and ``dp_replicate_size=2`` (DDP); on 4 ranks: ``dp_replicate_size=2 x
dp_shard_size=2`` (HSDP over the 2-D mesh) and the default (every size 1 -> 4 replicas). Each
must end with the oracle's weights within ``TOLERANCE``; the ranks along the mesh are those of
the layout; ``save_state`` / ``load_state`` under HSDP restore weights and optimizer exactly;
``end_training`` leaves no gloo thread. Every bad layout is refused before any process group
exists (``test_parallelism.py`` covers them in one process).
"""

from __future__ import annotations

import functools
import gc
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel import Accelerator, ParallelismConfig
from accel.utils import FullyShardedDataParallelPlugin
from accel_state import AcceleratorState, GradientState
from accel_state.testing import run_on_cpu

# Each run lays out FSDP2 meshes beside the others: on the floor (torch 2.5) it is skipped.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_feature("fully_shard")]

NUM_SAMPLES = 64
PER_RANK_BATCH = 4
ACCUMULATION = 2
LR = 0.05
TOLERANCE = 2e-6  # reduce-scatter / all-reduce: float sums in another order


class Block(nn.Module):
    """One residual layer: the unit TRANSFORMER_BASED_WRAP shards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """Input layer, two blocks in a ModuleList, output head (test_fsdp2_multiprocess's model)."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _model() -> Net:
    torch.manual_seed(3)
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return x, y


def _loader() -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*_data()), batch_size=PER_RANK_BATCH
    )


def _weights(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


@functools.cache
def _reference(world: int) -> dict[str, list[float]]:
    """One process: each step sees the window of all ``world`` data-parallel ranks."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_step = PER_RANK_BATCH * world * ACCUMULATION
    for start in range(0, NUM_SAMPLES, per_step):
        loss = torch.zeros(())
        for k in range(ACCUMULATION):
            for rank in range(world):  # rank r's k-th micro-batch: batch k * world + r
                index = start // PER_RANK_BATCH + k * world + rank
                ids = slice(index * PER_RANK_BATCH, (index + 1) * PER_RANK_BATCH)
                loss = loss + F.mse_loss(model(x[ids]), y[ids]) / (world * ACCUMULATION)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model.state_dict())


def _difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(u - v) for key in a for u, v in zip(a[key], b[key], strict=True))


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(config: ParallelismConfig, fsdp: bool) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    return Accelerator(
        gradient_accumulation_steps=ACCUMULATION,
        parallelism_config=config,
        fsdp_plugin=plugin if fsdp else None,
    )


def _epoch(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> None:
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()


def _full(accelerator: Accelerator, model: Any) -> dict[str, list[float]]:
    return _weights(accelerator.get_state_dict(model))  # a collective under FSDP2


def _layout(
    config: ParallelismConfig, fsdp: bool, folder: str | None = None, last: bool = False
) -> dict[str, Any]:
    """Train one epoch with ``config``; report weights, mesh, ranks (and a save/load check).

    With ``last`` it ends the run (``end_training``) and reports the gloo threads left;
    otherwise it frees its objects and keeps the world group for the next layout (a world
    rebuilt in the same processes could read the old one's addresses from the store).
    """
    accelerator = _accelerator(config, fsdp)
    net = _model()
    model, optimizer, loader = accelerator.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=LR), _loader()
    )
    _epoch(accelerator, model, optimizer, loader)
    mesh = accelerator.torch_device_mesh
    fsdp_mesh = getattr(accelerator.engine, "mesh", None)
    result: dict[str, Any] = {
        "type": accelerator.distributed_type.value,
        "weights": _full(accelerator, model),
        "mesh": list(mesh.mesh_dim_names) if mesh is not None else None,
        "fsdp_mesh": list(fsdp_mesh.mesh_dim_names or ()) if fsdp else None,
        "ranks": [
            accelerator.data_parallel_rank,
            accelerator.data_parallel_shard_rank,
            accelerator.tensor_parallel_rank,
            accelerator.context_parallel_rank,
        ],
        "sizes": [config.dp_replicate_size, config.dp_shard_size],
    }
    if folder is not None:
        accelerator.save_state(folder)
        saved = result["weights"]
        xb, yb = next(iter(_loader()))
        steps = []
        for _ in range(2):  # one more step, then back to the save and the same step again
            accelerator.backward(F.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            steps.append(_full(accelerator, model))
            if len(steps) == 1:
                accelerator.load_state(folder)
                restored = _full(accelerator, model)
        if accelerator.is_main_process:  # the full state dict lives on rank 0
            result["restored"] = _difference(restored, saved)
            result["step-again"] = _difference(steps[0], steps[1])
    if not last:
        accelerator.free_memory()
        _reset()
        return result
    accelerator.end_training()
    del accelerator, net, model, optimizer, loader
    _reset()
    gc.collect()
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    result["gloo-threads"] = sorted(name for name in names if "gloo" in name)
    return result


def _two_ranks() -> dict[str, Any]:
    return {
        "shard": _layout(ParallelismConfig(dp_shard_size=2), fsdp=True),
        "replicate": _layout(ParallelismConfig(dp_replicate_size=2), fsdp=False),
    }


def _four_ranks(folder: str) -> dict[str, Any]:
    return {
        "hsdp": _layout(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), True, folder),
        "default": _layout(ParallelismConfig(), fsdp=False),
    }


@functools.cache
def _runs(world: int) -> list[dict[str, Any]]:
    if world == 2:
        return run_on_cpu(_two_ranks, world_size=2, timeout=240)
    with tempfile.TemporaryDirectory() as folder:
        return run_on_cpu(_four_ranks, folder, world_size=4, timeout=300)


def test_dp_shard_is_fsdp2_over_the_mesh_and_trains_like_one_process() -> None:
    runs = [rank["shard"] for rank in _runs(2)]
    assert {run["type"] for run in runs} == {"FSDP"}
    assert runs[0]["mesh"] == ["dp_shard"] and runs[0]["fsdp_mesh"] == ["dp_shard"]
    assert [run["ranks"] for run in runs] == [[0, 0, 0, 0], [0, 1, 0, 0]]
    assert _difference(runs[0]["weights"], _reference(2)) <= TOLERANCE


def test_dp_replicate_alone_is_ddp_and_trains_like_one_process() -> None:
    runs = [rank["replicate"] for rank in _runs(2)]
    assert {run["type"] for run in runs} == {"MULTI_CPU"}
    assert runs[0]["mesh"] == ["dp_replicate"]
    assert [run["ranks"] for run in runs] == [[0, 0, 0, 0], [1, 0, 0, 0]]
    assert _difference(runs[0]["weights"], _reference(2)) <= TOLERANCE


def test_hsdp_on_four_ranks_trains_like_one_process_and_resumes_exactly() -> None:
    runs = [rank["hsdp"] for rank in _runs(4)]
    assert {run["type"] for run in runs} == {"FSDP"}
    assert runs[0]["mesh"] == ["dp_replicate", "dp_shard"]
    assert runs[0]["fsdp_mesh"] == ["dp_replicate", "dp_shard"]  # HSDP: 2-D
    # rank = replicate * 2 + shard (row-major mesh)
    assert [run["ranks"][:2] for run in runs] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert _difference(runs[0]["weights"], _reference(4)) <= TOLERANCE
    assert runs[0]["restored"] == 0.0 and runs[0]["step-again"] == 0.0


def test_all_sizes_one_means_every_process_is_a_replica() -> None:
    runs = [rank["default"] for rank in _runs(4)]
    assert runs[0]["sizes"] == [4, 1] and runs[0]["mesh"] == ["dp_replicate"]
    assert [run["ranks"][0] for run in runs] == [0, 1, 2, 3]
    assert _difference(runs[0]["weights"], _reference(4)) <= TOLERANCE


def _ended(replicate: int, shard: int) -> list[str]:
    """The gloo threads left after one layout's run has ended and its objects are gone."""
    config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
    return _layout(config, fsdp=shard > 1, last=True)["gloo-threads"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_end_training_leaves_no_gloo_thread_of_the_mesh() -> None:
    """The mesh's groups (and FSDP2's 2-D view of it) do not reach interpreter exit."""
    assert run_on_cpu(_ended, 2, 1, world_size=2, timeout=120) == [[], []]  # DDP on the mesh
    assert run_on_cpu(_ended, 2, 2, world_size=4, timeout=180) == [[]] * 4  # HSDP
