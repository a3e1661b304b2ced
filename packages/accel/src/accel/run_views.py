"""The ``Accelerator``'s read-through API: properties and helpers that ask the run's state.

Accelerate's ``Accelerator`` answers many questions by passing them on: who and where this
process is, how loaders are configured, where the accumulation window stands, and the
process helpers and collectives of ``PartialState``. :class:`RunViews` holds those one-line
delegations, so that :mod:`accel.accelerator` holds what the Accelerator does itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from accel_data import DataLoaderConfiguration
from accel_state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    gather,
    pad_across_processes,
    reduce,
)
from accel_state.accumulation_plan import parse_accumulation_steps

from .engines import Engine
from .handlers import ProjectConfiguration

if TYPE_CHECKING:
    from .engines.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["RunViews"]


class RunViews:
    """Properties and helpers of the ``Accelerator`` that read its state, loaders and engine."""

    state: AcceleratorState
    engine: Engine
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    gradient_state: GradientState

    # --- who and where ----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """How the processes are connected."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Number of processes in the run."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """Global rank of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its machine."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """Whether this is the global main process."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the main process of its machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest rank."""
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        """Whether several processes take part."""
        return self.state.use_distributed

    @property
    def multi_device(self) -> bool:
        """Whether the run uses several GPU-like devices (CPU processes are not)."""
        return self.engine.multi_device

    @property
    def mixed_precision(self) -> str:
        """The mixed precision of the run."""
        return self.state.mixed_precision

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2."""
        return self.engine.is_fsdp2

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeed plugin (None outside DeepSpeed)."""
        return self.engine.deepspeed_plugin

    @property
    def deepspeed_engine_wrapped(self) -> Any:
        """Under DeepSpeed, the wrapper of the first prepared model's engine (else None).

        Each prepared model keeps its own engine; ``backward`` picks the one that trains.
        """
        return getattr(self.engine, "deepspeed_engine_wrapped", None)

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        """The FSDP2 settings of the run (None without FSDP)."""
        plugin: FullyShardedDataParallelPlugin | None = self.state.fsdp_plugin
        return plugin

    @property
    def project_dir(self) -> str | None:
        """Root folder of the run."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Folder where trackers write."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Number of the next automatic checkpoint."""
        return self.project_configuration.iteration

    # --- data loader configuration ----------------------------------------------------------

    @property
    def split_batches(self) -> bool:
        """Whether each original batch is split between the processes."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """Whether rank 0 reads and dispatches batches (``None``: iterable data only)."""
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """Whether the last round is completed so every process gets a batch."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """Whether random samplers are replaced by seedable ones."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """Accepted for compatibility: every prepared loader has ``state_dict()``."""
        return self.dataloader_config.use_stateful_dataloader

    # --- gradient accumulation --------------------------------------------------------------

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch completes an accumulation window."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        # A value set here enters here: parsed once, with the one grammar, into the plan.
        steps = parse_accumulation_steps(value, "gradient_accumulation_steps")
        self.gradient_state.plan = dataclasses.replace(self.gradient_state.plan, steps=steps)

    @property
    def step(self) -> int:
        """Micro-batch counter of the accumulation state machine (0 after each epoch)."""
        return self.gradient_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_state.step = int(value)

    # --- process helpers (delegated to the state) ------------------------------------------

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """Give each process its share of ``inputs`` for the block."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: run ``function`` on the main process only."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: run ``function`` on each machine's main process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Any:
        """Decorator: run ``function`` on the last process only."""
        return self.state.on_last_process(function)

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Any:
        """Decorator: run ``function`` on the process with rank ``process_index`` only."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run ``function`` on the process with this local rank only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the main process first, then on the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on each machine's main process first, then on the others."""
        return self.state.local_main_process_first()

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on each machine's main process only."""
        self.state.print(*args, **kwargs)

    # --- collectives ----------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or a structure of tensors) from every process."""
        return gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` across processes (``"sum"``, ``"mean"``, ``"max"``, ``"min"``)."""
        return reduce(tensor, reduction=reduction, scale=scale)  # type: ignore[arg-type]

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad ``tensor`` along ``dim`` to the largest size on any process."""
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)
