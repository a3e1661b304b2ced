"""``Accelerator.resume()``: one call that starts a run or continues it from its newest checkpoint.

A run that stops at any step (here: the loop is abandoned, and a new Accelerator is built, as
a restarted process does) and calls ``resume()`` again ends with weights bit-identical to a run
that never stopped, losing at most the steps since the last checkpoint. 2 processes, and
``accel launch --max_restarts`` killing ranks with SIGKILL, are in
``tests-integration/test_auto_resume_launch.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.auto_resume import Resumed
from accel.checkpointing import CheckpointError
from accel.handlers import ProjectConfiguration
from accel_state import AcceleratorState, GradientState

EPOCHS = 3
EVERY = 4  # micro-batches between checkpoints
BATCHES_PER_EPOCH = 6  # 24 samples, batch 4


class _Stop(Exception):
    """The simulated crash."""


def _accelerator(project: Path, **config: Any) -> Accelerator:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    project_config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, **config
    )
    return Accelerator(cpu=True, project_config=project_config, gradient_accumulation_steps=2)


def _run(project: Path, stop_at: int | None = None, **config: Any) -> tuple[Resumed, Any]:
    """Train EPOCHS epochs from wherever the project stands; stop after ``stop_at`` steps."""
    accelerator = _accelerator(project, **config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES_PER_EPOCH * 4, 4, generator=generator)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    resumed = accelerator.resume()
    seen = resumed.batches_seen
    for epoch in range(resumed.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen += 1
            if seen % EVERY == 0:
                accelerator.save_state()
            if seen == stop_at:
                return resumed, None
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return resumed, weights


def _equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_a_fresh_start_loads_nothing(tmp_path: Path) -> None:
    resumed, weights = _run(tmp_path)
    assert not resumed and resumed == Resumed(None)
    assert weights is not None


@pytest.mark.parametrize("stops", [(7,), (5, 9, 14)], ids=["once", "three-times"])
def test_stopping_anywhere_and_resuming_is_bit_identical(
    tmp_path: Path, stops: tuple[int, ...]
) -> None:
    _, expected = _run(tmp_path / "straight")
    project = tmp_path / "stopped"
    previous = 0
    for stop in stops:
        resumed, _ = _run(project, stop_at=stop)
        assert resumed.batches_seen == previous  # the last checkpoint before the last stop
        previous = stop - stop % EVERY
    resumed, weights = _run(project)
    assert resumed and resumed.batches_seen == previous
    assert stops[-1] - resumed.batches_seen < EVERY  # at most one checkpoint interval lost
    # The epoch of the checkpoint's last batch (its loader then yields what is left of it).
    assert resumed.epoch == (previous - 1) // BATCHES_PER_EPOCH
    assert resumed.checkpoint is not None and resumed.checkpoint.endswith(
        f"checkpoint_{previous // EVERY - 1}"
    )
    assert weights is not None
    _equal(weights, expected)


def test_a_newest_checkpoint_that_does_not_verify_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, stop_at=9)  # checkpoints after steps 4 and 8
    newest = tmp_path / "checkpoints" / "checkpoint_1"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with caplog.at_level(logging.WARNING, logger="accel.checkpointing"):
        resumed, _ = _run(tmp_path, stop_at=9)
    assert resumed.checkpoint is not None and resumed.checkpoint.endswith("checkpoint_0")
    assert resumed.batches_seen == 4 and len(resumed.skipped) == 1
    assert "checkpoint_1" in caplog.text and "model.safetensors" in caplog.text
    # The next save takes a new number: the skipped checkpoint stays for inspection.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_resume_needs_automatic_naming_and_prepared_objects(tmp_path: Path) -> None:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plain = Accelerator(cpu=True)
    plain.prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"automatic_checkpoint_naming=True"):
        plain.resume()
    with pytest.raises(ValueError, match=r"after accelerator.prepare"):
        _accelerator(tmp_path).resume()


def test_a_checkpoint_of_another_model_is_refused_not_skipped(tmp_path: Path) -> None:
    _run(tmp_path, stop_at=4)
    accelerator = _accelerator(tmp_path)
    accelerator.prepare(nn.Linear(3, 3), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1))
    with pytest.raises(CheckpointError):
        accelerator.resume()
