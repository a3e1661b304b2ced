"""DeepSpeed ZeRO 0-3: the engine owns backward, accumulation boundaries, clipping and the step.

Behind the extra ``accel[deepspeed]``; importing accel never imports DeepSpeed, the engine
does when it is chosen (an ``ImportError`` with the install command otherwise). ``prepare``
is joint: the model, its optimizer (a client ``torch.optim`` optimizer, or ``DummyOptim`` for
one defined in the config) and the loaders go through one ``deepspeed.initialize``. Before
that the config's ``"auto"`` values are filled, and the resolved config is logged once:

* ``train_micro_batch_size_per_gpu`` from the first prepared loader (its per-process batch);
* ``gradient_accumulation_steps`` from the Accelerator (a different number in the config is an
  error naming both, unless the Accelerator was left at 1, which then takes the config's);
* ``train_batch_size`` = micro batch x accumulation x processes (a different explicit value is
  an error);
* ``gradient_clipping`` from the plugin, else no clipping (Accelerate silently picks 1.0);
* ``bf16`` from ``mixed_precision`` (``fp16`` is refused on a CPU run, where DeepSpeed cannot
  run it);
* ``zero_allow_untested_optimizer`` for a client optimizer.

The loop is the one DDP runs: ``accelerator.backward(loss)`` hands the loss to DeepSpeed
(which divides it by the accumulation steps) and, on the micro-batch that completes a window,
steps the engine (clipping, optimizer, zero_grad); ``optimizer.step()`` / ``zero_grad()`` in
the script are then no-ops, and a client scheduler is stepped by accel as under DDP.
``clip_grad_norm_`` returns the global norm DeepSpeed computed for that step, and refuses a
``max_norm`` that is not the config's ``gradient_clipping`` (the step has already happened
with the config's value). Checkpoints are DeepSpeed's (``pytorch_model/`` tag folder) plus
accel's own files, written crash-safely like every accel checkpoint.

Not in this release (refused loudly): several models or plugins on one Accelerator, a
``save_state`` inside an open accumulation window, exact normalisation (``num_items``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from accel_amp import AcceleratedOptimizer, AcceleratedScheduler
from accel_state import DistributedType

from .base import CheckpointLayout, Engine, EngineOptions
from .deepspeed_plugin import get_value

__all__ = [
    "CHECKPOINT_TAG",
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DeepSpeedZeroEngine",
    "get_active_deepspeed_plugin",
]

logger = logging.getLogger("accel.engines.deepspeed")

_INSTALL = 'pip install "accel[deepspeed]"'
CHECKPOINT_TAG = "pytorch_model"


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The DeepSpeed plugin the run trains with.

    Raises:
        ValueError: the run does not use DeepSpeed.
    """
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError(
            "get_active_deepspeed_plugin(): this run does not use DeepSpeed (no "
            "deepspeed_plugin and no ACCEL_USE_DEEPSPEED)"
        )
    return plugin


def import_deepspeed() -> Any:
    """``deepspeed``, or an ``ImportError`` with the install command."""
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            f"DeepSpeed was asked for, but the deepspeed package is not installed: {_INSTALL} "
            "(on a CPU-only machine: DS_BUILD_OPS=0 pip install --no-build-isolation "
            "deepspeed after torch)"
        ) from error
    return deepspeed


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """The prepared optimizer under DeepSpeed: the engine steps, so ``step``/``zero_grad`` don't.

    Args:
        optimizer: The torch optimizer (its ``param_groups`` are what a scheduler changes).
        engine_optimizer: DeepSpeed's optimizer around it (a ZeRO optimizer), if another.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine_optimizer: Any = None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine_optimizer = engine_optimizer if engine_optimizer is not None else optimizer

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: DeepSpeed stepped in ``accelerator.backward`` at the window's end."""
        self._step_called = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Nothing: DeepSpeed zeroes the gradients when it steps."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether DeepSpeed skipped the last step (fp16 overflow)."""
        return bool(getattr(self.engine_optimizer, "overflow", False))


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler defined in the DeepSpeed config: the engine steps it, so ``step`` doesn't."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: DeepSpeed steps its scheduler when it steps the optimizer."""


