"""DeepSpeed ZeRO 0-3: the engine owns backward, accumulation boundaries, clipping and the step.

Behind the extra ``accel[deepspeed]``; importing accel never imports DeepSpeed, the engine
does when it is chosen (an ``ImportError`` with the install command otherwise). ``prepare``
is joint: the model, its optimizer (a client ``torch.optim`` optimizer, or ``DummyOptim`` for
one defined in the config) and the loaders go through one ``deepspeed.initialize``. Before
that the config's ``"auto"`` values are filled, and the resolved config is logged once:

* ``train_micro_batch_size_per_gpu`` from the first loader of the call (else one prepared
  earlier: its per-process batch);
* ``gradient_accumulation_steps`` from the Accelerator (a different number in the config is an
  error naming both, unless the Accelerator was left at 1, which then takes the config's);
* ``train_batch_size`` = micro batch x accumulation x processes (a different explicit value is
  an error);
* ``gradient_clipping`` from the plugin, else ``0.0``: no clipping (DeepSpeed clips at 1.0
  when the key is missing, and Accelerate turns "auto" into 1.0 without a word);
* ``bf16`` from ``mixed_precision`` (``fp16`` is refused on a CPU run, where DeepSpeed cannot
  run it);
* ``zero_allow_untested_optimizer`` for a client optimizer;
* with a ``DummyOptim``: the optimizer's ``lr``, ``weight_decay`` and whatever else it was
  given (``betas``, ``eps``, ...); with a ``DummyScheduler``: ``warmup_min_lr`` 0,
  ``warmup_max_lr`` the optimizer's lr, ``warmup_num_steps``, and ``total_num_steps`` divided
  by the processes (it counts the unprepared loader's batches, as in Accelerate; not divided
  with ``split_batches``);
* the ZeRO bucket sizes (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``,
  ``stage3_param_persistence_threshold``) from ``model.config.hidden_size`` (or the largest
  of ``hidden_sizes``), as Accelerate does; any other "auto" is an error naming it and what
  to give (``stage3_gather_16bit_weights_on_model_save: "auto"`` is the plugin's
  ``zero3_save_16bit_model``, filled when the plugin is built).

The optimizer and scheduler follow Accelerate's rules, in its words: one defined in the config
is stood for by ``DummyOptim`` / ``DummyScheduler`` in the code, never by a torch one; a
``DummyScheduler`` needs a config scheduler or an ``lr_scheduler_callable``; a ``DummyOptim``
takes no torch scheduler. The plugin's ``transformer_moe_cls_names`` (or
``ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES``) marks those blocks as ZeRO-3 leaf modules (gathered
whole) before ``deepspeed.initialize``.

Several models: one ``prepare`` per model, each getting its own DeepSpeed engine with the
plugin selected at that moment (``Accelerator(deepspeed_plugins={"student": ..., "teacher":
...})`` selects the first; ``accelerator.state.select_deepspeed_plugin(name)`` switches). A
model prepared without an optimizer only runs (a frozen teacher, ZeRO-3 inference);
``backward`` goes to the engine with an optimizer whose model ran forward since its last
backward, and a loss that came through several trained models is refused (each engine steps
only its own model), where Accelerate silently uses the first engine.

The loop is the one DDP runs: ``accelerator.backward(loss)`` hands the loss to DeepSpeed
(which divides it by the accumulation steps) and, on the micro-batch that completes a window,
steps the engine (clipping, optimizer, zero_grad); ``optimizer.step()`` / ``zero_grad()`` in
the script are then no-ops, and a client scheduler is stepped by accel as under DDP.
``clip_grad_norm_`` returns the global norm DeepSpeed computed for that step as a Python float
(None before any step), as Accelerate 1.15 does, and refuses a ``max_norm`` that is not the
config's ``gradient_clipping`` (the step has already happened with the config's value).
Checkpoints are DeepSpeed's (``pytorch_model/`` tag folder) plus accel's own files, written
crash-safely like every accel checkpoint.

A ``save_state`` inside an open accumulation window saves DeepSpeed's partial gradients
(:mod:`accel.engines.deepspeed_checkpoint`) so the resumed window ends as the uninterrupted
one; it is refused where accel cannot read them (optimizer or parameter offload, ZeRO-1/2
accumulating in another dtype than the weights, ZeRO-0 with bf16). Not in this release
(refused loudly): exact normalisation (``num_items``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accel_amp import AcceleratedOptimizer, AcceleratedScheduler, OwnsBackward
from accel_state import DistributedType

from .base import CheckpointLayout, Engine, EngineOptions
from .deepspeed_plugin import get_value, set_value
from .deepspeed_release import release_deepspeed

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DeepSpeedZeroEngine",
    "get_active_deepspeed_plugin",
    "zero3_init_context",
]

logger = logging.getLogger("accel.engines.deepspeed")

_INSTALL = 'pip install "accel[deepspeed]"'
#: The ZeRO "auto" values Accelerate sizes from the model's hidden size (h*h, 0.9*h*h, 10*h).
_BUCKET_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


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


@contextlib.contextmanager
def zero3_init_context(plugin: Any = None) -> Iterator[None]:
    """Build the models created inside partitioned across the ranks (``deepspeed.zero.Init``).

    Like ``init_empty_weights`` for a model too big for one process: under ZeRO-3 with
    ``zero3_init_flag`` (the default at stage 3), each parameter is split across the ranks as
    its module is constructed, in the run's precision, so no rank ever holds the whole model;
    ``prepare`` then takes the partitioned model as it is. With another plugin (or
    ``zero3_init_flag=False``) the model is built normally. ::

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
        with zero3_init_context():
            model = MyModel()

    Args:
        plugin: The DeepSpeed plugin (default: the run's active one).

    Raises:
        RuntimeError: no Accelerator exists yet (zero.Init needs the run's process group).
        ImportError: DeepSpeed is not installed.
    """
    if plugin is None:
        from accel_state import AcceleratorState

        state = AcceleratorState._shared_state
        plugin = AcceleratorState().deepspeed_plugin if state else None
    if plugin is None or not plugin.zero3_init_flag:
        yield
        return
    if not dist.is_initialized():
        raise RuntimeError(
            "zero3_init_context(): create the Accelerator(deepspeed_plugin=...) first; "
            "deepspeed.zero.Init partitions over the run's process group"
        )
    deepspeed = import_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=plugin.model_init_config()):
        yield


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
    """Backward through a DeepSpeed engine, stepping it at the end of each window.

    Args:
        engine: The ``deepspeed.DeepSpeedEngine``.
        plugin: The plugin it was prepared with (accel's; None when built by hand).
        config: The DeepSpeed config it was initialized with ("auto" filled).
        trains: Whether it was prepared with an optimizer (a model to step, not only to run).
    """

    def __init__(
        self,
        engine: Any,
        plugin: Any = None,
        config: dict[str, Any] | None = None,
        trains: bool = True,
    ) -> None:
        self.engine = engine
        self.plugin = plugin
        self.config = config if config is not None else {}
        self.trains = trains
        #: Whether the engine ran a forward with autograd on since its last backward.
        self.forwarded = False
        self._hook = engine.register_forward_pre_hook(self._saw_forward)

    def _saw_forward(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            self.forwarded = True

    def release(self) -> None:
        """Remove the forward hook (the engine is forgotten)."""
        self._hook.remove()

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the engine's last step, as a float (None before any step)."""
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        """``engine.backward(loss)``; at a window's end also ``engine.step()``."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()


class DeepSpeedZeroEngine(Engine, OwnsBackward):
    """DeepSpeed ZeRO training (see the module docstring).

    Raises:
        ImportError: DeepSpeed is not installed (the message has the install command).
        ValueError: fp16 on a CPU run.
    """

    name = "DeepSpeed"

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        if options.deepspeed_plugin is None:
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
        self._own_local_rank = False
        if not dist.is_initialized():
            backend = "gloo" if device.type == "cpu" else "nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
            if "LOCAL_RANK" not in os.environ:
                # DeepSpeed reads torchrun's LOCAL_RANK at initialize and when partitioning
                # (ZeRO-3); one process without a launcher is local rank 0.
                os.environ["LOCAL_RANK"] = "0"
                self._own_local_rank = True
        self.deepspeed.init_distributed(
            dist_backend=str(dist.get_backend()), auto_mpi_discovery=False
        )
        #: One wrapper per prepared model, in prepare order.
        self.wrappers: list[DeepSpeedEngineWrapper] = []
        self._last_backward: DeepSpeedEngineWrapper | None = None
        #: The DeepSpeed config of the last prepared model, after its "auto" values were filled.
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
    def plugin(self) -> Any:
        """The active (selected) DeepSpeed plugin: the one the next ``prepare`` uses."""
        selected = getattr(self.state, "deepspeed_plugin", None)
        return selected if selected is not None else self.options.deepspeed_plugin

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeed plugin."""
        return self.plugin

    @property
    def deepspeed_engine_wrapped(self) -> DeepSpeedEngineWrapper | None:
        """The wrapper of the first prepared model (Accelerate's attribute of that name)."""
        return self.wrappers[0] if self.wrappers else None

    @property
    def ds_engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` of the first prepared model (None before)."""
        wrapper = self.deepspeed_engine_wrapped
        return wrapper.engine if wrapper is not None else None

    def wrapper_of(self, model: Any) -> DeepSpeedEngineWrapper | None:
        """The wrapper of ``model`` (its DeepSpeed engine, or the module inside one)."""
        for wrapper in self.wrappers:
            if model is wrapper.engine or model is wrapper.engine.module:
                return wrapper
        return None

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

        ``schedulers`` holds the call's schedulers (``DummyScheduler`` or torch ones); only a
        ``DummyScheduler`` is built by DeepSpeed, the others are checked against the config.

        Raises:
            ValueError: several models or optimizers, a second prepare, an optimizer or
                scheduler both in the config and in the code, a DummyOptim without a config
                optimizer (or with a torch scheduler), a DummyScheduler with nothing to build,
                an MoE class name the model lacks, or a config contradicting the Accelerator.
        """
        from accel.engine_plugins import DummyOptim, DummyScheduler

        if len(models) != 1 or len(optimizers) > 1:
            raise ValueError(
                f"prepare() under DeepSpeed got {len(models)} model(s) and {len(optimizers)} "
                "optimizer(s) in one call: each model gets its own DeepSpeed engine, so pass "
                "one model (with at most one optimizer) per prepare() call, and select the "
                "plugin for each with accelerator.state.select_deepspeed_plugin(name)"
            )
        model = models[0]
        if self.wrapper_of(model) is not None:
            raise ValueError("prepare(): this model is already a prepared DeepSpeed engine")
        optimizer = optimizers[0] if optimizers else None
        dummies: list[Any] = [s for s in schedulers if isinstance(s, DummyScheduler)]
        scheduler = (dummies or list(schedulers) or [None])[0]
        plugin = self.plugin
        config, steps = self._resolve_config(
            plugin, model, optimizer, scheduler, loaders, accumulation_steps
        )
        plugin.set_moe_leaf_modules(model)  # checks every class name before marking any
        kwargs: dict[str, Any] = {"model": model, "config_params": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(**kwargs)
        self.wrappers.append(
            DeepSpeedEngineWrapper(engine, plugin, config, trains=optimizer is not None)
        )
        if steps != accumulation_steps:
            logger.info(f"gradient_accumulation_steps={steps}, from the DeepSpeed config")
        return engine, (ds_optimizer if optimizer is not None else None), ds_scheduler, steps

    def is_joint_optimizer(self, obj: Any) -> bool:
        """Torch optimizers, and ``DummyOptim`` for an optimizer in the DeepSpeed config."""
        from accel.engine_plugins import DummyOptim

        return isinstance(obj, torch.optim.Optimizer | DummyOptim)

    def is_joint_scheduler(self, obj: Any) -> bool:
        """``DummyScheduler``: a placeholder for a scheduler in the DeepSpeed config."""
        from accel.engine_plugins import DummyScheduler

        return isinstance(obj, DummyScheduler)

    def wrap_joint_scheduler(self, scheduler: Any, optimizers: Sequence[Any]) -> Any:
        """A scheduler DeepSpeed steps itself: registered for checkpoints, stepping nothing."""
        return DeepSpeedSchedulerWrapper(scheduler, list(optimizers))

    def forget_model(self, model: torch.nn.Module) -> None:
        """Drop the DeepSpeed engine of ``model`` (``free_memory``)."""
        wrapper = self.wrapper_of(model)
        if wrapper is not None:
            wrapper.release()
            self.wrappers.remove(wrapper)
            if self._last_backward is wrapper:
                self._last_backward = None

    def _resolve_config(
        self,
        plugin: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        loaders: Sequence[Any],
        accumulation_steps: int,
    ) -> tuple[dict[str, Any], int]:
        from accel.engine_plugins import DummyOptim

        config = json.loads(json.dumps(plugin.deepspeed_config, default=float))
        world = dist.get_world_size()
        _check_pairing(config, optimizer, scheduler)
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
        if config.get("gradient_clipping", "auto") in (None, "auto"):
            # 0 is DeepSpeed's "no clipping"; a missing key would clip at its default of 1.0.
            config["gradient_clipping"] = 0.0
        self._precision(config)
        if optimizer is not None and not isinstance(optimizer, DummyOptim):
            config["zero_allow_untested_optimizer"] = True
        self._fill_autos(config, model, optimizer, scheduler)
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

    def _fill_autos(
        self, config: dict[str, Any], model: Any, optimizer: Any, scheduler: Any
    ) -> None:
        """Fill the optimizer, scheduler and ZeRO bucket "auto" values (as Accelerate does).

        Raises:
            ValueError: an "auto" left that nothing here can fill, naming it and the fix.
        """
        from accel.engine_plugins import DummyOptim, DummyScheduler

        fill: dict[str, Any] = {}
        if isinstance(optimizer, DummyOptim):
            fill["optimizer.params.lr"] = optimizer.lr
            fill["optimizer.params.weight_decay"] = optimizer.weight_decay
            for key, value in optimizer.kwargs.items():  # betas, eps, ... given to DummyOptim
                fill[f"optimizer.params.{key}"] = list(value) if isinstance(value, tuple) else value
        if (
            isinstance(scheduler, DummyScheduler)
            and "scheduler" in config
            and scheduler.lr_scheduler_callable is None
        ):
            source = scheduler.optimizer
            defaults = getattr(source, "defaults", None)
            max_lr = defaults["lr"] if isinstance(defaults, dict) else getattr(source, "lr", None)
            fill["scheduler.params.warmup_min_lr"] = 0
            fill["scheduler.params.warmup_max_lr"] = max_lr
            fill["scheduler.params.warmup_num_steps"] = scheduler.warmup_num_steps
            if scheduler.total_num_steps is not None:
                # counted over the unprepared loader, as in Accelerate: one per process here
                total = scheduler.total_num_steps
                world = dist.get_world_size()
                fill["scheduler.params.total_num_steps"] = (
                    total if self.options.split_batches else -(-total // world)
                )
        hidden = _hidden_size(model)
        if hidden is not None:
            sizes = (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)
            fill.update(zip(_BUCKET_KEYS, sizes, strict=True))
        for dotted, value in fill.items():
            if get_value(config, dotted) == "auto" and value is not None:
                set_value(config, dotted, value)
        leftover = list(_auto_keys(config))
        if leftover:
            hints = sorted({_auto_hint(key) for key in leftover})
            raise ValueError(
                f"DeepSpeed config values left at 'auto' that accel cannot fill: {leftover}; "
                + "; ".join(hints)
            )

    # --- the step ------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        """DeepSpeed's backward (it divides by the accumulation steps), then its step.

        The engine is the one prepared with an optimizer whose model ran forward since its
        last backward (the only one that trains, if just one does).

        Raises:
            RuntimeError: no model with an optimizer was prepared, or the forward pass went
                through several that train (each steps only its own model).
        """
        wrapper = self._wrapper_for_backward()
        for other in self.wrappers:
            other.forwarded = False
        self._last_backward = wrapper
        wrapper.backward(loss, sync_gradients=sync_gradients, **kwargs)

    def _wrapper_for_backward(self) -> DeepSpeedEngineWrapper:
        training = [wrapper for wrapper in self.wrappers if wrapper.trains]
        if not training:
            raise RuntimeError(
                "accelerator.backward() under DeepSpeed before prepare(model, optimizer): no "
                "prepared model has an optimizer to step"
            )
        if len(training) == 1:
            return training[0]
        ran = [wrapper for wrapper in training if wrapper.forwarded]
        if len(ran) == 1:
            return ran[0]
        names = [type(wrapper.engine.module).__name__ for wrapper in ran or training]
        raise RuntimeError(
            f"accelerator.backward() under DeepSpeed: this loss came from "
            f"{'several' if ran else 'none'} of the trained models ({', '.join(names)}) since "
            "the last backward. Each DeepSpeed engine steps only its own model: compute each "
            "trained model's loss and call backward on it before the next one runs forward, "
            "or give each model its own Accelerator (they share the DeepSpeed plugins)"
        )

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Nothing to do: DeepSpeed is told each micro-batch whether it closes the window."""
        return contextlib.nullcontext()

    def grads_averaged_over(self, model: Any) -> int:
        """Every rank."""
        return int(dist.get_world_size())

    def clip_grad_norm_(  # type: ignore[override]
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> float | None:
        """The global gradient norm DeepSpeed computed for the step it just took, as a float.

        DeepSpeed clips inside its step with the config's ``gradient_clipping``; this returns
        what Accelerate 1.15 returns (``engine.get_global_grad_norm()`` as a Python float, or
        None before DeepSpeed has computed a norm).

        Raises:
            ValueError: ``max_norm`` is not the config's ``gradient_clipping``.
        """
        wrapper = self._wrapper_of_parameters(parameters)
        config = wrapper.config if wrapper is not None else self.resolved_config
        configured = get_value(config, "gradient_clipping")
        if configured is None or float(configured) != float(max_norm) or norm_type != 2.0:
            applied = (
                f"clips at gradient_clipping={configured} (L2) inside its step"
                if configured
                else f"does not clip (gradient_clipping={configured})"
            )
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) under DeepSpeed, "
                f"whose config {applied}: set DeepSpeedPlugin(gradient_clipping={max_norm}) "
                f"(`accel launch --gradient_clipping {max_norm}`, or gradient_clipping in the "
                "DeepSpeed config) so that the clipping asked for is the one applied"
            )
        return wrapper.get_global_grad_norm() if wrapper is not None else None

    def _wrapper_of_parameters(self, parameters: Any) -> DeepSpeedEngineWrapper | None:
        """The trained engine owning ``parameters`` (else the one that last stepped)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        wanted = {id(p) for p in parameters}
        for wrapper in self.wrappers:
            if wrapper.trains and any(id(p) in wanted for p in wrapper.engine.parameters()):
                return wrapper
        if self._last_backward is not None:
            return self._last_backward
        training = [wrapper for wrapper in self.wrappers if wrapper.trains]
        return training[0] if training else None

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Refused: DeepSpeed clips the norm, in its step."""
        raise ValueError(
            "DeepSpeed does not support `clip_grad_value_`: it clips the gradient norm inside "
            "its step. Use clip_grad_norm_ with DeepSpeedPlugin(gradient_clipping=...) "
            "(`accel launch --gradient_clipping`, or gradient_clipping in the DeepSpeed config)"
        )

    def optimizer_wrapper(
        self, optimizer: Any, scaler: Any, device_placement: bool = False
    ) -> AcceleratedOptimizer:
        """The prepared optimizer around DeepSpeed's (``step``/``zero_grad`` do nothing)."""
        inner = optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            inner = inner.optimizer  # a ZeRO optimizer wraps the torch one
        return DeepSpeedOptimizerWrapper(inner, engine_optimizer=optimizer)

    # --- models and checkpoints --------------------------------------------------------

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """Full weights on rank 0 (ZeRO-3: gathered; a collective then), ``{}`` elsewhere."""
        wrapper = self.wrapper_of(model)
        plugin = wrapper.plugin if wrapper is not None and wrapper.plugin else self.plugin
        if plugin.zero_stage != 3 or wrapper is None:
            return super().model_state_dict(getattr(model, "module", model))
        engine = wrapper.engine
        if plugin.get_value("zero_optimization.stage3_gather_16bit_weights_on_model_save"):
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
        """DeepSpeed's own checkpoint (``pytorch_model/`` tag folders), inside accel's."""
        from .deepspeed_checkpoint import DeepSpeedLayout

        return DeepSpeedLayout(self)

    def teardown(self) -> None:
        """End the DeepSpeed engines; let go of DeepSpeed's process groups.

        Each engine is destroyed (its gradient and module hooks removed: the run is over), and
        DeepSpeed's references to the groups are dropped (:mod:`.deepspeed_release`), so that
        no gloo group is left for interpreter finalization. Destroys the one-rank group this
        engine created, if it did (and unsets the ``LOCAL_RANK`` it set for DeepSpeed then).
        """
        engines = [wrapper.engine for wrapper in self.wrappers]
        for wrapper in self.wrappers:
            wrapper.release()
        self.wrappers.clear()
        self._last_backward = None
        release_deepspeed(engines)
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False
        if self._own_local_rank:
            os.environ.pop("LOCAL_RANK", None)
            self._own_local_rank = False


def _check_pairing(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    """Refuse an optimizer or scheduler both in the config and in the code (Accelerate's rules).

    Raises:
        ValueError: in Accelerate's words (with accel's names).
    """
    from accel.engine_plugins import DummyOptim, DummyScheduler

    if "optimizer" in config and optimizer is not None and not isinstance(optimizer, DummyOptim):
        raise ValueError(
            "You cannot specify an optimizer in the config file and in the code at the same "
            "time. Please remove the optimizer from the config file or create "
            "`accel.utils.DummyOptim` in the code."
        )
    if isinstance(optimizer, DummyOptim) and "optimizer" not in config:
        raise ValueError(
            "You cannot create a `DummyOptim` without specifying an optimizer in the config file."
        )
    if "scheduler" in config and scheduler is not None:
        if not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                "You cannot specify a scheduler in the config file and in the code at the same "
                f"time. Please remove the scheduler from the config file or create "
                f"`accel.utils.DummyScheduler` in the code (got {type(scheduler).__name__})."
            )
    elif isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        raise ValueError(
            "Either specify a scheduler in the config file or pass in the "
            "`lr_scheduler_callable` parameter when using `accel.utils.DummyScheduler`."
        )
    if isinstance(optimizer, DummyOptim) and scheduler is not None:
        if not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                "You can only specify `accel.utils.DummyScheduler` in the code when using "
                f"`accel.utils.DummyOptim` (got {type(scheduler).__name__}): DeepSpeed builds "
                "the optimizer, so a scheduler made in the code has none to drive"
            )


def _hidden_size(model: Any) -> int | None:
    """``model.config.hidden_size`` (or the largest of ``hidden_sizes``), if the model has one."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    if size is None and sizes:
        size = max(sizes)
    return int(size) if isinstance(size, int) else None


def _auto_hint(key: str) -> str:
    if key.startswith("optimizer.params."):
        name = key.rsplit(".", 1)[1]
        return f"give {name} a value, or pass DummyOptim(params, ..., {name}=...)"
    if key.startswith("scheduler.params."):
        return "give the scheduler's steps values, or pass DummyScheduler(optimizer, ...)"
    if key in _BUCKET_KEYS:
        return (
            "give the ZeRO bucket sizes numbers (accel fills them from model.config.hidden_size "
            "or hidden_sizes when the model has one)"
        )
    return f"give {key} a value"


def _auto_keys(config: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(config, dict):
        for key, value in config.items():
            yield from _auto_keys(value, f"{prefix}{key}.")
    elif config == "auto":
        yield prefix.rstrip(".")
