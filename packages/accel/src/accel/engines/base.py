"""The engine protocol: everything the Accelerator asks of the machinery that trains a model.

An engine turns a user's model into the model that trains (DDP, FSDP2, ...), and answers
every question whose answer depends on that: how gradient synchronisation is switched off
inside an accumulation window, over how many ranks gradients are averaged, how gradients
are clipped, what the model's state dict is, how a checkpoint stores the model and its
optimizer, and which ranks write model files. The Accelerator holds one engine, decided once
by ``AcceleratorState`` from the registry (``state.engine``, built by
:func:`accel.engines.select_engine`), and never branches on the distributed type or the
engine's class itself: it asks the engine's attributes and its protocols (:class:`JointSetup`).

:class:`Engine`'s defaults are one process on one device; subclasses override what differs.
Engines also satisfy accel-amp's ``GradientSync`` protocol (``no_sync``,
``grads_averaged_over``, ``clip_grad_norm_``, ``clip_grad_value_``), so the gradient
accumulator can drive them without importing this package.

Order of the model transforms (the engine owns it): fp8 conversion, the autocast forward,
placement on the device, the engine's wrapper (DDP), then ``torch.compile``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from accel.compilation import compile_regions
from accel.handlers import DistributedDataParallelKwargs, TorchDynamoPlugin
from accel.models import extract_model_from_parallel
from accel_amp import (
    AcceleratedOptimizer,
    DuckGradientSync,
    PrecisionPolicy,
    convert_model_to_fp8,
    get_grad_scaler,
    wrap_forward,
)
from accel_state import AcceleratorState, DistributedType
from accel_state.engine_requests import EngineSpec

if TYPE_CHECKING:
    from accel_amp import AORecipeKwargs, AutocastKwargs

    from .deepspeed_plugin import DeepSpeedPlugin
    from .fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["Engine", "EngineOptions", "JointSetup"]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What an engine is built from: the run's state and the Accelerator's settings.

    Attributes:
        state: The run's ``AcceleratorState`` (device, ranks, engine plugins).
        policy: The precision policy.
        dynamo_plugin: ``torch.compile`` settings.
        ddp_handler: ``DistributedDataParallelKwargs`` (DDP only).
        autocast_handler: ``AutocastKwargs`` for the autocast forward.
        ao_recipe_handler: FP8 recipe (``AORecipeKwargs``).
        fsdp_plugin: The FSDP2 settings (FSDP2 only).
        deepspeed_plugin: The DeepSpeed settings (DeepSpeed only).
        split_batches: Whether loaders split each batch across the processes (the DeepSpeed
            engine counts scheduler steps with it, as Accelerate does).
        engine: The registry row the state decided on (``state.engine``); None: the row of
            the state's distributed type.
    """

    state: AcceleratorState
    policy: PrecisionPolicy
    dynamo_plugin: TorchDynamoPlugin
    ddp_handler: DistributedDataParallelKwargs | None = None
    autocast_handler: AutocastKwargs | None = None
    ao_recipe_handler: AORecipeKwargs | None = None
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    deepspeed_plugin: DeepSpeedPlugin | None = None
    split_batches: bool = False
    engine: EngineSpec | None = None


@runtime_checkable
class JointSetup(Protocol):
    """An engine that builds a model, its optimizer and scheduler together (DeepSpeed).

    ``prepare`` hands it every model, optimizer and scheduler of the call at once, asks it
    which arguments are optimizers and schedulers (an engine may take placeholders for ones
    its own config defines), and registers what it returns.
    """

    def prepare_joint(
        self,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Any],
        schedulers: Sequence[Any],
        loaders: Sequence[Any],
        accumulation_steps: int,
    ) -> tuple[Any, Any, Any, int]:
        """Build model, optimizer and scheduler together.

        Returns:
            (the prepared model, the engine's optimizer or None, the engine's scheduler or
            None, the accumulation steps the run uses, which its config may set).
        """
        ...

    def is_joint_optimizer(self, obj: Any) -> bool:
        """Whether ``obj`` is an optimizer for :meth:`prepare_joint` (placeholders too)."""
        ...

    def is_joint_scheduler(self, obj: Any) -> bool:
        """Whether ``obj`` is a placeholder for a scheduler the engine's config defines."""
        ...

    def wrap_joint_scheduler(self, scheduler: Any, optimizers: Sequence[Any]) -> Any:
        """The prepared scheduler around one the engine steps itself."""
        ...


