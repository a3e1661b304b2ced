"""What a checkpoint saves and restores: the run's prepared objects and their owners.

The Accelerator hands checkpointing a :class:`RunState` instead of itself, so checkpointing
reads public state only (the state dicts of accel-amp's accumulator and accel-state's
``GradientState``) and does not depend on the Accelerator's internals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from accel_amp import GradientAccumulator
from accel_state import GradientState, PartialState

from .engines import Engine
from .handlers import ProjectConfiguration

__all__ = ["RunState"]


@dataclasses.dataclass(frozen=True)
class RunState:
    """The prepared objects of a run and what their checkpoint needs.

    Attributes:
        models, optimizers, schedulers, dataloaders: The prepared objects, in prepare order.
        custom_objects: Objects registered with ``register_for_checkpointing``.
        scaler: The fp16 ``GradScaler`` or None.
        gradient_state: The accumulation state machine.
        accumulator: The gradient accumulator (its open window's normalisation state).
        project_configuration: Directories, automatic naming and rotation.
        engine: The training engine (how models and optimizers are stored).
        save_pre_hooks, load_pre_hooks: Hooks registered on the Accelerator.
        device: This process's device.
    """

    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    dataloaders: list[Any]
    custom_objects: list[Any]
    scaler: Any
    gradient_state: GradientState
    accumulator: GradientAccumulator
    project_configuration: ProjectConfiguration
    engine: Engine
    save_pre_hooks: list[Callable[..., Any]]
    load_pre_hooks: list[Callable[..., Any]]
    device: torch.device

    @property
    def project_dir(self) -> str | None:
        """Root folder of the run."""
        return self.project_configuration.project_dir

    @staticmethod
    def wait_for_everyone() -> None:
        """Barrier over every process."""
        PartialState().wait_for_everyone()
