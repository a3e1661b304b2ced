"""The shared state of a run: ``PartialState``, ``AcceleratorState`` and ``GradientState``.

All three are Borg singletons: every instance's ``__dict__`` *is* one class-level dict, so
any instance sees what the first one set up, and ``_reset_state()`` empties it in place (tests
call it after each test). ``PartialState`` (:mod:`.partial_state`) answers "who am I": it reads
the process topology, picks the device, and joins the process group. ``AcceleratorState``
(here) adds the training configuration (mixed precision, engine plugins). ``GradientState``
(:mod:`.gradient_state`) carries the gradient accumulation settings and the stack of active
data loaders. This module is the import path of all three.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from . import xla
from .devices import parse_device
from .engine_requests import (
    ENGINES,
    EngineRequest,
    EngineSpec,
    argument_requests,
    decide_engine,
    environment_requests,
    refuse_conflicting_engines,
    refuse_unavailable_engines,
)
from .enums import DistributedType, PrecisionType
from .environment import (
    ACCEL_MIXED_PRECISION,
    ACCEL_TORCH_DEVICE,
    ACCEL_USE_CPU,
    lookup_variable,
    parse_flag_from_env,
    read_variable,
)
from .gradient_state import GradientState
from .partial_state import TORCH_DISTRIBUTED_TYPES as TORCH_DISTRIBUTED_TYPES
from .partial_state import PartialState, ProcessQueries, is_property_of_reset_state

__all__ = [
    "AcceleratorState",
    "GradientState",
    "PartialState",
    "deepspeed_plugin_mapping",
    "is_initialized",
    "wait_for_everyone",
]


def is_initialized() -> bool:
    """Whether an ``AcceleratorState`` (hence an ``Accelerator``) has been set up."""
    return AcceleratorState._shared_state != {}


class AcceleratorState(ProcessQueries):
    """``PartialState`` plus the training configuration: mixed precision and engine plugins.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; ``None`` reads
            ``ACCEL_MIXED_PRECISION`` (default ``"no"``).
        cpu: Use the CPU even if an accelerator is available.
        dynamo_plugin: torch.compile settings (kept for the Accelerator).
        fsdp_plugin: FSDP2 settings (accel's ``FullyShardedDataParallelPlugin``); with it, or
            with ``ACCEL_USE_FSDP=true``, the distributed type is ``FSDP``.
        deepspeed_plugin: DeepSpeed settings (accel's ``DeepSpeedPlugin``), or a mapping of
            names to plugins (several models; the first is selected, see
            :meth:`select_deepspeed_plugin`); with it, or with ``ACCEL_USE_DEEPSPEED=true``, the
            distributed type is ``DEEPSPEED``.
        parallelism_config: The run's ``ParallelismConfig`` (kept; the Accelerator checks it and
            stores its mesh in ``device_mesh``).
        torch_tp_plugin: The old spelling of ``ParallelismConfig(tp_size=...)`` (kept; the
            Accelerator turns it into one).
        megatron_lm_plugin: Megatron-LM, which accel does not implement: refused (see
            :mod:`accel_state.engine_requests`), as are its ``ACCEL_USE_*`` /
            ``ACCELERATE_USE_*`` switches in the environment.
        _from_accelerator: Set by ``Accelerator`` (names it in refusals).
        _requests: The engine requests the ``Accelerator`` already read from its arguments
            and the environment (its connector, ``accel.options``); None: read them here.
        **kwargs: Process-group arguments passed on to ``PartialState``.

    Raises:
        ValueError: ``mixed_precision`` is unknown; the state already exists with another
            precision or device; an engine switch holds no truth value; two engines were
            asked for.
        EngineUnavailableError: an engine was asked for (a ``NotImplementedError``), before
            any process group is created.
    """

    _shared_state: dict[str, Any] = {}
    _known_attrs = PartialState._known_attrs + [
        "deepspeed_plugin",
        "deepspeed_plugins",
        "device_mesh",
        "dynamo_plugin",
        "fsdp_plugin",
        "megatron_lm_plugin",
        "parallelism_config",
        "torch_tp_plugin",
        "use_ipex",
        "downcast_bfloat",
        "engine",
    ]

    _mixed_precision: str
    deepspeed_plugins: Any
    fsdp_plugin: Any
    megatron_lm_plugin: Any
    torch_tp_plugin: Any
    dynamo_plugin: Any
    parallelism_config: Any
    device_mesh: Any
    use_ipex: bool
    #: The registry row of the engine the run trains with, decided once (see
    #: :func:`accel_state.engine_requests.decide_engine`).
    engine: EngineSpec

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        _requests: list[EngineRequest] | None = None,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        cpu = cpu or parse_flag_from_env(ACCEL_USE_CPU)
        if mixed_precision is not None:
            mixed_precision = _validate_precision(mixed_precision, "mixed_precision")
        engines = {
            "deepspeed_plugin": deepspeed_plugin,
            "fsdp_plugin": fsdp_plugin,
            "torch_tp_plugin": torch_tp_plugin,
            "megatron_lm_plugin": megatron_lm_plugin,
            "parallelism_config": parallelism_config,
        }
        if self.initialized:
            self._check_unchanged(mixed_precision, cpu, engines)
            if not PartialState._shared_state:
                # PartialState._reset_state() alone: build it again, as Accelerate does, so
                # that PartialState() handles held elsewhere answer again.
                PartialState(cpu, **kwargs)
            return
        if mixed_precision is None:
            found = lookup_variable(ACCEL_MIXED_PRECISION)
            name, env_precision = found if found is not None else (ACCEL_MIXED_PRECISION, "no")
            mixed_precision = _validate_precision(env_precision, name)
        if _requests is None:
            caller = "Accelerator" if _from_accelerator else "AcceleratorState"
            requests = [*argument_requests(caller, engines), *environment_requests(os.environ)]
            refuse_conflicting_engines(requests)
            refuse_unavailable_engines(requests)
        else:
            requests = list(_requests)
        if not PartialState._shared_state:
            _refuse_engines_on_xla(requests, cpu)
        partial = PartialState(cpu, **kwargs)
        self._shared_state.update(partial._shared_state)
        try:
            self._configure(mixed_precision, dynamo_plugin, engines, requests)
        except BaseException:
            self._shared_state.clear()
            raise

    def _configure(
        self,
        mixed_precision: str,
        dynamo_plugin: Any,
        engines: dict[str, Any],
        requests: list[EngineRequest],
    ) -> None:
        """Record the training configuration on top of the freshly joined ``PartialState``."""
        self.downcast_bfloat = False
        if self.distributed_type == DistributedType.XLA and xla.is_tpu():
            self.downcast_bfloat = xla.bf16_environment(mixed_precision)
        self._mixed_precision = mixed_precision
        self.dynamo_plugin = dynamo_plugin
        # FSDP is honoured on every device and process count (one process gets a one-rank
        # group from the engine); Megatron-LM's slot stays empty, as a request for it was
        # refused before the process group existed.
        self.fsdp_plugin = engines["fsdp_plugin"]
        self.deepspeed_plugins = deepspeed_plugin_mapping(engines["deepspeed_plugin"])
        # ParallelismConfig lives in accel (above this package); its public tp_enabled is
        # Accelerate's. Anything else given as parallelism_config is kept and asks for none.
        tensor_parallel = getattr(engines["parallelism_config"], "tp_enabled", False) is True
        self.engine = decide_engine(
            requests, self.distributed_type, tensor_parallel=tensor_parallel
        )
        # What the engine reports: its own type (FSDP, DEEPSPEED, XLA), or the layout's.
        if self.engine.distributed_type is not None:
            self.distributed_type = self.engine.distributed_type
        self.megatron_lm_plugin = None
        # The old spelling of ParallelismConfig(tp_size=...): the Accelerator turns it
        # into one (accel.parallelism), whose mesh trains it.
        self.torch_tp_plugin = engines["torch_tp_plugin"]
        # Checked against the world size by the Accelerator before this state existed;
        # the Accelerator builds the mesh (accel.parallelism) once the group exists.
        self.parallelism_config = engines["parallelism_config"]
        self.device_mesh = None
        self.use_ipex = False

    def _check_unchanged(
        self, mixed_precision: str | None, cpu: bool, engines: dict[str, Any]
    ) -> None:
        """Refuse arguments that would change an initialised state (it cannot change)."""
        if cpu and self.device.type != "cpu":
            raise ValueError(
                "AcceleratorState has already been initialized and cannot be changed, restart "
                "your runtime completely and pass `cpu=True` to `Accelerator()`."
            )
        if mixed_precision is not None and mixed_precision != self._mixed_precision:
            raise ValueError(
                "AcceleratorState has already been initialized and cannot be changed, restart "
                f"your runtime completely and pass `mixed_precision='{mixed_precision}'` to "
                "`Accelerator()`."
            )
        kind = self.distributed_type
        if engines["deepspeed_plugin"] is not None and kind != DistributedType.DEEPSPEED:
            raise ValueError(
                "AcceleratorState has already been initialized without DeepSpeed "
                f"({kind}) and cannot be changed: pass deepspeed_plugin to "
                "the first Accelerator of the process (or reset the state first)"
            )
        config = engines["parallelism_config"]
        if config is not None and config != self.parallelism_config:
            raise ValueError(
                "AcceleratorState has already been initialized with parallelism_config="
                f"{self.parallelism_config!r} and cannot be changed to {config!r}: "
                "pass it to the first Accelerator of the process (or reset the state first)"
            )
        if engines["fsdp_plugin"] is not None and kind != DistributedType.FSDP:
            raise ValueError(
                "AcceleratorState has already been initialized without FSDP "
                f"({kind}) and cannot be changed: pass fsdp_plugin to the "
                "first Accelerator of the process (or reset the state first), so that no "
                "model trains with another engine than the one asked for"
            )

    def __repr__(self) -> str:
        return PartialState().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"

    @property
    def initialized(self) -> bool:
        """Whether the state has been set up (its dict differs from ``PartialState``'s)."""
        return self._shared_state != PartialState._shared_state and self._shared_state != {}

    @property
    def mixed_precision(self) -> str:
        """The mixed precision in effect."""
        return self._mixed_precision

    @property
    def deepspeed_plugin(self) -> Any:
        """The active (selected) DeepSpeed plugin (None outside DeepSpeed)."""
        plugins = self.deepspeed_plugins
        if not plugins:
            return None
        for plugin in plugins.values():
            if getattr(plugin, "selected", False):
                return plugin
        return next(iter(plugins.values()))

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin registered under ``name``.

        Raises:
            ValueError: the run has no DeepSpeed plugins, or none under ``name``.
        """
        return self._deepspeed_plugins_checked(name)[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make the plugin under ``name`` the active one (the next ``prepare`` uses it).

        Raises:
            ValueError: the run has no DeepSpeed plugins, or none under ``name``.
        """
        _select_only(self._deepspeed_plugins_checked(name), str(name))

    def _deepspeed_plugins_checked(self, name: str | None) -> dict[str, Any]:
        plugins = self.deepspeed_plugins
        if not plugins:
            raise ValueError(
                f"DeepSpeed plugin {name!r} asked for, but this run has no DeepSpeed plugins: "
                "pass Accelerator(deepspeed_plugins={name: DeepSpeedPlugin(...), ...})"
            )
        if name not in plugins:
            raise ValueError(
                f"{name!r} is not a DeepSpeed plugin of this run: valid names are {sorted(plugins)}"
            )
        return plugins

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget the state; with ``reset_partial_state`` forget ``PartialState`` too."""
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (see ``PartialState.destroy_process_group``)."""
        PartialState().destroy_process_group(group)

    # Process questions. Accelerate's AcceleratorState asks PartialState() for these, so they
    # are still answered after AcceleratorState._reset_state() (its own test programs reset it
    # between phases), and PartialState is built again if it was reset. While both states are
    # set up they hold the same topology, and the answer comes from this one's copy.

    def _asked(self) -> PartialState | None:
        """``PartialState()`` when either state was reset, else None (this copy answers)."""
        if self._shared_state and PartialState._shared_state:
            return None
        return PartialState()

    @property
    def use_distributed(self) -> bool:
        """Whether several processes take part."""
        partial = self._asked()
        return super().use_distributed if partial is None else partial.use_distributed

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest rank."""
        partial = self._asked()
        return super().is_last_process if partial is None else partial.is_last_process

    @property
    def is_main_process(self) -> bool:
        """Whether this is the main process."""
        partial = self._asked()
        return super().is_main_process if partial is None else partial.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the main process of its node."""
        partial = self._asked()
        return super().is_local_main_process if partial is None else partial.is_local_main_process

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        partial = self._asked()
        if partial is None:
            super().wait_for_everyone()
        else:
            partial.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Split ``inputs`` between the processes (see ``PartialState``)."""
        partial = self._asked()
        owner: ProcessQueries = self if partial is None else partial
        with ProcessQueries.split_between_processes(owner, inputs, apply_padding) as part:
            yield part

    def __getattr__(self, name: str) -> Any:
        if name in self._known_attrs or is_property_of_reset_state(self, name):
            raise AttributeError(
                f"`AcceleratorState` object has no attribute `{name}`. "
                "This happens if `AcceleratorState._reset_state()` was called and "
                "an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'AcceleratorState' object has no attribute '{name}'")


def _refuse_engines_on_xla(requests: list[Any], cpu: bool) -> None:
    """Refuse FSDP, DeepSpeed and meshes in a process that will run on torch_xla's device.

    An XLA run trains replicated (every process holds the model, gradients are averaged in
    the optimizer step); torch_xla's own sharding (SPMD, FSDPv2) is not built.
    """
    override = read_variable(ACCEL_TORCH_DEVICE)
    if not requests or not xla.uses_xla(cpu, parse_device(override) if override else None):
        return
    request = requests[0]
    raise ValueError(
        f"{request.source} asks for {ENGINES[request.engine].title}, but torch_xla is "
        "installed, so this "
        "process runs on its XLA device, where accel trains replicated data parallel only "
        "(torch_xla's SPMD and FSDP are not built). Withdraw it "
        f"({request.undo}), or set USE_TORCH_XLA=false (or ACCEL_USE_CPU=true) to train "
        "with that engine without torch_xla"
    )


def deepspeed_plugin_mapping(given: Any) -> dict[str, Any] | None:
    """``{name: plugin}`` from one plugin or a mapping of them; the first becomes selected.

    Raises:
        ValueError: an empty mapping, or a name that is not a non-empty string.
    """
    if given is None:
        return None
    if not isinstance(given, dict):
        plugins = {"default": given}
    else:
        if not given:
            raise ValueError(
                "deepspeed_plugins={} holds no plugin: pass {name: DeepSpeedPlugin(...)} or "
                "deepspeed_plugin=DeepSpeedPlugin(...)"
            )
        bad = [name for name in given if not isinstance(name, str) or not name]
        if bad:
            raise ValueError(
                f"deepspeed_plugins names must be non-empty strings, got {bad!r}: they are what "
                "select_deepspeed_plugin(name) takes"
            )
        plugins = dict(given)
    _select_only(plugins, next(iter(plugins)))
    return plugins


def _select_only(plugins: dict[str, Any], name: str) -> None:
    """Select ``plugins[name]`` and unselect the others (objects without the methods skip)."""
    for key, plugin in plugins.items():
        method = getattr(plugin, "select" if key == name else "_unselect", None)
        if callable(method):
            if key == name:
                method(_from_accelerator_state=True)
            else:
                method()


def _validate_precision(value: str, name: str) -> str:
    lowered = str(value).lower()
    if lowered not in PrecisionType:
        raise ValueError(
            f"{name}={value!r} is not a mixed precision: choose one of "
            f"{', '.join(PrecisionType.list())}"
        )
    return lowered


def wait_for_everyone() -> None:
    """Block until every process reaches this call (a no-op with a single process)."""
    PartialState().wait_for_everyone()
