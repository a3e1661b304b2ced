"""Exact resume of a DDP run on 2 gloo CPU ranks through ``save_state`` / ``load_state``.

A shuffled (seedable sampler), dropout, 2-step-accumulating loop is stopped after ``k``
micro-steps, checkpointed, rebuilt from scratch (fresh ``AcceleratorState`` and
``GradientState``, same seeds, same process group) and resumed from the checkpoint. The final
weights must equal those of an uninterrupted 2-rank run bit for bit, on both ranks, also when
each rank names a folder of its own (as with a ``tempfile.TemporaryDirectory()`` per process).
One ``run_on_cpu`` call covers every case (a start costs seconds).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.handlers import ProjectConfiguration
from accel_data import DataLoaderConfiguration
from accel_state import AcceleratorState, GradientState
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess

NUM_SAMPLES = 40  # 5 batches of 4 per rank: epochs and windows of 2 do not line up
PER_RANK_BATCH = 4
TOTAL_MICRO_STEPS = 24
STOPS = (7, 18)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


def _model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def _run(
    project_dir: str, stop_at: int | None, resume: bool, folder: str | None = None
) -> dict[str, Any]:
    """Train; checkpoint at ``stop_at`` (into ``folder``, else with automatic naming)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=folder is None
        ),
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    loader = DataLoader(TensorDataset(x, y), batch_size=PER_RANK_BATCH, shuffle=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    random.seed(accelerator.process_index)
    torch.manual_seed(100 + accelerator.process_index)  # dropout masks differ between ranks
    if resume:
        accelerator.load_state(folder)
    while counter.n < TOTAL_MICRO_STEPS:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            counter.n += 1
            if counter.n == stop_at:
                path = accelerator.save_state(folder)
                return {
                    "wrapped": type(model).__name__,
                    "files": sorted(p.name for p in Path(path).iterdir()),
                }
            if counter.n == TOTAL_MICRO_STEPS:
                break
    return {
        "params": [
            p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()
        ]
    }


def _resume_all(base: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "reference": _run(os.path.join(base, "reference"), None, False),
        "initial": [p.detach().flatten().tolist() for p in _model().parameters()],
    }
    for stop_at in STOPS:
        directory = os.path.join(base, f"stop{stop_at}")
        out[f"saved{stop_at}"] = _run(directory, stop_at, False)
        out[f"resumed{stop_at}"] = _run(directory, None, True)
    own = os.path.join(base, f"own_folder_of_rank_{torch.distributed.get_rank()}")
    out["saved_own"] = _run(base, STOPS[0], False, folder=own)
    out["resumed_own"] = _run(base, None, True, folder=own)
    out["recipe"] = _skip_recipe(os.path.join(base, "recipe"))
    return out


def _recipe_loader() -> tuple[Accelerator, Any]:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    loader = DataLoader(list(range(NUM_SAMPLES)), batch_size=PER_RANK_BATCH, shuffle=True)
    return accelerator, accelerator.prepare(loader)


def _skip_recipe(folder: str, saved_after: int = 2) -> dict[str, Any]:
    """Accelerate's recipe: load_state, then skip_first_batches for the resumed epoch."""

    def epochs(loader: Any, first: Any = None) -> list[list[list[int]]]:
        out = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            active = first if epoch == 0 and first is not None else loader
            out.append([batch.tolist() for batch in active])
        return out

    _, loader = _recipe_loader()
    expected = epochs(loader)
    accelerator, loader = _recipe_loader()
    loader.set_epoch(0)
    for index, _ in enumerate(loader):
        if index == saved_after - 1:
            accelerator.save_state(folder)
            break
    accelerator, loader = _recipe_loader()
    accelerator.load_state(folder)
    got = epochs(loader, first=accelerator.skip_first_batches(loader, saved_after))
    return {"expected": expected, "got": got, "saved_after": saved_after}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("ddp_resume")
    return run_on_cpu(_resume_all, os.fspath(base), timeout=120)


def test_checkpoint_holds_every_ranks_random_states(ranks: list[dict[str, Any]]) -> None:
    for stop_at in STOPS:
        saved = ranks[0][f"saved{stop_at}"]
        assert saved["wrapped"] == "DistributedDataParallel"
        assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(
            saved["files"]
        )
    # Windows restart each epoch (5 batches: sync after 2, 4, 5). 18 = epoch 4, batch 3: mid
    # window, so both ranks' partial gradients are kept; 7 = epoch 2, batch 2: window closed.
    grads = {"accel_gradients_0.safetensors", "accel_gradients_1.safetensors"}
    assert grads <= set(ranks[0]["saved18"]["files"])
    assert not grads & set(ranks[0]["saved7"]["files"])


@pytest.mark.parametrize("stop_at", STOPS)
def test_two_rank_resume_is_bit_exact(ranks: list[dict[str, Any]], stop_at: int) -> None:
    first, second = ranks
    reference = first["reference"]["params"]
    assert second["reference"]["params"] == reference
    assert reference != first["initial"]
    assert first[f"resumed{stop_at}"]["params"] == reference
    assert second[f"resumed{stop_at}"]["params"] == reference


def test_a_folder_per_rank_gets_a_complete_checkpoint(ranks: list[dict[str, Any]]) -> None:
    """Each folder holds the shared files and its own rank's states; resume is bit-exact."""
    reference = ranks[0]["reference"]["params"]
    for rank, outcome in enumerate(ranks):
        files = set(outcome["saved_own"]["files"])
        assert {"model.safetensors", "optimizer.bin", f"random_states_{rank}.pkl"} <= files
        assert f"random_states_{1 - rank}.pkl" not in files
        assert outcome["resumed_own"]["params"] == reference


def test_load_state_then_skip_first_batches_skips_once_on_two_ranks(
    ranks: list[dict[str, Any]],
) -> None:
    for outcome in ranks:
        recipe = outcome["recipe"]
        expected, got, k = recipe["expected"], recipe["got"], recipe["saved_after"]
        assert got[0] == expected[0][k:]
        assert got[1] == expected[1] and len(got[1]) == NUM_SAMPLES // (2 * PER_RANK_BATCH)
