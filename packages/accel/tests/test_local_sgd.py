"""``LocalSGD``: gradients stay local, weights are averaged every ``local_sgd_steps`` steps.

Two gloo ranks train on different data with plain SGD: inside the block their gradients must
differ (DDP's all-reduce is off), after every ``local_sgd_steps``-th step and on leaving the
block both ranks hold the mean of the weights they had just before, and in between they
drift apart again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from accel.accelerator import Accelerator
from accel.local_sgd import LocalSGD
from accel_state import gather_object
from accel_state.testing import run_on_cpu

STEPS = 5
EVERY = 2


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _train_with_local_sgd() -> dict[str, Any]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(10 + accelerator.process_index)  # own data
    before, after, grads = [], [], []
    with LocalSGD(accelerator, model, local_sgd_steps=EVERY) as local_sgd:
        for _ in range(STEPS):
            x = torch.randn(8, 3, generator=generator)
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            accelerator.backward(loss)
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist())
            optimizer.step()
            optimizer.zero_grad()
            before.append(_flat(model))
            local_sgd.step()
            after.append(_flat(model))
        inside = _flat(model)
    return {
        "wrapped": type(model).__name__,
        "before": gather_object([before]),
        "after": after,
        "grads": gather_object([grads]),
        "inside": inside,
        "exit": _flat(model),
    }


def _mean(a: list[float], b: list[float]) -> list[float]:
    return ((torch.tensor(a) + torch.tensor(b)) / 2).tolist()


@pytest.mark.multiprocess
def test_local_sgd_averages_every_k_steps_and_on_exit() -> None:
    ranks = run_on_cpu(_train_with_local_sgd, timeout=120)
    first, second = ranks
    assert first["wrapped"] == "DistributedDataParallel"
    grads = first["grads"]
    assert all(grads[0][step] != grads[1][step] for step in range(STEPS))  # no all-reduce
    before = first["before"]
    for step in range(STEPS):
        if (step + 1) % EVERY == 0:
            mean = _mean(before[0][step], before[1][step])
            assert first["after"][step] == second["after"][step]
            assert torch.allclose(torch.tensor(first["after"][step]), torch.tensor(mean))
        else:
            assert first["after"][step] == before[0][step]  # untouched between averages
            assert first["after"][step] != second["after"][step]
    assert first["inside"] != second["inside"]  # step 5 is not an averaging step ...
    assert first["exit"] == second["exit"]  # ... but leaving the block averages
    exit_mean = _mean(before[0][-1], before[1][-1])
    assert torch.allclose(torch.tensor(first["exit"]), torch.tensor(exit_mean))


def test_one_process_local_sgd_changes_nothing() -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    weights = _flat(model)
    with LocalSGD(accelerator, model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert local_sgd.enabled is False and local_sgd.num_steps == 1
    assert _flat(model) == weights


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_local_sgd_steps_must_be_a_positive_integer(steps: Any) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"LocalSGD\(local_sgd_steps="):
        LocalSGD(accelerator, model, local_sgd_steps=steps)
