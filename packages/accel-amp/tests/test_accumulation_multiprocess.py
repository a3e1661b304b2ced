"""Exact loss normalisation under DDP on 2 gloo ranks with different item counts per rank.

Each rank accumulates micro-batches of its own sizes; ``backward(loss_sum, num_items=n)``
must then give, on every rank, the gradient of the mean loss over the union of all ranks'
samples — what one process would compute on the whole data.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_amp import AcceleratedOptimizer, GradientAccumulationPlugin, GradientAccumulator
from accel_state import GradientState, PartialState
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess

# Micro-batch sizes per rank, two windows of num_steps=2: the ranks never hold equal counts.
SIZES = {0: [3, 5, 1, 4], 1: [2, 1, 6, 2]}
NUM_STEPS = 2


def _rank_data(rank: int, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sizes = SIZES[rank][window * NUM_STEPS : (window + 1) * NUM_STEPS]
    generator = torch.Generator().manual_seed(100 * rank + window)
    return [
        (
            torch.randn(n, 4, generator=generator, dtype=torch.float64),
            torch.randn(n, 2, generator=generator, dtype=torch.float64),
        )
        for n in sizes
    ]


def _ddp_exact_normalisation() -> dict[str, Any]:
    state = PartialState()
    rank, world = state.process_index, state.num_processes
    torch.manual_seed(0)  # the same initial weights on every rank
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(torch.float64)
    reference = copy.deepcopy(base)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    GradientState(GradientAccumulationPlugin(num_steps=NUM_STEPS))
    model = DistributedDataParallel(base)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    acc = GradientAccumulator(optimizers=[optimizer])

    grads, ref_grads, losses, ref_losses, items = [], [], [], [], []
    for window in range(len(SIZES[rank]) // NUM_STEPS):
        for x, y in _rank_data(rank, window):
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y, reduction="sum")
                acc.backward(loss, num_items=y.numel())
                if acc.sync_gradients:
                    grads.append([p.grad.tolist() for p in model.parameters()])
                    losses.append(float(acc.last_window_loss))
                    items.append(float(acc.last_window_items))
                optimizer.step()
                optimizer.zero_grad()

        # One process, the union of every rank's samples, the mean loss.
        union = [batch for r in range(world) for batch in _rank_data(r, window)]
        x_all = torch.cat([x for x, _ in union])
        y_all = torch.cat([y for _, y in union])
        ref_loss = F.mse_loss(reference(x_all), y_all)
        ref_loss.backward()
        ref_grads.append([p.grad.tolist() for p in reference.parameters()])
        ref_losses.append(float(ref_loss.detach()))
        ref_optimizer.step()
        ref_optimizer.zero_grad()

    # Plain lists: tensors would travel through shared memory that dies with the rank.
    return {
        "grads": grads,
        "ref_grads": ref_grads,
        "losses": losses,
        "ref_losses": ref_losses,
        "items": items,
        "params": [p.tolist() for p in model.module.parameters()],
        "ref_params": [p.tolist() for p in reference.parameters()],
    }


def _assert_close(got: Any, want: Any) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=1e-12,
        atol=1e-14,
    )


def test_num_items_under_ddp_equals_the_single_process_union_gradient() -> None:
    results = run_on_cpu(_ddp_exact_normalisation, world_size=2)
    windows = len(SIZES[0]) // NUM_STEPS
    expected_items = [
        2.0 * sum(SIZES[r][w * NUM_STEPS + s] for r in SIZES for s in range(NUM_STEPS))
        for w in range(windows)
    ]
    for rank, result in enumerate(results):
        assert len(result["grads"]) == windows, f"rank {rank}"
        for window in range(windows):
            for got, want in zip(result["grads"][window], result["ref_grads"][window], strict=True):
                _assert_close(got, want)
        assert result["items"] == expected_items, f"rank {rank}"
        for got_loss, want_loss in zip(result["losses"], result["ref_losses"], strict=True):
            assert got_loss == pytest.approx(want_loss, rel=1e-12)
        for got, want in zip(result["params"], result["ref_params"], strict=True):
            _assert_close(got, want)
