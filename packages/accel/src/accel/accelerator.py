"""The ``Accelerator``: one object that adapts a plain PyTorch training loop to the run.

It owns no mechanism of its own. Process topology, devices and collectives come from
accel-state; sharded loaders from accel-data; the precision policy, the optimizer/scheduler
wrappers and the gradient-accumulation owner from accel-amp. The Accelerator decides, from its
arguments and the launch environment, how to combine them, and keeps the prepared objects so
that clipping, metrics and checkpoints can find them.

The machinery that trains a model (one device, DDP, FSDP2, DeepSpeed, tensor parallelism,
XLA) is an engine (:mod:`accel.engines`), chosen once from the run's distributed type; the
Accelerator asks it every engine-specific question and never branches on the distributed
type. An engine accel does not build (Megatron-LM) keeps its constructor slot; asking for it,
by argument or through the environment, raises
``accel_state.engine_requests.EngineUnavailableError`` (a ``NotImplementedError``) before any
process group exists, so no rank ever trains with another engine than the one asked for.

This module holds construction, ``prepare`` and the training step. The constructor's
arguments are resolved by :mod:`accel.options`, the prepared objects live in
:mod:`accel.prepared`, and the Accelerator's base classes hold the rest of its API:
:mod:`accel.run_views` (delegations to the state), :mod:`accel.run_files` (state dicts,
saving, checkpoints) and :mod:`accel.run_trackers` (trackers).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from accel_amp import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradientAccumulator,
    PrecisionPolicy,
)
from accel_data import DataLoaderConfiguration, prepare_data_loader, skip_first_batches
from accel_state import AcceleratorState, DistributedType, GradientState
from accel_state.imports import is_bitsandbytes_multi_backend_available, is_xpu_available
from accel_state.kwargs import KwargsHandler
from accel_state.process_group import release_mesh_groups

from .alias import announce_engine
from .async_save import BackgroundSaver
from .engines import Engine, EngineOptions, JointSetup, select_engine
from .handlers import ProfileKwargs, ProjectConfiguration, TorchDynamoPlugin
from .memory import clear_device_cache
from .metrics import data_representatives
from .metrics import gather_for_metrics as _gather_for_metrics
from .options import SPLIT_BATCHES_UNSET, AcceleratorOptions
from .parallelism import MeshRanks, build_device_mesh
from .prepared import PreparedObjects, prepare_stage, refuse_quantized_placement
from .run_files import RunFiles
from .run_trackers import RunTrackers
from .tracking.base import GeneralTracker

__all__ = ["Accelerator"]

logger = logging.getLogger("accel.accelerator")


def _bitsandbytes_trains_on_cpu() -> bool:
    # Looked up in this module: Accelerate's tests patch accelerate.accelerator's probes. Asked
    # only for a quantized model (the bitsandbytes probe imports bitsandbytes).
    return is_bitsandbytes_multi_backend_available() and not is_xpu_available()


class Accelerator(RunFiles, RunTrackers, MeshRanks):
    """Adapt a PyTorch training loop to the devices and processes of the run.

    Args:
        device_placement: Move prepared models, optimizer state and batches to ``device``.
        split_batches: Shortcut for ``DataLoaderConfiguration(split_batches=...)`` (honoured,
            unlike Accelerate, which ignores it).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (default: the
            ``ACCEL_MIXED_PRECISION`` variable, else ``"no"``).
        gradient_accumulation_steps: Micro-batches per optimizer step (default: the
            ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` variable, else 1).
        cpu: Run on the CPU even when an accelerator is available.
        dataloader_config: How ``prepare`` shards data loaders.
        fsdp_plugin: FSDP2 settings: models are sharded with ``fully_shard`` (default when
            ``ACCEL_USE_FSDP=true``, as ``accel launch --use_fsdp`` sets: a plugin built from
            the ``FSDP_*`` variables). ``fsdp_version=1`` is refused.
        deepspeed_plugin: DeepSpeed ZeRO settings (default when ``ACCEL_USE_DEEPSPEED=true``),
            or a dict of names to plugins, as ``deepspeed_plugins``.
        deepspeed_plugins: Several named DeepSpeed plugins (one model each).
        parallelism_config: How the processes form a device mesh (data replication and
            sharding: DDP, FSDP2, HSDP; see :mod:`accel.parallelism`); default when
            ``ACCEL_USE_PARALLELISM_CONFIG=true``: one from the ``PARALLELISM_CONFIG_*`` sizes.
            Checked against the world size before any process group exists.
        torch_tp_plugin: The old spelling of ``ParallelismConfig(tp_size=...)``.
        megatron_lm_plugin: Refused (Megatron-LM's loop is not built), as are the
            ``ACCEL_USE_*`` / ``ACCELERATE_USE_*`` switches of engines accel does not have.
        rng_types: RNGs synchronised at the start of each epoch (default ``["generator"]``).
        log_with: Trackers: ``"all"``, names, ``GeneralTracker`` instances or classes.
        project_dir: Root of the run's logs and checkpoints.
        project_config: A ``ProjectConfiguration`` (``project_dir`` then overrides its root).
        gradient_accumulation_plugin: Full accumulation settings (exclusive with
            ``gradient_accumulation_steps``).
        step_scheduler_with_optimizer: Prepared schedulers follow the optimizer's steps.
        kwargs_handlers: At most one of each handler class (DDP, GradScaler, process group,
            autocast, profiler, FP8 recipe).
        dynamo_backend: Shortcut for ``TorchDynamoPlugin(backend=...)``.
        dynamo_plugin: ``torch.compile`` settings.

    Raises:
        ValueError: a bad value for any argument (named in the message).
        TypeError: an object in ``kwargs_handlers`` that is not a known handler.
        EngineUnavailableError: an engine was asked for (a ``NotImplementedError`` naming the
            engine, where the request came from and what to do).
        NotImplementedError: ``deepspeed_plugin`` for a second Accelerator of a DeepSpeed run
            (the first one's plugins are the run's; as in Accelerate).
    """

    def __init__(  # noqa: PLR0913 - Accelerate's signature
        self,
        device_placement: bool = True,
        split_batches: bool = SPLIT_BATCHES_UNSET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
    ) -> None:
        # Every argument is checked before anything runs (no process group, no tracker), so
        # that a refused engine or a bad value leaves the process as it was.
        options = AcceleratorOptions.from_arguments(
            device_placement=device_placement,
            split_batches=split_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            dataloader_config=dataloader_config,
            engines={
                "deepspeed_plugin": deepspeed_plugin,
                "fsdp_plugin": fsdp_plugin,
                "torch_tp_plugin": torch_tp_plugin,
                "megatron_lm_plugin": megatron_lm_plugin,
                "deepspeed_plugins": deepspeed_plugins,
                "parallelism_config": parallelism_config,
            },
            rng_types=rng_types,
            log_with=log_with,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
        )
        self._keep_settings(options)
        fresh_state = not AcceleratorState._shared_state
        self.state = options.open_state()
        try:
            self._build_run(options)
        except BaseException:
            if fresh_state:  # a failed construction leaves no half-configured singletons
                AcceleratorState._reset_state()
                GradientState._reset_state()
            raise
        announce_engine(self.state.distributed_type)
        if self.is_main_process:
            logger.info(f"{self.policy.describe()}; engine: {self.engine.name}")
        self.trackers: list[GeneralTracker] = []
        self._prepared = PreparedObjects()
        self._background_saves = BackgroundSaver()
        self.flag_tensor: torch.Tensor | None = None

    def _keep_settings(self, options: AcceleratorOptions) -> None:
        """The settings users read and change as attributes (as in Accelerate)."""
        self.project_configuration = options.project_configuration
        self.ddp_handler = options.ddp_handler
        self.scaler_handler = options.scaler_handler
        self.init_handler = options.init_handler
        self.autocast_handler = options.autocast_handler
        self.profile_handler = options.profile_handler
        self.ao_recipe_handler = options.ao_recipe_handler
        self.dynamo_plugin = options.dynamo_plugin
        self.rng_types = options.rng_types
        self.log_with = options.log_with
        self.device_placement = options.device_placement
        self.dataloader_config = options.dataloader_config
        self.step_scheduler_with_optimizer = options.step_scheduler_with_optimizer

    def _build_run(self, options: AcceleratorOptions) -> None:
        """Build on the state: the mesh, accumulation, precision, engine, scaler, accumulator.

        Separate from ``__init__`` because a failure here must reset the singletons that a
        fresh construction created.
        """
        if options.parallelism is not None and self.state.device_mesh is None:
            self.state.device_mesh = build_device_mesh(options.parallelism, self.state.device.type)
        self.gradient_state = GradientState(gradient_accumulation_plugin=options.accumulation)
        self.policy = PrecisionPolicy.resolve(
            self.state.mixed_precision,
            self.state.device,
            distributed_type=self.state.distributed_type,
            scaler_kwargs=self.scaler_handler,
        )
        self.engine: Engine = select_engine(
            EngineOptions(
                state=self.state,
                policy=self.policy,
                dynamo_plugin=self.dynamo_plugin,
                ddp_handler=self.ddp_handler,
                autocast_handler=self.autocast_handler,
                ao_recipe_handler=self.ao_recipe_handler,
                fsdp_plugin=self.state.fsdp_plugin,
                deepspeed_plugin=self.state.deepspeed_plugin,
                split_batches=self.dataloader_config.split_batches,
                engine=self.state.engine,
            )
        )
        self.scaler: Any = None
        if self.policy.scaler:
            scaler_kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler else {}
            self.scaler = self.engine.grad_scaler(**scaler_kwargs)
        self.accumulator = GradientAccumulator(scaler=self.scaler, sync=self.engine)

    @property
    def native_amp(self) -> bool:
        """Whether forwards run under ``torch.autocast`` (FSDP2 applies its own policy)."""
        return self.policy.autocast and self.engine.autocasts_forward

    # The registries under Accelerate's private names, which tests and user code read.

    @property
    def _models(self) -> list[Any]:
        return self._prepared.models

    @property
    def _optimizers(self) -> list[AcceleratedOptimizer]:
        return self._prepared.optimizers

    @property
    def _schedulers(self) -> list[AcceleratedScheduler]:
        return self._prepared.schedulers

    @property
    def _dataloaders(self) -> list[DataLoader[Any]]:
        return self._prepared.dataloaders

    @property
    def _custom_objects(self) -> list[Any]:
        return self._prepared.custom_objects

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether any prepared optimizer skipped its last step (fp16 overflow)."""
        return any(optimizer.step_was_skipped for optimizer in self._prepared.optimizers)

    # --- prepare ---------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Prepare data loaders, models, optimizers and schedulers for the run.

        Objects are prepared in argument order in two passes: loaders, models and optimizers
        first, then schedulers (bound to their prepared optimizer). Anything else passes
        through. Preparing an object twice returns it unchanged.

        Args:
            *args: The objects.
            device_placement: Per-object override of ``device_placement`` (same length).

        Returns:
            The prepared object (one argument) or a tuple in input order.

        Raises:
            ValueError: ``device_placement`` has the wrong length; a model dispatched over
                several devices is prepared in a distributed run.
        """
        if device_placement is None:
            placements: list[bool | None] = [None] * len(args)
        else:
            if len(device_placement) != len(args):
                raise ValueError(
                    f"device_placement has {len(device_placement)} entries but {len(args)} "
                    "objects were passed to prepare(): give one entry (True, False or None) "
                    "per object"
                )
            placements = list(device_placement)
        self.engine.check_prepare(args)
        if isinstance(self.engine, JointSetup):
            return self._prepare_joint(self.engine, args, placements)
        sizes = self._prepared.sizes()
        result = list(args)
        try:
            # Models (and loaders) first, then optimizers (an engine that replaces parameters
            # re-points the optimizer to the model's new ones), then schedulers.
            for stage in (0, 1, 2):
                for index, (obj, placement) in enumerate(zip(args, placements, strict=True)):
                    if prepare_stage(obj) == stage:
                        result[index] = self._prepare_one(obj, placement, stage)
        except BaseException:
            self._roll_back(sizes)
            raise
        return _unpack(result)

    def _roll_back(self, sizes: tuple[int, ...]) -> None:
        """Forget what a failed ``prepare`` registered, so nothing stays half-registered."""
        for dropped in self._prepared.truncate(sizes):
            if isinstance(dropped, torch.nn.Module):
                self.engine.forget_model(dropped)
        models, optimizers = self._prepared.models, self._prepared.optimizers
        self.accumulator.models = [m for m in self.accumulator.models if m in models]
        self.accumulator.optimizers = [o for o in self.accumulator.optimizers if o in optimizers]

    def _prepare_joint(
        self, engine: JointSetup, args: Sequence[Any], placements: list[bool | None]
    ) -> Any:
        """``prepare`` for an engine that builds model, optimizer and scheduler together."""
        result = list(args)
        models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
        optimizers = [obj for obj in args if engine.is_joint_optimizer(obj)]
        schedulers = [
            obj for obj in args if prepare_stage(obj) == 2 or engine.is_joint_scheduler(obj)
        ]
        loaders = []
        earlier_loaders = list(self._prepared.dataloaders)
        for index, (obj, placement) in enumerate(zip(args, placements, strict=True)):
            if isinstance(obj, DataLoader):
                result[index] = self.prepare_data_loader(obj, device_placement=placement)
                loaders.append(result[index])
        if not models:
            return _unpack(result)
        try:
            engine_model, engine_optimizer, engine_scheduler, steps = engine.prepare_joint(
                models,
                optimizers,
                schedulers,  # real ones too: the engine refuses one beside a config scheduler
                [*loaders, *earlier_loaders],  # a later model reuses the first loader's batch
                self.gradient_accumulation_steps,
            )
        except BaseException:
            # A failed prepare leaves nothing half-registered behind: not even its loaders.
            self._prepared.discard(loaders)
            raise
        if steps != self.gradient_accumulation_steps:
            self.gradient_accumulation_steps = steps  # the engine's config sets it
        self._prepared.add("models", engine_model)
        self.accumulator.register_model(engine_model)
        prepared_optimizer = None
        if engine_optimizer is not None:
            prepared_optimizer = self.engine.optimizer_wrapper(engine_optimizer, scaler=None)
            self._prepared.add("optimizers", prepared_optimizer)
            self.accumulator.register_optimizer(prepared_optimizer)
        for index, obj in enumerate(args):
            if isinstance(obj, torch.nn.Module):
                result[index] = engine_model
            elif engine.is_joint_optimizer(obj):
                result[index] = prepared_optimizer
        for index, obj in enumerate(args):
            if engine.is_joint_scheduler(obj):
                result[index] = self._engine_scheduler(engine, engine_scheduler)
            elif prepare_stage(obj) == 2:
                result[index] = self.prepare_scheduler(obj)
        return _unpack(result)

    def _engine_scheduler(self, engine: JointSetup, scheduler: Any) -> Any:
        """A scheduler the engine steps itself, registered for checkpoints, stepping nothing."""
        if scheduler is None:
            return None
        prepared = engine.wrap_joint_scheduler(scheduler, self._prepared.optimizers)
        prepared._is_accelerate_prepared = True
        return prepared

    def _prepare_one(self, obj: Any, placement: bool | None, stage: int) -> Any:
        if stage == 0:
            if isinstance(obj, DataLoader):
                return self.prepare_data_loader(obj, device_placement=placement)
            if isinstance(obj, torch.nn.Module):
                return self.prepare_model(obj, device_placement=placement)
        elif stage == 1:
            return self.prepare_optimizer(obj, device_placement=placement)
        else:
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Prepare ``model`` with the run's engine: precision, placement, DDP or FSDP2, compile.

        Args:
            model: The model.
            device_placement: Move it to ``device`` (default: the Accelerator's setting;
                never for a model with an ``hf_device_map``).
            evaluation_mode: Skip the distributed wrapper (inference only).
        """
        if self._prepared.adopt("models", model):
            return model
        if isinstance(self.engine, JointSetup):
            raise ValueError(
                f"prepare_model() under {self.engine.name}: the engine builds the model, its "
                "optimizer and scheduler together; pass them to one prepare() call"
            )
        if device_placement is None:
            device_placement = self.device_placement
        self.engine.check_prepare([model])
        refuse_quantized_placement(
            model, self.distributed_type, self.device, cpu_kernels=_bitsandbytes_trains_on_cpu
        )
        prepared = self.engine.prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        self._prepared.add("models", prepared)
        self.accumulator.register_model(prepared)
        return prepared

    def prepare_data_loader(
        self,
        data_loader: DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable[..., Any] | None = None,
    ) -> DataLoader[Any]:
        """Shard ``data_loader`` across the processes (see accel-data)."""
        if self._prepared.adopt("dataloaders", data_loader):
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement and self.engine.places_batches
        config = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            # tensor- and context-parallel peers get the same batches
            torch_device_mesh=self.torch_device_mesh,
        )
        return self._prepared.add("dataloaders", prepared)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so it steps only at the end of accumulation windows."""
        if isinstance(optimizer, AcceleratedOptimizer) and self._prepared.adopt(
            "optimizers", optimizer
        ):
            self.accumulator.register_optimizer(optimizer)
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        if isinstance(self.engine, JointSetup):
            raise ValueError(
                f"prepare_optimizer() under {self.engine.name}: the engine builds the model, "
                "its optimizer and scheduler together; pass them to one prepare() call"
            )
        optimizer = self.engine.prepare_optimizer(optimizer)
        prepared = self.engine.optimizer_wrapper(
            optimizer,
            scaler=self.scaler,
            device_placement=device_placement and self.engine.places_optimizer_state,
        )
        self._prepared.add("optimizers", prepared)
        self.accumulator.register_optimizer(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it follows its prepared optimizer's real steps.

        Raises:
            ValueError: the scheduler's optimizer was not prepared.
        """
        if isinstance(scheduler, AcceleratedScheduler) and self._prepared.adopt(
            "schedulers", scheduler
        ):
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        optimizers: Any = self._prepared.optimizers
        for optimizer in self._prepared.optimizers:
            if target is optimizer or target is optimizer.optimizer:
                optimizers = optimizer
                break
        prepared = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        return self._prepared.add("schedulers", prepared)

    def skip_first_batches(self, dataloader: DataLoader[Any], num_batches: int = 0) -> Any:
        """A loader that starts ``num_batches`` batches into the epoch (for resuming)."""
        return skip_first_batches(dataloader, num_batches=num_batches)

    # --- the training step --------------------------------------------------------------------

    def accumulate(self, *models: Any) -> contextlib.AbstractContextManager[None]:
        """Wrap one training iteration: gradients sync only when the window completes."""
        return self.accumulator.accumulate(*models)

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Keep ``model``'s gradients local (no all-reduce) inside the block."""
        return self.engine.no_sync(model)

    def trigger_sync_in_backward(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Force a DDP model's next backward to all-reduce, even inside ``no_sync``."""
        return self.engine.trigger_sync_in_backward(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Back-propagate ``loss``: divided by the accumulation steps, scaled for fp16.

        ``num_items=n`` switches to exact normalisation: ``loss`` is then the *summed* loss
        over ``n`` items and the finished window's gradients are divided by the total item
        count across micro-batches and ranks (see accel-amp's ``GradientAccumulator``).
        """
        self._background_saves.raise_if_failed()
        num_items = kwargs.pop("num_items", None)
        self.accumulator.backward(loss, num_items=num_items, **kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale (once per optimizer step)."""
        self.accumulator.unscale_gradients(
            optimizer if optimizer is not None else self._prepared.optimizers
        )

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | float | None:
        """Unscale, clip the total gradient norm, and return the norm before clipping.

        A tensor, except under DeepSpeed, which clips inside its step: the norm it computed,
        as a float (None before its first step), as in Accelerate.
        """
        return self.accumulator.clip_grad_norm_(
            parameters, max_norm, norm_type=norm_type, optimizer=self._prepared.optimizers
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clamp each gradient to ``[-clip_value, clip_value]``."""
        self.accumulator.clip_grad_value_(
            parameters, clip_value, optimizer=self._prepared.optimizers
        )

    def autocast(
        self, autocast_handler: AutocastKwargs | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Autocast the block as the run's precision says (``enabled=False``: an fp32 island)."""
        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        return self.policy.autocast_context(handler)

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Split ``buffers`` along ``buffer_seq_dims`` over the ``cp`` ranks inside the block.

        Wrap each step's forward and backward; ``buffers`` (input ids, labels, position ids...)
        are cut in place and restored on leaving unless in ``no_restore_buffers``. Without
        context parallelism the block runs unchanged (logged once). See
        :mod:`accel.context_parallel`.
        """
        from .context_parallel import context_parallel_region

        return context_parallel_region(self.state, buffers, buffer_seq_dims, no_restore_buffers)

    # --- triggers and uneven inputs -----------------------------------------------------------

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` (collective; resets the flag)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.reduce(self.flag_tensor, reduction="sum")
        if int(flag.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Let DDP processes finish an epoch with different numbers of batches.

        Works on GPU and on CPU multi-process runs (Accelerate does nothing on CPU, where
        uneven batches then hang). ``even_batches`` temporarily overrides the prepared
        loaders' setting.
        """
        enable_join = not (even_batches if even_batches is not None else self.even_batches)
        joined = self.engine.join(joinables, enable_join)
        if joined is None:
            if self.distributed_type != DistributedType.NO:
                import warnings

                warnings.warn(
                    "join_uneven_inputs is only supported for multi-GPU (and multi-CPU) DDP "
                    f"training; under {self.distributed_type.value} it has no effect",
                    UserWarning,
                    stacklevel=3,
                )
            yield
            return

        previous: list[tuple[Any, bool]] = []
        if even_batches is not None:
            iterable = 0
            for loader in self._prepared.dataloaders:
                sampler = getattr(loader, "batch_sampler", None)
                if sampler is not None and hasattr(sampler, "even_batches"):
                    previous.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
                else:
                    iterable += 1
            if iterable:
                import warnings

                warnings.warn(
                    f"join_uneven_inputs(even_batches={even_batches}): overriding even_batches "
                    f"is only supported for map-style datasets; {iterable} prepared loader(s) "
                    "are iterable and keep their own setting",
                    UserWarning,
                    stacklevel=3,
                )
        try:
            with joined:
                yield
        finally:
            for sampler, value in previous:
                sampler.even_batches = value

    # --- metrics ----------------------------------------------------------------------------------

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions/labels for a metric, keeping each sample exactly once.

        On the last batch of a prepared loader the samples that were added to even out the
        processes are dropped, so a full pass yields exactly ``len(dataset)`` samples in every
        sharding mode. Non-tensor inputs (or ``use_gather_object=True``) are gathered as
        Python objects. Under tensor or context parallelism one rank of each such group
        speaks for the samples its group shares.
        """
        return _gather_for_metrics(
            input_data,
            use_gather_object,
            self.gradient_state,
            data_representatives(self.torch_device_mesh),
        )

    def free_memory(self, *objects: Any) -> list[Any]:
        """Forget every prepared object and release cached device memory.

        Returns a list of ``None`` of the same length as ``objects`` (assign it back).
        """
        for model in self._prepared.models:
            self.engine.forget_model(model)
        self._prepared.forget()
        self.accumulator = GradientAccumulator(scaler=self.scaler, sync=self.engine)
        self.step = 0
        objects_list = [None for _ in objects]
        gc.collect()
        clear_device_cache(garbage_collection=True)
        return objects_list

    def clear(self, *objects: Any) -> list[Any]:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler``; yields the profiler.

        With ``output_trace_dir`` each process writes ``profile_<rank>.json`` there.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(
                os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json")
            )

    def end_training(self) -> None:
        """Finish the trackers and leave the process group.

        ``trackers`` keeps the finished trackers (as in Accelerate), so their files and runs
        can still be inspected. Waits for a checkpoint being written in the background first
        (and raises its error, after finishing the rest, if it failed).
        """
        try:
            self._background_saves.close()
        finally:
            self._finish_training()

    def _finish_training(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.engine.teardown()
        config = self.parallelism_config
        if config is not None:  # the run's mesh holds its groups too (DDP over dp_replicate)
            release_mesh_groups(self.state.device_mesh)
            self.state.device_mesh = config.device_mesh = None
        self.state.destroy_process_group()

    def __deepcopy__(self, memo: dict[int, Any]) -> Accelerator:
        return self

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type}, engine={self.engine.name}, "
            f"num_processes={self.num_processes}, device={self.device}, "
            f"mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


def _unpack(result: list[Any]) -> Any:
    """What ``prepare`` returns: the one prepared object, or all of them as a tuple."""
    return result[0] if len(result) == 1 else tuple(result)
