"""Runs that resume themselves: :meth:`Accelerator.resume` and what it returns.

A script calls ``accelerator.resume()`` once, after ``prepare``. With automatic checkpoint
naming it loads the newest complete ``checkpoint_<n>`` of the project (everything
``load_state`` restores: weights, optimizers, schedulers, loader positions, random states,
accumulation state), or does nothing on a fresh start, and says where the run stands. The same
command then works for the first launch, after ``accel launch --max_restarts`` restarts the
processes, after a SLURM requeue and after a manual rerun.

A newest checkpoint whose manifest does not match its files (a truncated or deleted file) is
skipped with a warning naming the problem, and the one before it is used; every process uses
the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from accel_state import PartialState, gather_object

from .checkpointing import CheckpointError, numbered_checkpoints, verify_checkpoint
from .run_state import RunState

__all__ = [
    "Resumed",
    "choose_checkpoint",
    "loader_position",
    "log_skipped",
    "skip_numbers_in_use",
]

logger = logging.getLogger("accel.checkpointing")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a run stands after :meth:`Accelerator.resume`.

    It is true when a checkpoint was loaded: ``if accelerator.resume(): ...``.

    Attributes:
        checkpoint: the checkpoint directory loaded (``None``: a fresh start).
        epoch: the epoch to continue: the first prepared data loader's epoch (the loader
            itself resumes in the middle of it: ``for epoch in range(resumed.epoch, n)``); 0
            on a fresh start or without a loader.
        batches_seen: the batches of that loader already trained on, all epochs together
            (``epoch * len(loader)`` + the position in the resumed epoch): the loop's global
            batch counter; 0 on a fresh start, without a loader or for one without a length.
        step: ``accelerator.step`` after loading (Accelerate's counter of micro-batches in the
            current accumulation cycle, reset at each epoch's end).
        skipped: the newer checkpoints that were skipped, with why.
    """

    checkpoint: str | None
    epoch: int = 0
    batches_seen: int = 0
    step: int = 0
    skipped: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.checkpoint is not None


def choose_checkpoint(run: RunState) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of the project every process can verify, and those skipped.

    Raises:
        ValueError: automatic checkpoint naming is off or there is no project directory (the
            message names the fix).
    """
    config = run.project_configuration
    if not config.automatic_checkpoint_naming or run.project_dir is None:
        raise ValueError(
            "resume() continues from the project's numbered checkpoints: pass "
            "project_config=ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True) to the Accelerator (and save with "
            "save_state()), or call load_state(path) with a checkpoint directory"
        )
    base = Path(run.project_dir) / "checkpoints"
    skipped: list[str] = []
    chosen: Path | None = None
    for _, directory in reversed(numbered_checkpoints(base)):
        try:
            verify_checkpoint(directory)
        except CheckpointError as error:
            skipped.append(f"{directory}: {error}")
            continue
        chosen = directory
        break
    return _agree(chosen), skipped


def _agree(chosen: Path | None) -> Path | None:
    """The oldest of the processes' choices, so that every process loads the same one.

    Raises:
        CheckpointError: some processes found a checkpoint and others none (the checkpoint
            folder is not shared by all of them).
    """
    state = PartialState()
    if state.num_processes == 1:
        return chosen
    choices = gather_object([None if chosen is None else os.fspath(chosen)])
    found = [Path(str(choice)) for choice in choices if choice is not None]
    if not found:
        return None
    if len(found) != len(choices):
        missing = [rank for rank, choice in enumerate(choices) if choice is None]
        raise CheckpointError(
            f"resume(): processes {missing} find no complete checkpoint where process "
            f"{choices.index(os.fspath(found[0]))} found {found[0]}: the project directory "
            "must be one folder every process sees (a shared file system), or pass the "
            "checkpoint to load_state() on each process"
        )
    return min(found, key=_number)


def _number(directory: Path) -> int:
    return int(directory.name.rsplit("_", 1)[-1])


def loader_position(dataloaders: list[Any]) -> tuple[int, int]:
    """``(epoch, batches seen)`` of the first prepared loader that knows its epoch.

    ``(0, 0)`` without one; the batches seen are 0 for a loader without a length.
    """
    for loader in dataloaders:
        epoch = getattr(loader, "iteration", None)
        if not isinstance(epoch, int):
            continue
        offset = getattr(loader, "resume_offset", None)
        position = int(offset()) if callable(offset) else 0
        try:
            length = len(loader)
        except TypeError:
            return epoch, 0
        return epoch, epoch * length + position
    return 0, 0


def log_skipped(skipped: list[str]) -> None:
    """Warn once per skipped checkpoint, naming what was wrong with it."""
    for entry in skipped:
        logger.warning(f"resume(): skipping a checkpoint that does not verify: {entry}")


def skip_numbers_in_use(run: RunState) -> None:
    """Make the next automatic save number follow every ``checkpoint_<n>`` on disk.

    A skipped newer checkpoint keeps its directory (for inspection), so the next save must not
    reuse its number.
    """
    config = run.project_configuration
    if run.project_dir is None:
        return
    existing = numbered_checkpoints(Path(run.project_dir) / "checkpoints")
    if existing:
        config.iteration = max(config.iteration, existing[-1][0] + 1)