class DeepSpeedEngineWrapper:
    """Backward through a DeepSpeed engine, stepping it at the end of each window."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        """``engine.backward(loss)``; at a window's end also ``engine.step()``."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()


class DeepSpeedZeroEngine(Engine):
    """DeepSpeed ZeRO training (see the module docstring).

    Raises:
        ImportError: DeepSpeed is not installed (the message has the install command).
        ValueError: fp16 on a CPU run.
    """

    name = "DeepSpeed"
    requires_joint_setup = True
    owns_backward = True

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self.plugin = options.deepspeed_plugin
        if self.plugin is None:
            raise ValueError("the DeepSpeed engine needs a DeepSpeedPlugin")
        device = self.state.device
        precision = options.policy.mixed_precision
        if precision == "fp16" and device.type == "cpu":
            raise ValueError(
                "mixed_precision='fp16' with DeepSpeed on a CPU run: DeepSpeed refuses it there "
                "('Type fp16 is not supported on your device'); use mixed_precision='bf16'"
            )
        if precision == "fp8":
            raise ValueError(
                "mixed_precision='fp8' with DeepSpeed: not driven by accel; use 'bf16'"
            )
        self.deepspeed = import_deepspeed()
        if device.type == "cpu":
            # A shared-memory comm op would be JIT-compiled (60-75 s) on first init; gloo does.
            ops = getattr(self.deepspeed.ops, "__compatible_ops__", None)
            if isinstance(ops, dict):
                ops["deepspeed_shm_comm"] = False
        self._own_group = False
        if not dist.is_initialized():
            backend = "gloo" if device.type == "cpu" else "nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        self.deepspeed.init_distributed(
            dist_backend=str(dist.get_backend()), auto_mpi_discovery=False
        )
        self.wrapper: DeepSpeedEngineWrapper | None = None
        #: The DeepSpeed config after ``prepare`` filled its "auto" values.
        self.resolved_config: dict[str, Any] = {}

    @property
    def distributed_type(self) -> DistributedType:
        """Always ``DEEPSPEED``."""
        return DistributedType.DEEPSPEED

    @property
    def multi_device(self) -> bool:
        """Several GPU-like devices."""
        return self.state.device.type != "cpu" and dist.get_world_size() > 1

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeed plugin."""
        return self.plugin

    @property
    def ds_engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` of the prepared model (None before prepare)."""
        return self.wrapper.engine if self.wrapper is not None else None

    # --- prepare -------------------------------------------------------------------------

    def prepare_joint(
        self,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Any],
        schedulers: Sequence[Any],
        loaders: Sequence[Any],
        accumulation_steps: int,
    ) -> tuple[Any, Any, Any, int]:
        """``deepspeed.initialize`` of the model with its optimizer and config-defined scheduler.

        Returns:
            (DeepSpeed engine, DeepSpeed optimizer or None, DeepSpeed scheduler or None, the
            accumulation steps the run uses).

        Raises:
            ValueError: several models or optimizers, a second prepare, an optimizer or
                scheduler both in the config and in the code, a DummyOptim without a config
                optimizer, or a config contradicting the Accelerator.
        """
        from accel.engine_plugins import DummyOptim, DummyScheduler

        if self.wrapper is not None or len(models) != 1 or len(optimizers) > 1:
            raise ValueError(
                f"prepare() under DeepSpeed got {len(models)} model(s) and {len(optimizers)} "
                "optimizer(s)"
                + (" after a model was already prepared" if self.wrapper is not None else "")
                + ": this release trains one model (with at most one optimizer) per Accelerator "
                "under DeepSpeed; pass them in one prepare() call"
            )
        model = models[0]
        optimizer = optimizers[0] if optimizers else None
        scheduler = schedulers[0] if schedulers else None
        config, steps = self._resolve_config(optimizer, scheduler, loaders, accumulation_steps)
        kwargs: dict[str, Any] = {"model": model, "config_params": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(**kwargs)
        self.wrapper = DeepSpeedEngineWrapper(engine)
        return engine, ds_optimizer, ds_scheduler, steps

    def forget_model(self, model: torch.nn.Module) -> None:
        """Drop the DeepSpeed engine of ``model`` (``free_memory``): another model may follow."""
        if self.wrapper is not None and self.wrapper.engine is model:
            self.wrapper = None

    def _resolve_config(
        self, optimizer: Any, scheduler: Any, loaders: Sequence[Any], accumulation_steps: int
    ) -> tuple[dict[str, Any], int]:
        from accel.engine_plugins import DummyOptim, DummyScheduler

        plugin = self.plugin
        config = json.loads(json.dumps(plugin.deepspeed_config, default=float))
        world = dist.get_world_size()
        if (
            "optimizer" in config
            and optimizer is not None
            and not isinstance(optimizer, DummyOptim)
        ):
            raise ValueError(
                "You cannot specify an optimizer in the config file and in the code at the same "
                "time. Please remove the optimizer from the config file or create "
                "`accel.utils.DummyOptim` in the code."
            )
        if isinstance(optimizer, DummyOptim) and "optimizer" not in config:
            raise ValueError(
                "You cannot create a `DummyOptim` without specifying an optimizer in the config "
                "file."
            )
        if (
            "scheduler" in config
            and scheduler is not None
            and not isinstance(scheduler, DummyScheduler)
        ):
            raise ValueError(
                "You cannot specify a scheduler in the config file and in the code at the same "
                "time. Please remove the scheduler from the config file or create "
                "`accel.utils.DummyScheduler` in the code."
            )
        steps = self._accumulation(config, accumulation_steps)
        micro = config.get("train_micro_batch_size_per_gpu", "auto")
        if micro in (None, "auto"):
            micro = self._micro_batch(loaders, config)
            config["train_micro_batch_size_per_gpu"] = micro
        total = micro * steps * world
        if config.get("train_batch_size", "auto") in (None, "auto"):
            config["train_batch_size"] = total
        elif int(config["train_batch_size"]) != total:
            raise ValueError(
                f"DeepSpeed config train_batch_size={config['train_batch_size']} is not "
                f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps "
                f"({steps}) x processes ({world}) = {total}: make it {total} or 'auto'"
            )
        clipping = config.get("gradient_clipping", "auto")
        if clipping in (None, "auto"):
            config.pop("gradient_clipping", None)
        self._precision(config)
        if optimizer is not None and not isinstance(optimizer, DummyOptim):
            config["zero_allow_untested_optimizer"] = True
        self._fill_optimizer_autos(config, optimizer, scheduler)
        if self.state.is_main_process:
            logger.info(f"DeepSpeed config after filling 'auto': {json.dumps(config, default=str)}")
        self.resolved_config = config
        return config, steps

    def _accumulation(self, config: dict[str, Any], accumulation_steps: int) -> int:
        value = config.get("gradient_accumulation_steps", "auto")
        if value in (None, "auto"):
            config["gradient_accumulation_steps"] = accumulation_steps
            return accumulation_steps
        value = int(value)
        if accumulation_steps not in (1, value):
            raise ValueError(
                f"gradient_accumulation_steps: the DeepSpeed config says {value}, the "
                f"Accelerator says {accumulation_steps}: set it in one place (or 'auto' in the "
                "config)"
            )
        return value

    @staticmethod
    def _micro_batch(loaders: Sequence[Any], config: dict[str, Any]) -> int:
        world = dist.get_world_size()
        for loader in loaders:
            total = getattr(loader, "total_batch_size", None)
            if isinstance(total, int) and total >= world:
                return total // world
            size = getattr(loader, "batch_size", None)
            if size is None:
                sampler = getattr(loader, "batch_sampler", None)
                size = getattr(sampler, "batch_size", None)
            if isinstance(size, int):
                return size
        raise ValueError(
            "When using DeepSpeed, `accelerator.prepare()` requires you to pass at least one "
            "training or evaluation dataloader with `batch_size`, or an integer "
            "`train_micro_batch_size_per_gpu` in the DeepSpeed config"
        )

    def _precision(self, config: dict[str, Any]) -> None:
        precision = self.options.policy.mixed_precision
        for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
            section = config.get(key)
            enabled = section.get("enabled", "auto") if isinstance(section, dict) else None
            if enabled in (None, "auto"):
                config[key] = {"enabled": precision == name}
            elif bool(enabled) and precision not in ("no", name):
                raise ValueError(
                    f"mixed_precision={precision!r} contradicts {key}.enabled=true in the "
                    "DeepSpeed config: set the precision in one place"
                )
        if config.get("fp16", {}).get("enabled") and self.state.device.type == "cpu":
            raise ValueError(
                "fp16 in the DeepSpeed config on a CPU run: DeepSpeed refuses it there; use bf16"
            )

    @staticmethod
    def _fill_optimizer_autos(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
        from accel.engine_plugins import DummyOptim, DummyScheduler

        if isinstance(optimizer, DummyOptim):
            params = config["optimizer"].setdefault("params", {})
            pairs: tuple[tuple[str, Any], ...] = (
                ("lr", optimizer.lr),
                ("weight_decay", optimizer.weight_decay),
            )
            for key, value in pairs:
                if params.get(key, "auto") == "auto":
                    params[key] = value
        if isinstance(scheduler, DummyScheduler) and "scheduler" in config:
            params = config["scheduler"].setdefault("params", {})
            steps: tuple[tuple[str, Any], ...] = (
                ("total_num_steps", scheduler.total_num_steps),
                ("warmup_num_steps", scheduler.warmup_num_steps),
            )
            for key, value in steps:
                if params.get(key, "auto") == "auto" and value is not None:
                    params[key] = value
        leftover = [key for key in _auto_keys(config)]
        if leftover:
            raise ValueError(
                f"DeepSpeed config values left at 'auto' that accel cannot fill: {leftover}; "
                "give them values"
            )

    # --- the step ------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        """DeepSpeed's backward (it divides by the accumulation steps), then its step."""
        if self.wrapper is None:
            raise RuntimeError(
                "accelerator.backward() under DeepSpeed before prepare(model, optimizer)"
            )
        self.wrapper.backward(loss, sync_gradients=sync_gradients, **kwargs)

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Nothing to do: DeepSpeed is told each micro-batch whether it closes the window."""
        return contextlib.nullcontext()

    def grads_averaged_over(self, model: Any) -> int:
        """Every rank."""
        return int(dist.get_world_size())

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The global gradient norm DeepSpeed computed for the step it just took.

        DeepSpeed clips inside its step with the config's ``gradient_clipping``.

        Raises:
            ValueError: ``max_norm`` is not the config's ``gradient_clipping``.
        """
        configured = get_value(self.resolved_config, "gradient_clipping")
        if configured is None or float(configured) != float(max_norm) or norm_type != 2.0:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) under DeepSpeed, "
                f"whose config clips at gradient_clipping={configured} (L2) inside its step: "
                f"set DeepSpeedPlugin(gradient_clipping={max_norm}) (or gradient_clipping in "
                "the DeepSpeed config) so that the clipping asked for is the one applied"
            )
        norm = self.ds_engine.get_global_grad_norm() if self.ds_engine is not None else None
        value = float(norm) if norm is not None else float("nan")
        return torch.tensor(value, device=self.state.device)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Refused: DeepSpeed clips the norm, in its step."""
        raise ValueError(
            "DeepSpeed does not support `clip_grad_value_`: it clips the gradient norm inside "
            "its step. Use gradient_clipping in the DeepSpeedPlugin and clip_grad_norm_"
        )

    def optimizer_wrapper(self, optimizer: Any, scaler: Any) -> AcceleratedOptimizer:
        """The prepared optimizer around DeepSpeed's (``step``/``zero_grad`` do nothing)."""
        inner = optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            inner = inner.optimizer  # a ZeRO optimizer wraps the torch one
        return DeepSpeedOptimizerWrapper(inner, engine_optimizer=optimizer)

    # --- models and checkpoints --------------------------------------------------------

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """Full weights on rank 0 (ZeRO-3: gathered; a collective then), ``{}`` elsewhere."""
        engine = self.ds_engine
        if self.plugin.zero_stage != 3 or engine is None:
            return super().model_state_dict(getattr(model, "module", model))
        if self.plugin.get_value("zero_optimization.stage3_gather_16bit_weights_on_model_save"):
            state = engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else {}
        return self._gather_layer_by_layer(engine.module)

    def _gather_layer_by_layer(self, module: torch.nn.Module) -> dict[str, Any]:
        """ZeRO-3 weights gathered one module at a time (no 16-bit consolidation needed)."""
        gathered: dict[str, Any] = {}
        main = dist.get_rank() == 0
        for prefix, sub in module.named_modules():
            own = list(sub.named_parameters(recurse=False))
            if not own:
                continue
            with self.deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                if main:
                    for name, param in own:
                        key = f"{prefix}.{name}" if prefix else name
                        gathered[key] = param.detach().cpu().clone()
        if main:
            for name, buffer in module.named_buffers():
                gathered.setdefault(name, buffer.detach().cpu().clone())
        return gathered if main else {}

    def checkpoint_layout(self) -> CheckpointLayout:
        """DeepSpeed's own checkpoint (``pytorch_model/`` tag folder), inside accel's."""
        return DeepSpeedLayout(self)

    def teardown(self) -> None:
        """Destroy the one-rank group this engine created, if it did."""
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False


