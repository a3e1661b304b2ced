"""The Accelerator's connector: its arguments, config and environment, read once.

:meth:`AcceleratorOptions.from_arguments` reads the ``Accelerator``'s arguments and the
environment variables that stand in for them, once, and settles every choice they leave
open, into one frozen :class:`AcceleratorOptions`: which engines the run asks for (the
requests, read from the plugin arguments and the ``ACCEL_USE_*`` switches, refusing engines
accel lacks first, before any process group exists) and their plugins, the project
configuration (``project_dir`` vs ``project_config``), one handler per ``kwargs_handlers``
class, the dynamo plugin (``dynamo_plugin`` vs ``dynamo_backend``), the accumulation plan
and the data loader configuration (``split_batches`` vs ``dataloader_config``).

Nothing after it parses those values again: :meth:`AcceleratorOptions.open_state` hands the
requests to ``AcceleratorState``, which decides the engine from them and the process layout
(:func:`accel_state.engine_requests.decide_engine`, the one registry) and stores the
decision, and the Accelerator builds the engine of that decision.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accel_amp import (
    AORecipeKwargs,
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    plan_accumulation,
)
from accel_data import DataLoaderConfiguration
from accel_state import AcceleratorState, DistributedType, InitProcessGroupKwargs, is_initialized
from accel_state.engine_requests import (
    EngineRequest,
    argument_requests,
    environment_requests,
    refuse_conflicting_engines,
    refuse_unavailable_engines,
)
from accel_state.environment import ACCEL_USE_CPU, parse_flag_from_env
from accel_state.kwargs import KwargsHandler
from accel_state.state import deepspeed_plugin_mapping

from .handlers import (
    DistributedDataParallelKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .parallelism import (
    check_context_parallel_device,
    check_parallelism_config,
    resolve_parallelism,
)

if TYPE_CHECKING:
    from .engines.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["HANDLER_SLOTS", "SPLIT_BATCHES_UNSET", "AcceleratorOptions"]

#: The default of ``Accelerator(split_batches=...)``: not given (``dataloader_config`` decides).
SPLIT_BATCHES_UNSET: Any = object()

#: Kwargs handler classes the Accelerator accepts, and the attribute each one fills.
HANDLER_SLOTS: dict[type, str] = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    AORecipeKwargs: "ao_recipe_handler",
}


@dataclasses.dataclass(frozen=True)
class AcceleratorOptions:
    """The Accelerator's arguments, resolved (see the arguments of ``Accelerator``).

    Attributes:
        device_placement, mixed_precision, cpu, step_scheduler_with_optimizer: As given.
        dataloader_config: The loader configuration, ``split_batches`` applied.
        fsdp_plugin: The FSDP2 plugin (built from ``FSDP_*`` when only the environment asks).
        deepspeed_plugin: The DeepSpeed plugin, or ``{name: plugin}`` for several models.
        parallelism: The run's ``ParallelismConfig`` (``torch_tp_plugin`` turned into one).
        project_configuration: The project configuration, ``project_dir`` applied.
        accumulation: The gradient accumulation plugin.
        rng_types: RNGs synchronised at the start of each epoch.
        log_with: The tracker specs that can run.
        dynamo_plugin: The ``torch.compile`` settings.
        engine_requests: The engines the arguments and the environment ask for, checked.
        ddp_handler, scaler_handler, init_handler, autocast_handler, profile_handler,
            ao_recipe_handler: The handler of each class in ``kwargs_handlers`` (or None).
    """

    device_placement: bool
    mixed_precision: str | None
    cpu: bool
    step_scheduler_with_optimizer: bool
    dataloader_config: DataLoaderConfiguration
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    deepspeed_plugin: Any
    parallelism: Any
    project_configuration: ProjectConfiguration
    accumulation: GradientAccumulationPlugin
    rng_types: list[str]
    log_with: list[Any]
    dynamo_plugin: TorchDynamoPlugin
    engine_requests: tuple[EngineRequest, ...]
    ddp_handler: DistributedDataParallelKwargs | None = None
    scaler_handler: GradScalerKwargs | None = None
    init_handler: InitProcessGroupKwargs | None = None
    autocast_handler: AutocastKwargs | None = None
    profile_handler: ProfileKwargs | None = None
    ao_recipe_handler: AORecipeKwargs | None = None

    @classmethod
    # Takes the Accelerator's arguments by their names, as its signature (Accelerate's) has them.
    def from_arguments(  # noqa: PLR0913
        cls,
        *,
        device_placement: bool,
        split_batches: Any,
        mixed_precision: str | None,
        gradient_accumulation_steps: int,
        cpu: bool,
        dataloader_config: DataLoaderConfiguration | None,
        engines: Mapping[str, Any],
        rng_types: list[str] | None,
        log_with: Any,
        project_dir: str | os.PathLike[str] | None,
        project_config: ProjectConfiguration | None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None,
        step_scheduler_with_optimizer: bool,
        kwargs_handlers: Sequence[KwargsHandler] | None,
        dynamo_backend: str | None,
        dynamo_plugin: TorchDynamoPlugin | None,
    ) -> AcceleratorOptions:
        """Check and resolve the Accelerator's arguments (named as its own), engines first.

        ``engines`` holds the engine arguments by name (``deepspeed_plugin``,
        ``fsdp_plugin``, ``torch_tp_plugin``, ``megatron_lm_plugin``, ``deepspeed_plugins``,
        ``parallelism_config``), which are checked before any other.

        Raises:
            EngineUnavailableError: an engine accel lacks was asked for (first of all).
            ValueError, TypeError: as ``Accelerator`` documents.
        """
        requests = _engine_requests(engines)
        plan = plan_accumulation(gradient_accumulation_steps, gradient_accumulation_plugin)
        accumulation = (
            gradient_accumulation_plugin
            if gradient_accumulation_plugin is not None
            else GradientAccumulationPlugin.from_plan(plan)
        )
        fsdp_plugin, deepspeed_plugin, parallelism = _engine_plugins(
            engines, requests, cpu, environment_steps=plan.steps if plan.source else None
        )
        project_configuration = _project_configuration(project_dir, project_config)
        handlers = _read_handlers(kwargs_handlers)
        dynamo = _dynamo_plugin(dynamo_plugin, dynamo_backend)
        rng = list(rng_types) if rng_types is not None else ["generator"]
        trackers = _trackers(log_with, project_configuration.logging_dir)
        return cls(
            device_placement=device_placement,
            mixed_precision=mixed_precision,
            cpu=cpu,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            dataloader_config=_dataloader_config(split_batches, dataloader_config),
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            parallelism=parallelism,
            project_configuration=project_configuration,
            accumulation=accumulation,
            rng_types=rng,
            log_with=trackers,
            dynamo_plugin=dynamo,
            engine_requests=tuple(requests),
            **handlers,
        )

    def open_state(self) -> AcceleratorState:
        """The run's ``AcceleratorState`` (joining the process group on first use).

        An existing state without the engine plugins these options hold gets them.
        """
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        state = AcceleratorState(
            mixed_precision=self.mixed_precision,
            cpu=self.cpu,
            dynamo_plugin=self.dynamo_plugin,
            fsdp_plugin=self.fsdp_plugin,
            deepspeed_plugin=self.deepspeed_plugin,
            parallelism_config=self.parallelism,
            _from_accelerator=True,
            _requests=list(self.engine_requests),
            **init_kwargs,
        )
        if self.fsdp_plugin is not None and state.fsdp_plugin is None:
            state.fsdp_plugin = self.fsdp_plugin
        if self.deepspeed_plugin is not None and state.deepspeed_plugin is None:
            state.deepspeed_plugins = deepspeed_plugin_mapping(self.deepspeed_plugin)
        return state


def _trackers(log_with: Any, logging_dir: Any) -> list[Any]:
    """``log_with`` resolved (the tracker modules load only when trackers are asked for)."""
    if log_with is None:
        return []
    from .tracking.registry import filter_trackers

    return filter_trackers(log_with, logging_dir)


def _engine_requests(engines: Mapping[str, Any]) -> list[EngineRequest]:
    """The engines the plugin arguments and the environment ask for, read once and checked.

    Engines accel lacks (and two engines that each own the model) are refused first, so that
    nothing else runs (no process group, no tracker) for them.
    """
    requests = [*argument_requests("Accelerator", engines), *environment_requests(os.environ)]
    refuse_conflicting_engines(requests)
    refuse_unavailable_engines(requests)
    return requests


def _engine_plugins(
    engines: Mapping[str, Any],
    requests: Sequence[EngineRequest],
    cpu: bool,
    *,
    environment_steps: int | None,
) -> tuple[Any, Any, Any]:
    """The run's FSDP2 plugin, DeepSpeed plugin(s) and ``ParallelismConfig``.

    Plugins only the environment asks for are built from its variables (a DeepSpeed plugin
    takes the accumulation steps the plan already read, ``environment_steps``); a
    ``ParallelismConfig`` is checked against the world size before any group exists.
    """
    fsdp_plugin = engines["fsdp_plugin"]
    if fsdp_plugin is None and any(request.engine == "fsdp" for request in requests):
        from .engines.fsdp_plugin import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables
    if fsdp_plugin is not None:
        from .engines.fsdp_plugin import require_fsdp2

        require_fsdp2(fsdp_plugin)
    deepspeed_plugin = _deepspeed_plugin(
        engines["deepspeed_plugin"], engines["deepspeed_plugins"], requests, environment_steps
    )
    parallelism = resolve_parallelism(
        engines["parallelism_config"], engines["torch_tp_plugin"], requests
    )
    if parallelism is not None:
        check_parallelism_config(
            parallelism, fsdp=fsdp_plugin is not None, deepspeed=deepspeed_plugin is not None
        )
        check_context_parallel_device(parallelism, cpu=cpu or parse_flag_from_env(ACCEL_USE_CPU))
    return fsdp_plugin, deepspeed_plugin, parallelism


def _deepspeed_plugin(
    plugin: Any,
    plugins: Any,
    requests: Sequence[EngineRequest],
    environment_steps: int | None = None,
) -> Any:
    """The DeepSpeed plugin of the run, or ``{name: plugin}`` for several models.

    Built from ``ACCEL_DEEPSPEED_*`` when DeepSpeed is only asked for (by the environment).

    Raises:
        ValueError: both ``deepspeed_plugin`` and ``deepspeed_plugins``; an empty mapping.
        TypeError: a plugin that is not a ``DeepSpeedPlugin``, or ``deepspeed_plugins`` that is
            not a mapping of them.
        NotImplementedError: a plugin for a second Accelerator of a DeepSpeed run.
    """
    asked = any(request.engine == "deepspeed" for request in requests)
    if plugin is None and plugins is None and not asked:
        return None  # the plugin classes load only for a DeepSpeed run
    from .engine_plugins import DeepSpeedPlugin

    if plugin is not None or plugins is not None:
        _refuse_a_second_deepspeed_plugin()
    if isinstance(plugin, Mapping) and plugins is None:
        plugin, plugins = None, plugin  # Accelerate takes {name: plugin} in either argument
    if plugins is not None:
        if plugin is not None:
            raise ValueError(
                "Accelerator(deepspeed_plugin=..., deepspeed_plugins=...): pass one of them "
                "(deepspeed_plugins={name: DeepSpeedPlugin(...)} for several models)"
            )
        if not isinstance(plugins, dict) or not all(
            isinstance(value, DeepSpeedPlugin) for value in plugins.values()
        ):
            raise TypeError(
                f"Accelerator(deepspeed_plugins={plugins!r}): pass a dict of names to "
                "accel.DeepSpeedPlugin objects, e.g. {'student': DeepSpeedPlugin(zero_stage=2), "
                "'teacher': DeepSpeedPlugin(zero_stage=3)}"
            )
        if not plugins:
            raise ValueError(
                "Accelerator(deepspeed_plugins={}) holds no plugin: pass "
                "{name: DeepSpeedPlugin(...)} or deepspeed_plugin=DeepSpeedPlugin(...)"
            )
        return dict(plugins)
    if plugin is None and asked:
        # From the ACCEL_DEEPSPEED_* variables; the accumulation steps the plan read.
        return DeepSpeedPlugin(gradient_accumulation_steps=environment_steps)
    if plugin is not None and not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError(
            f"Accelerator(deepspeed_plugin={plugin!r}): pass an accel.DeepSpeedPlugin (from "
            "accel or accel.utils)"
        )
    return plugin


def _refuse_a_second_deepspeed_plugin() -> None:
    """Refuse DeepSpeed plugins for an Accelerator made after a DeepSpeed one (as Accelerate).

    The run's plugins were fixed by the first Accelerator; keeping them silently would train
    with settings other than the ones passed.

    Raises:
        NotImplementedError: the run already has DeepSpeed plugins.
    """
    if not is_initialized():
        return
    shared = AcceleratorState._shared_state  # read only: building a state could join a group
    plugins = shared.get("deepspeed_plugins")
    if shared.get("distributed_type") == DistributedType.DEEPSPEED and plugins:
        raise NotImplementedError(
            "You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`. "
            "Please make sure the first `Accelerator` is initialized with all the plugins you "
            f"want to use: this run already has {sorted(plugins)}. Pass them "
            "all to the first one (Accelerator(deepspeed_plugins={name: DeepSpeedPlugin(...), "
            "...})), create the later ones without a plugin (they share the run's), and switch "
            "with accelerator.state.select_deepspeed_plugin(name)"
        )


def _project_configuration(
    project_dir: str | os.PathLike[str] | None, project_config: ProjectConfiguration | None
) -> ProjectConfiguration:
    """``project_config`` (its root moved to ``project_dir`` if given), else a new one."""
    if project_config is None:
        return ProjectConfiguration(
            project_dir=os.fspath(project_dir) if project_dir is not None else None
        )
    if project_dir is not None:
        project_config.set_directories(project_dir)
    return project_config


def _read_handlers(handlers: Sequence[KwargsHandler] | None) -> dict[str, Any]:
    """The handler of each accepted class, by the attribute it fills.

    Raises:
        TypeError: a handler of a class the Accelerator does not use.
        ValueError: two handlers of one class.
    """
    slots: dict[str, Any] = {}
    for handler in handlers or ():
        slot = HANDLER_SLOTS.get(type(handler))
        if slot is None:
            accepted = ", ".join(cls.__name__ for cls in HANDLER_SLOTS)
            raise TypeError(
                f"kwargs_handlers contains a {type(handler).__name__}, which the Accelerator "
                f"does not use: pass instances of {accepted}"
            )
        if slot in slots:
            raise ValueError(
                f"You can only pass one {type(handler).__name__} in `kwargs_handlers`; "
                "merge the settings into one object"
            )
        slots[slot] = handler
    return slots


def _dynamo_plugin(plugin: TorchDynamoPlugin | None, backend: str | None) -> TorchDynamoPlugin:
    """``plugin``, else one for ``backend``, else the default (from ``ACCEL_DYNAMO_*``).

    Raises:
        ValueError: both were given.
    """
    if plugin is not None and backend is not None:
        raise ValueError(
            f"dynamo_backend={backend!r} and dynamo_plugin were both given: pass "
            "only the plugin, with TorchDynamoPlugin(backend=...)"
        )
    if plugin is not None:
        return plugin
    return TorchDynamoPlugin(backend=backend) if backend is not None else TorchDynamoPlugin()


def _dataloader_config(
    split_batches: Any, config: DataLoaderConfiguration | None
) -> DataLoaderConfiguration:
    """``config`` (or the default) with ``split_batches`` applied when it was given.

    Raises:
        ValueError: ``split_batches`` contradicts ``config.split_batches``.
    """
    resolved = config if config is not None else DataLoaderConfiguration()
    if split_batches is not SPLIT_BATCHES_UNSET:
        if config is not None and config.split_batches != split_batches:
            raise ValueError(
                f"split_batches={split_batches!r} contradicts dataloader_config."
                f"split_batches={config.split_batches!r}: set it in one place"
            )
        resolved.split_batches = bool(split_batches)
    return resolved