class Engine(DuckGradientSync):
    """One process on one device; the base every engine overrides where it differs.

    Args:
        options: The state and the Accelerator's settings.
    """

    #: Short name, shown in messages and ``repr``.
    name = "single device"
    #: Whether models are sharded with FSDP2 (Accelerate's ``accelerator.is_fsdp2``).
    is_fsdp2 = False
    #: Whether forwards run under ``torch.autocast`` when the policy casts (FSDP2 casts
    #: with its own ``MixedPrecisionPolicy`` instead).
    autocasts_forward = True
    #: Whether a prepared optimizer moves loaded state to the device (FSDP2's state is made
    #: of DTensor shards that stay where the engine put them).
    places_optimizer_state = True

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.state = options.state

    # --- what the run is ---------------------------------------------------------------

    @property
    def distributed_type(self) -> DistributedType:
        """The distributed type this engine trains under."""
        return self.state.distributed_type

    @property
    def multi_device(self) -> bool:
        """Whether the run spans several GPU-like devices (CPU processes are not)."""
        return False

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeed plugin (None outside DeepSpeed)."""
        return None

    @property
    def places_batches(self) -> bool:
        """Whether prepared loaders move batches to the device by default."""
        return True

    def grad_scaler(self, **kwargs: Any) -> Any:
        """The fp16 loss scaler for this engine's gradients."""
        return get_grad_scaler(self.distributed_type, **kwargs)

    # --- prepare ---------------------------------------------------------------------------

    def check_prepare(self, objects: Sequence[Any]) -> None:
        """Refuse a combination of objects that cannot be prepared together (before any is).

        Args:
            objects: Everything passed to one ``prepare`` call.
        """

    def prepare_model(
        self, model: torch.nn.Module, *, device_placement: bool, evaluation_mode: bool
    ) -> torch.nn.Module:
        """Apply the transforms (see the module docstring) and return the model to train."""
        dispatched = getattr(model, "hf_device_map", None) is not None
        if self.options.policy.fp8_backend is not None:
            convert_model_to_fp8(model, self.options.ao_recipe_handler)
        if self.options.policy.autocast:
            wrap_forward(model, self.options.policy, self.options.autocast_handler)
        if device_placement and not dispatched:
            model = model.to(self.state.device)
        prepared = model
        trainable = any(p.requires_grad for p in model.parameters())
        if not evaluation_mode and trainable:
            prepared = self.wrap_model(model, dispatched=dispatched)
        return self.compile_model(prepared)

    def wrap_model(self, model: torch.nn.Module, *, dispatched: bool) -> torch.nn.Module:
        """The engine's wrapper around a placed, trainable model (none by default)."""
        return model

    def compile_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``torch.compile`` (whole or regional) as the dynamo plugin says."""
        plugin = self.options.dynamo_plugin
        if not plugin.enabled:
            return model
        kwargs = plugin.compile_kwargs()
        if plugin.use_regional_compilation:
            return compile_regions(model, **kwargs)
        return torch.compile(model, **kwargs)  # type: ignore[return-value]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to wrap (an engine that replaces parameters re-points it)."""
        return optimizer

    def optimizer_wrapper(
        self, optimizer: Any, scaler: Any, device_placement: bool = False
    ) -> AcceleratedOptimizer:
        """The prepared optimizer around ``optimizer`` (accel-amp's ``AcceleratedOptimizer``)."""
        return AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=scaler)

    def synchronize(self) -> None:
        """Finish the device's pending work before state is read for saving (XLA: mark_step)."""

    def rng_states(self) -> dict[str, Any]:
        """The engine's device random states for ``random_states_<rank>.pkl`` (none here)."""
        return {}

    def restore_rng_states(self, states: dict[str, Any]) -> None:
        """Restore what :meth:`rng_states` saved (``states`` is the whole file)."""

    def forget_model(self, model: torch.nn.Module) -> None:
        """Drop what the engine recorded about ``model`` (a failed ``prepare`` rolls back)."""

    # --- the step ------------------------------------------------------------------------

    def trigger_sync_in_backward(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Force the next backward to synchronise gradients even inside ``no_sync``."""
        return contextlib.nullcontext()

    def join(
        self, joinables: list[Any], enable: bool
    ) -> contextlib.AbstractContextManager[None] | None:
        """A context letting ranks finish with uneven inputs; None: not supported."""
        return None

    # --- models and checkpoints --------------------------------------------------------

    def unwrap_model(
        self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> Any:
        """The user's model from inside the engine's and accel's wrappers."""
        return extract_model_from_parallel(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """The full state dict of a (unwrapped) model, on the ranks that write model files.

        Offloaded weights (CPU/disk offload hooks) are brought in one module at a time.
        Engines whose state dict is a collective call it on every rank.
        """
        from accel_bigmodel import get_state_dict_offloaded_model, has_offloaded_params

        if any(has_offloaded_params(module) for module in model.modules()):
            return get_state_dict_offloaded_model(model)
        return dict(model.state_dict())

    def writes_model_files(self) -> bool:
        """Whether this rank writes the model files of ``save_model`` (the main process)."""
        return self.state.is_main_process

    def save_model(
        self,
        model: Any,
        save_directory: str,
        *,
        max_shard_size: int | str,
        safe_serialization: bool,
    ) -> None:
        """Write the model's full weights for inference (see ``Accelerator.save_model``)."""
        from accel.model_files import save_model_files

        state_dict = self.model_state_dict(self.unwrap_model(model))
        save_model_files(
            state_dict,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            is_main_process=self.writes_model_files(),
        )

    def checkpoint_layout(self) -> CheckpointLayout | None:
        """The engine's own way to store models and optimizers in a checkpoint.

        ``None`` (the default): accel's layout, in which the main process writes
        ``model.safetensors`` and ``optimizer.bin`` from full state dicts.
        """
        return None

    def teardown(self) -> None:
        """Release what the engine holds (``Accelerator.end_training``)."""


@dataclasses.dataclass(frozen=True)
class LayoutCapture:
    """A layout's part of an asynchronous save (see :meth:`CheckpointLayout.capture`).

    Attributes:
        states: What the layout writes, by a stable name; the caller copies it into host
            memory before ``write`` runs.
        write: ``write(directory, copies, group)`` writes ``copies`` (``states`` copied) into
            ``directory`` on the writer thread; ``group`` is the process group of the writer
            threads (``None`` with one process), the only one it may use for collectives.
    """

    states: dict[str, Any]
    write: Callable[[Path, dict[str, Any], Any], None]


class CheckpointLayout(abc.ABC):
    """How an engine stores its models and optimizers inside a checkpoint directory.

    Every method is called on every rank at the same point (they may be collectives).
    ``prepare_load`` reads and checks everything first, then returns a function that applies
    it, so ``load_state`` still changes nothing until every file of the checkpoint is checked.
    """

    def check_save(self, window_open: bool) -> None:
        """Refuse a save this layout cannot resume (before any file is written).

        Every save can be resumed by default.
        """
        return None

    @abc.abstractmethod
    def save(self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path) -> None:
        """Write the models' and optimizers' states into ``directory``."""

    #: Whether :meth:`capture` is implemented (``save_state(async_save=True)`` is refused
    #: before anything is written where it is not).
    writes_in_background = False

    def capture(self, models: Sequence[Any], optimizers: Sequence[Any]) -> LayoutCapture:
        """Take what :meth:`save` writes, to be written later on the writer thread.

        Called by every rank at the same point (it may run collectives); only where
        :attr:`writes_in_background`.
        """
        raise NotImplementedError(f"{type(self).__name__} is written synchronously only")

    @abc.abstractmethod
    def prepare_load(
        self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path
    ) -> Any:
        """Read and check the states; return a callable with no arguments that applies them.

        Raises:
            CheckpointError: a state is missing or does not fit what was prepared.
        """

    @abc.abstractmethod
    def pending_gradients(self, models: Sequence[Any]) -> dict[str, torch.Tensor]:
        """This rank's gradients of the open accumulation window, by a stable key."""

    @abc.abstractmethod
    def restore_pending_gradients(
        self, models: Sequence[Any], grads: dict[str, torch.Tensor] | None
    ) -> None:
        """Put :meth:`pending_gradients` back (``None``: clear the gradients)."""