def _auto_keys(config: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(config, dict):
        for key, value in config.items():
            yield from _auto_keys(value, f"{prefix}{key}.")
    elif config == "auto":
        yield prefix.rstrip(".")


class DeepSpeedLayout(CheckpointLayout):
    """``engine.save_checkpoint`` / ``load_checkpoint`` with the ``pytorch_model`` tag."""

    def __init__(self, engine: DeepSpeedZeroEngine) -> None:
        self.engine = engine

    def save(self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path) -> None:
        """Every rank writes its DeepSpeed files (a collective)."""
        ds_engine = self.engine.ds_engine
        if ds_engine is None:
            return
        ds_engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG)

    def prepare_load(
        self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path
    ) -> Callable[[], None]:
        """Check that the tag folder exists; the load itself is DeepSpeed's."""
        ds_engine = self.engine.ds_engine
        folder = directory / CHECKPOINT_TAG
        if ds_engine is not None and not folder.is_dir():
            from accel.checkpointing import CheckpointError

            raise CheckpointError(
                f"{folder} is missing: not a DeepSpeed checkpoint (save_state under DeepSpeed "
                "writes it; a DDP or FSDP2 checkpoint does not load into a DeepSpeed run)"
            )

        def apply() -> None:
            if ds_engine is not None:
                ds_engine.load_checkpoint(
                    str(directory), tag=CHECKPOINT_TAG, load_lr_scheduler_states=False
                )

        return apply

    def check_save(self, window_open: bool) -> None:
        """Refuse a save inside an accumulation window (DeepSpeed keeps those gradients)."""
        if window_open:
            raise ValueError(
                "save_state() inside an accumulation window under DeepSpeed: the window's "
                "gradients live inside DeepSpeed and this release cannot resume them exactly. "
                "Save when accelerator.sync_gradients is True (the end of a window)"
            )

    def pending_gradients(self, models: Sequence[Any]) -> dict[str, torch.Tensor]:
        """None: saves happen at the end of a window (see :meth:`check_save`)."""
        return {}

    def restore_pending_gradients(
        self, models: Sequence[Any], grads: dict[str, torch.Tensor] | None
    ) -> None:
        """Nothing to restore: DeepSpeed zeroed the gradients when it stepped."""
