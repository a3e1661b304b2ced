"""Accelerate's documented resume recipes, and checkpoints that must be refused clearly.

* ``load_state(folder)`` then ``skip_first_batches(loader, k)`` for the resumed epoch yields
  exactly the remaining batches of that epoch, then whole epochs (1 process here; 2 ranks in
  ``test_checkpointing_multiprocess.py``), with a seedable sampler or a plain shuffle.
* A registered object whose ``state_dict`` holds numpy scalars and arrays round-trips; one
  holding anything ``weights_only`` loading refuses is refused by ``save_state`` itself,
  naming the object and the fix, before any file is written.
* ``load_state`` on an empty or foreign folder says it is not a checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from accel.accelerator import Accelerator
from accel.checkpointing import CheckpointError
from accel_data import DataLoaderConfiguration
from accel_state import AcceleratorState, GradientState

NUM_SAMPLES = 40
BATCH = 2
SAVED_AFTER = 5  # batches of epoch 0 seen before the checkpoint


def _prepared(seedable: bool) -> tuple[Accelerator, Any]:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable)
    )
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(NUM_SAMPLES)), batch_size=BATCH, shuffle=True)
    _, _, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, loader


def _saved_mid_epoch(seedable: bool, folder: Path) -> list[list[list[int]]]:
    """The batches of an uninterrupted run; then a checkpoint after SAVED_AFTER batches."""
    _, loader = _prepared(seedable)
    expected = _epochs(loader)
    accelerator, loader = _prepared(seedable)
    loader.set_epoch(0)
    for index, _ in enumerate(loader):
        if index == SAVED_AFTER - 1:
            accelerator.save_state(folder)
            break
    return expected


def _epochs(loader: Any, first: Any = None, count: int = 2) -> list[list[list[int]]]:
    """``count`` epochs of ``loader``; the first one from ``first`` when given (the recipe)."""
    out = []
    for epoch in range(count):
        loader.set_epoch(epoch)
        active = first if epoch == 0 and first is not None else loader
        out.append([batch.tolist() for batch in active])
    return out


@pytest.mark.parametrize("seedable", [True, False], ids=["seedable", "shuffle"])
def test_load_state_then_skip_first_batches_yields_the_remaining_batches_once(
    tmp_path: Path, seedable: bool
) -> None:
    expected = _saved_mid_epoch(seedable, tmp_path / "checkpoint")
    accelerator, loader = _prepared(seedable)
    accelerator.load_state(tmp_path / "checkpoint")
    skipped = accelerator.skip_first_batches(loader, SAVED_AFTER)
    got = _epochs(loader, first=skipped)
    assert got[0] == expected[0][SAVED_AFTER:]
    assert got[1] == expected[1]  # the next epoch is whole (it lost its first k batches)


def test_load_state_alone_still_resumes_mid_epoch(tmp_path: Path) -> None:
    expected = _saved_mid_epoch(True, tmp_path / "checkpoint")
    accelerator, loader = _prepared(True)
    accelerator.load_state(tmp_path / "checkpoint")
    got = _epochs(loader)
    assert got == [expected[0][SAVED_AFTER:], expected[1]]


def test_skip_first_batches_at_another_position_is_honoured_with_a_warning(
    tmp_path: Path,
) -> None:
    expected = _saved_mid_epoch(True, tmp_path / "checkpoint")
    accelerator, loader = _prepared(True)
    accelerator.load_state(tmp_path / "checkpoint")
    with pytest.warns(UserWarning, match=r"restored 5 batches into epoch 0.*after 3 batches"):
        skipped = accelerator.skip_first_batches(loader, 3)
    assert _epochs(loader, first=skipped) == [expected[0][3:], expected[1]]


def test_a_checkpoint_saved_during_the_resumed_epoch_resumes_exactly(tmp_path: Path) -> None:
    expected = _saved_mid_epoch(True, tmp_path / "first")
    accelerator, loader = _prepared(True)
    accelerator.load_state(tmp_path / "first")
    skipped = accelerator.skip_first_batches(loader, SAVED_AFTER)
    for index, _ in enumerate(skipped):
        if index == 2:
            accelerator.save_state(tmp_path / "second")
            break
    accelerator, loader = _prepared(True)
    accelerator.load_state(tmp_path / "second")
    assert _epochs(loader) == [expected[0][SAVED_AFTER + 3 :], expected[1]]


# --- what a registered object may hold ----------------------------------------------------


class _NumpyState:
    """Keeps numpy values, as many metric and sampler helpers do."""

    def __init__(self) -> None:
        self.best = np.float64(0.25)
        self.steps = np.int64(7)
        self.flag = np.bool_(True)
        self.history = np.arange(5, dtype=np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "steps": self.steps, "flag": self.flag, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.steps = state["best"], state["steps"]
        self.flag, self.history = state["flag"], state["history"]


class _Opaque:
    """An arbitrary class instance: unpickling it could run code, so loading refuses it."""

    def __init__(self) -> None:
        self.value = 1


class _HoldsAnObject:
    def state_dict(self) -> dict[str, Any]:
        return {"inner": _Opaque()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def test_numpy_values_of_a_registered_object_round_trip(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    saved = _NumpyState()
    accelerator.register_for_checkpointing(saved)
    accelerator.save_state(tmp_path / "checkpoint")

    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    loaded = _NumpyState()
    loaded.best, loaded.steps, loaded.history = np.float64(0), np.int64(0), np.zeros(1)
    accelerator.register_for_checkpointing(loaded)
    accelerator.load_state(tmp_path / "checkpoint")
    assert loaded.best == np.float64(0.25) and type(loaded.best) is np.float64
    assert loaded.steps == 7 and type(loaded.steps) is np.int64
    assert loaded.flag is np.True_
    assert loaded.history.dtype == np.float32 and loaded.history.tolist() == [0, 1, 2, 3, 4]


def test_a_state_that_could_not_load_safely_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(_HoldsAnObject())
    target = tmp_path / "checkpoint"
    with pytest.raises(ValueError) as info:
        accelerator.save_state(target)
    message = str(info.value)
    assert "registered object 0 (_HoldsAnObject).state_dict()" in message
    assert "_Opaque" in message and "weights_only=True" in message
    assert "Return only such values from state_dict()" in message
    assert os.listdir(tmp_path) == []  # neither the folder nor a hidden partial one


# --- folders that are not checkpoints -----------------------------------------------------


@pytest.mark.parametrize("contents", [[], ["notes.txt"]], ids=["empty", "foreign"])
def test_load_state_on_a_folder_that_is_not_a_checkpoint_says_so(
    tmp_path: Path, contents: list[str]
) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in contents:
        (folder / name).write_text("not a checkpoint")
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="is not a checkpoint") as info:
        accelerator.load_state(folder)
    assert ("it is empty" if not contents else "it holds notes.txt") in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
