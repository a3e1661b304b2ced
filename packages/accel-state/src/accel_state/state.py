"""The shared state of a run: ``PartialState``, ``AcceleratorState`` and ``GradientState``.

All three are Borg singletons: every instance's ``__dict__`` *is* one class-level dict, so
any instance sees what the first one set up, and ``_reset_state()`` empties it in place (tests
call it after each test). ``PartialState`` answers "who am I": it reads the process topology,
picks the device, and joins the process group. ``AcceleratorState`` adds the training
configuration (mixed precision, engine plugins). ``GradientState`` carries the gradient
accumulation settings and the stack of active data loaders.

Unlike Accelerate, a bare ``PartialState()`` in a process that a launcher started as one of
several (torchrun, ``srun``, ``mpirun``) joins the group on a CPU-only machine too
(``MULTI_CPU`` over gloo) instead of silently running single-process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import process_group, xla
from .devices import (
    backend_for_device_type,
    default_device_type,
    device_count,
    parse_device,
    pin_to_numa_node_of,
    set_device,
)
from .engine_requests import (
    ENGINES,
    argument_requests,
    environment_requests,
    refuse_conflicting_engines,
    refuse_unavailable_engines,
)
from .enums import DistributedType, PrecisionType
from .environment import (
    ACCEL_CPU_AFFINITY,
    ACCEL_DEBUG_MODE,
    ACCEL_MIXED_PRECISION,
    ACCEL_TORCH_DEVICE,
    ACCEL_USE_CPU,
    FORK_LAUNCHED,
    parse_flag_from_env,
    warn_accelerate_variables,
)
from .kwargs import InitProcessGroupKwargs
from .topology import ProcessTopology, get_process_topology

__all__ = [
    "AcceleratorState",
    "GradientState",
    "PartialState",
    "deepspeed_plugin_mapping",
    "is_initialized",
    "wait_for_everyone",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: Distributed types whose processes talk through a torch.distributed process group.
TORCH_DISTRIBUTED_TYPES = frozenset(
    {
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
        DistributedType.DEEPSPEED,
        DistributedType.FSDP,
        DistributedType.MEGATRON_LM,
    }
)

_MULTI_TYPE_BY_DEVICE = {
    "cpu": DistributedType.MULTI_CPU,
    "cuda": DistributedType.MULTI_GPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
}


def is_initialized() -> bool:
    """Whether an ``AcceleratorState`` (hence an ``Accelerator``) has been set up."""
    return AcceleratorState._shared_state != {}


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    """Stand-in for a function that must not run on this process."""
    return None


class _ProcessQueries:
    """Queries and helpers shared by ``PartialState`` and ``AcceleratorState``.

    Both classes carry the same topology attributes (``distributed_type``,
    ``num_processes``, ``process_index``, ``local_process_index``, ``device``), so the
    methods below work on either.
    """

    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    debug: bool
    fork_launched: bool

    @property
    def initialized(self) -> bool:
        """Whether the state has been set up."""
        return self.__dict__ != {}

    @property
    def use_distributed(self) -> bool:
        """Whether several processes take part (any distributed type with more than one)."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest rank."""
        return self.process_index == self.num_processes - 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is the main process (rank 0; the last rank under Megatron-LM)."""
        if self.distributed_type == DistributedType.MEGATRON_LM:
            return self.is_last_process
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the main process of its node (local rank 0)."""
        if self.distributed_type == DistributedType.MEGATRON_LM:
            return self.is_last_process
        return self.local_process_index == 0

    @property
    def default_device(self) -> torch.device:
        """The best device available on this machine, ignoring the topology."""
        return torch.device(default_device_type())

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a no-op with a single process)."""
        if self.distributed_type == DistributedType.XLA and self.num_processes > 1:
            xla.rendezvous("accel.wait_for_everyone")
            return
        if self.distributed_type not in TORCH_DISTRIBUTED_TYPES:
            return
        if self.debug:
            process_group.verify_collective("wait_for_everyone", None, self.num_processes)
        try:
            dist.barrier()
        except RuntimeError as err:
            raise process_group.collective_failure("wait_for_everyone", err) from err

    def _goes_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others."""
        yield from self._goes_first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's local main process first, then on the others."""
        yield from self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of ``inputs`` for the block.

        The first ``len(inputs) % num_processes`` processes get one extra element. Lists,
        tuples, tensors and dicts of those (every value split alike) are supported; other
        objects are yielded unchanged. With ``apply_padding=True`` every process gets
        ``ceil(len / num_processes)`` elements, the last element repeated, so that the
        results can be gathered.

        Raises:
            ValueError: the values of a dict do not all have the same length.
        """
        if self.num_processes == 1 or not hasattr(inputs, "__len__"):
            yield inputs
            return
        if isinstance(inputs, dict):
            lengths = {key: len(value) for key, value in inputs.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    "split_between_processes: all values of the dict must have the same length "
                    f"to be split alike, got lengths {lengths}; pad or trim the values of keys "
                    f"{sorted(lengths, key=str)} to one length"
                )
            length = next(iter(lengths.values()), 0)
        else:
            length = len(inputs)
        per_process, extras = divmod(length, self.num_processes)
        start = self.process_index * per_process + min(self.process_index, extras)
        end = start + per_process + (1 if self.process_index < extras else 0)
        padded_length = per_process + (1 if extras > 0 else 0)

        def _split(values: Any) -> Any:
            if isinstance(values, dict):
                return {key: _split(value) for key, value in values.items()}
            if not isinstance(values, (list, tuple, torch.Tensor)):
                select = getattr(values, "select", None)
                if callable(select) and hasattr(values, "__len__"):  # a datasets.Dataset
                    # As for lists: a rank past the end gets the last row; padding repeats it.
                    size = len(values)
                    stop = min(end, size)
                    indices = list(range(min(start, max(size - 1, 0)), stop))
                    if apply_padding and indices:
                        indices += [indices[-1]] * (padded_length - len(indices))
                    return select(indices)
                return values
            result = values[start:end] if start < len(values) else values[-1:]
            if not apply_padding or len(result) >= padded_length:
                return result
            missing = padded_length - len(result)
            if isinstance(result, torch.Tensor):
                return torch.cat([result, result[-1:].expand(missing, *result.shape[1:])])
            filler: Any = type(result)([result[-1]] * missing)
            return result + filler

        yield _split(inputs)

    def on_main_process(self, function: _F | None = None) -> _F:
        """Decorate ``function`` so that it only runs on the main process.

        Raises:
            ValueError: the state has not been initialised.
        """
        if not self.initialized:
            raise ValueError(
                "The `PartialState` or `Accelerator` must be initialized before calling this "
                "function."
            )
        if self.is_main_process or not self.use_distributed:
            return function  # type: ignore[return-value]
        return _do_nothing  # type: ignore[return-value]

    def on_local_main_process(self, function: _F | None = None) -> _F:
        """Decorate ``function`` so that it only runs on each node's local main process."""
        if self.is_local_main_process or not self.use_distributed:
            return function  # type: ignore[return-value]
        return _do_nothing  # type: ignore[return-value]

    def on_last_process(self, function: _F) -> _F:
        """Decorate ``function`` so that it only runs on the last process."""
        if self.is_last_process or not self.use_distributed:
            return function
        return _do_nothing  # type: ignore[return-value]

    def on_process(self, function: _F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` so that it only runs on the process of rank ``process_index``.

        Use as ``@state.on_process(process_index=1)``.
        """
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if self.process_index == process_index or not self.use_distributed:
            return function
        return _do_nothing

    def on_local_process(
        self, function: _F | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorate ``function`` so that it only runs on the process of that local rank."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if self.local_process_index == local_process_index or not self.use_distributed:
            return function
        return _do_nothing

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on each node's local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)


class PartialState(_ProcessQueries):
    """Who this process is: its rank, its device, and the process group it belongs to.

    The first construction reads the topology (torchrun, SLURM, Open MPI, PMI variables),
    chooses the device (CUDA > XPU > MPS > CPU, ``ACCEL_TORCH_DEVICE`` overrides, ``cpu=True``
    or ``ACCEL_USE_CPU`` forces the CPU) and, when several processes take part, joins the
    ``torch.distributed`` group. Later constructions return views of the same state.

    Args:
        cpu: Use the CPU even if an accelerator is available.
        **kwargs: ``backend``, ``init_method`` and ``timeout`` for the process group (see
            :class:`~accel_state.InitProcessGroupKwargs`); others go to
            ``torch.distributed.init_process_group``.

    Raises:
        ValueError: the topology variables are inconsistent, the requested backend does not
            work with the device, or ``ACCEL_TORCH_DEVICE`` is not a device.
    """

    _shared_state: dict[str, Any] = {}
    _known_attrs = [
        "_cpu",
        "_mixed_precision",
        "_shared_state",
        "backend",
        "debug",
        "device",
        "distributed_type",
        "fork_launched",
        "local_process_index",
        "num_processes",
        "process_index",
        "topology",
    ]

    backend: str | None
    topology: ProcessTopology
    _cpu: bool

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        try:
            self._setup(cpu, kwargs)
        except BaseException:
            self._shared_state.clear()
            raise

    def _setup(self, cpu: bool, kwargs: dict[str, Any]) -> None:
        cpu = cpu or parse_flag_from_env(ACCEL_USE_CPU)
        override = os.environ.get(ACCEL_TORCH_DEVICE)
        device_override = parse_device(override) if override else None
        if xla.uses_xla(cpu, device_override):
            self._setup_xla()
            return
        topology = get_process_topology()
        if cpu:
            device_type = "cpu"
        elif device_override is not None:
            device_type = device_override.type
        else:
            device_type = default_device_type()

        if not topology.is_distributed and dist.is_available() and dist.is_initialized():
            # A group created before us (by the user or a launcher): adopt its topology.
            world = dist.get_world_size()
            topology = ProcessTopology(
                dist.get_rank(),
                world,
                int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                1,
                None,
                None,
                "torch.distributed",
            )

        self._cpu = cpu
        self.debug = parse_flag_from_env(ACCEL_DEBUG_MODE)
        self.fork_launched = parse_flag_from_env(FORK_LAUNCHED)
        self.topology = topology
        self.num_processes = topology.world_size
        self.process_index = topology.rank
        self.local_process_index = topology.local_rank

        if topology.is_distributed:
            requested = kwargs.pop("backend", None)
            if dist.is_initialized():
                self.backend = str(dist.get_backend())
            else:
                self.backend = backend_for_device_type(device_type, requested)
            # Built after the backend is known: the default timeout depends on it.
            group_kwargs = InitProcessGroupKwargs(
                backend=self.backend,
                init_method=kwargs.pop("init_method", None),
                timeout=kwargs.pop("timeout", None),
            )
            self.distributed_type = _MULTI_TYPE_BY_DEVICE[device_type]
            if device_type == "cpu":
                self.device = device_override or torch.device("cpu")
                _set_cpu_threads(topology.local_world_size)
            else:
                index = topology.local_rank % max(1, device_count(device_type))
                self.device = device_override or torch.device(device_type, index)
                set_device(self.device)
                if parse_flag_from_env(ACCEL_CPU_AFFINITY):
                    pin_to_numa_node_of(self.device)
            assert group_kwargs.timeout is not None
            process_group.init_process_group(
                topology,
                self.backend,
                timeout=group_kwargs.timeout,
                init_method=group_kwargs.init_method,
                **kwargs,
            )
        else:
            self.backend = None
            self.distributed_type = DistributedType.NO
            self.device = device_override or torch.device(device_type)
        if self.process_index == 0:
            warn_accelerate_variables()

    def _setup_xla(self) -> None:
        """An XLA process: torch_xla's device, world size and ordinals; no process group."""
        device = xla.xla_device()
        world, ordinal, local, local_world = xla.runtime_topology(device)
        self._cpu = False
        self.debug = parse_flag_from_env(ACCEL_DEBUG_MODE)
        self.fork_launched = parse_flag_from_env(FORK_LAUNCHED)
        self.topology = ProcessTopology(
            ordinal, world, local, local_world, max(1, world // local_world), None, None, "xla"
        )
        self.backend = "xla"
        self.distributed_type = DistributedType.XLA
        self.device = device
        self.num_processes = world
        self.process_index = ordinal
        self.local_process_index = local
        if ordinal == 0:
            warn_accelerate_variables()

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}"
            f"{'  Backend: ' + self.backend if self.backend else ''}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the state (tests use this); the process group is left as it is."""
        PartialState._shared_state.clear()

    def set_device(self) -> None:
        """Make this process's device the current one of its backend (XLA: already is)."""
        if self.distributed_type != DistributedType.XLA:
            set_device(self.device)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (left to the launcher when it forked this process)."""
        if self.fork_launched and group is None:
            return
        process_group.destroy_process_group(group)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup failed: explain the usual cause (a property such
        # as ``use_distributed`` fails too when the state it reads was reset).
        if name in self._known_attrs or _is_property_of_reset_state(self, name):
            raise AttributeError(
                f"`PartialState` object has no attribute `{name}`. "
                "This happens if `PartialState._reset_state()` was called and "
                "an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'PartialState' object has no attribute '{name}'")


def _is_property_of_reset_state(state: Any, name: str) -> bool:
    """Whether ``name`` is a property of ``state``'s class that failed on a reset state."""
    return not state._shared_state and isinstance(getattr(type(state), name, None), property)


def _set_cpu_threads(local_world_size: int) -> None:
    """Share the physical cores between the processes of a node unless the user chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(max(1, physical // max(1, local_world_size)))


class AcceleratorState(_ProcessQueries):
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
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        cpu = cpu or parse_flag_from_env(ACCEL_USE_CPU)
        if mixed_precision is not None:
            mixed_precision = _validate_precision(mixed_precision, "mixed_precision")
        if self.initialized:
            self._check_initialized(mixed_precision, cpu)
            if deepspeed_plugin is not None and self.distributed_type != DistributedType.DEEPSPEED:
                raise ValueError(
                    "AcceleratorState has already been initialized without DeepSpeed "
                    f"({self.distributed_type}) and cannot be changed: pass deepspeed_plugin to "
                    "the first Accelerator of the process (or reset the state first)"
                )
            if parallelism_config is not None and parallelism_config != self.parallelism_config:
                raise ValueError(
                    "AcceleratorState has already been initialized with parallelism_config="
                    f"{self.parallelism_config!r} and cannot be changed to {parallelism_config!r}: "
                    "pass it to the first Accelerator of the process (or reset the state first)"
                )
            if fsdp_plugin is not None and self.distributed_type != DistributedType.FSDP:
                raise ValueError(
                    "AcceleratorState has already been initialized without FSDP "
                    f"({self.distributed_type}) and cannot be changed: pass fsdp_plugin to the "
                    "first Accelerator of the process (or reset the state first), so that no "
                    "model trains with another engine than the one asked for"
                )
            return
        env_precision = os.environ.get(ACCEL_MIXED_PRECISION)
        if mixed_precision is None:
            mixed_precision = _validate_precision(env_precision or "no", ACCEL_MIXED_PRECISION)
        requests = [
            *argument_requests(
                "Accelerator" if _from_accelerator else "AcceleratorState",
                {
                    "deepspeed_plugin": deepspeed_plugin,
                    "fsdp_plugin": fsdp_plugin,
                    "torch_tp_plugin": torch_tp_plugin,
                    "megatron_lm_plugin": megatron_lm_plugin,
                    "parallelism_config": parallelism_config,
                },
            ),
            *environment_requests(os.environ),
        ]
        refuse_conflicting_engines(requests)
        refuse_unavailable_engines(requests)
        if not PartialState._shared_state:
            _refuse_engines_on_xla(requests, cpu)
        partial = PartialState(cpu, **kwargs)
        self._shared_state.update(partial._shared_state)
        try:
            self.downcast_bfloat = False
            if self.distributed_type == DistributedType.XLA and xla.is_tpu():
                self.downcast_bfloat = xla.bf16_environment(mixed_precision)
            self._mixed_precision = mixed_precision
            self.dynamo_plugin = dynamo_plugin
            # FSDP is honoured on every device and process count (one process gets a one-rank
            # group from the engine); the other engine slots stay empty, as every other
            # engine request was refused above.
            self.fsdp_plugin = fsdp_plugin
            if any(request.engine == "fsdp" for request in requests):
                self.distributed_type = DistributedType.FSDP
            self.deepspeed_plugins = deepspeed_plugin_mapping(deepspeed_plugin)
            if any(request.engine == "deepspeed" for request in requests):
                self.distributed_type = DistributedType.DEEPSPEED
            self.megatron_lm_plugin = None
            # The old spelling of ParallelismConfig(tp_size=...): the Accelerator turns it
            # into one (accel.parallelism), whose mesh trains it.
            self.torch_tp_plugin = torch_tp_plugin
            # Checked against the world size by the Accelerator before this state existed;
            # the Accelerator builds the mesh (accel.parallelism) once the group exists.
            self.parallelism_config = parallelism_config
            self.device_mesh = None
            self.use_ipex = False
        except BaseException:
            self._shared_state.clear()
            raise

    def _check_initialized(self, mixed_precision: str | None, cpu: bool) -> None:
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

    def __getattr__(self, name: str) -> Any:
        if name in self._known_attrs or _is_property_of_reset_state(self, name):
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
    override = os.environ.get(ACCEL_TORCH_DEVICE)
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


class GradientState:
    """Gradient-accumulation settings, the accumulation state machine and the active loaders.

    The state machine is :meth:`advance`: every training micro-batch calls it once (accel-amp's
    ``GradientAccumulator.accumulate`` does) and it decides ``sync_gradients``, the one flag
    that ``no_sync``, the optimizer, the scheduler and clipping all read.

    Args:
        gradient_accumulation_plugin: An object with ``to_kwargs()`` (accel-amp's
            ``GradientAccumulationPlugin``); its non-default fields become ``plugin_kwargs``.
            A later construction with different settings replaces them.
    """

    _shared_state: dict[str, Any] = {}

    sync_gradients: bool
    plugin_kwargs: dict[str, Any]
    step: int
    micro_batches_in_window: int
    _window_closed: bool
    _dataloader_references: list[Any]
    _is_xla_gradients_synced: bool

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.step = 0
            self.micro_batches_in_window = 0
            self._window_closed = True
            self._dataloader_references = [None]
            self.plugin_kwargs = (
                gradient_accumulation_plugin.to_kwargs()
                if gradient_accumulation_plugin is not None
                else {}
            )
            self._is_xla_gradients_synced = False
        elif gradient_accumulation_plugin is not None:
            kwargs = gradient_accumulation_plugin.to_kwargs()
            if kwargs != self.plugin_kwargs:
                self.plugin_kwargs = kwargs

    @property
    def initialized(self) -> bool:
        """Whether the state has been set up."""
        return GradientState._shared_state != {}

    @property
    def num_steps(self) -> int:
        """Number of micro-batches accumulated before the optimizer steps."""
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def adjust_scheduler(self) -> bool:
        """Whether a prepared scheduler counts optimizer steps (``True``) or micro-batches.

        ``True`` (the plugin's default) advances the scheduler only when the optimizer
        steps; ``False`` advances it on every micro-batch, for schedules sized in
        micro-batches. Accelerate reads ``False`` here by default and ignores the value.
        """
        return bool(self.plugin_kwargs.get("adjust_scheduler", True))

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether gradients are synchronised at the end of each data loader."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised on every batch (saves memory, costs speed)."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_dataloader(self) -> Any:
        """The innermost data loader being iterated, or ``None``."""
        reference = self._dataloader_references[-1]
        return reference() if reference is not None else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active data loader is yielding its last batch."""
        if not self.in_dataloader:
            return False
        return bool(self.active_dataloader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Samples in the active loader's last batch that are padding (-1 if unknown)."""
        if not self.in_dataloader:
            return -1
        return int(self.active_dataloader.remainder)

    def advance(self) -> bool:
        """Begin a micro-batch and decide whether it completes an accumulation window.

        A window closes every ``num_steps`` micro-batches and, with ``sync_with_dataloader``,
        on the last batch of the active data loader (which also restarts the count, so each
        epoch starts a fresh window). Sets and returns ``sync_gradients``; afterwards
        ``micro_batches_in_window`` counts the micro-batches of the current window,
        this one included.
        """
        if self._window_closed:
            self.micro_batches_in_window = 0
        self.micro_batches_in_window += 1
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            sync = True
        else:
            self.step += 1
            sync = self.step % self.num_steps == 0
        self._window_closed = sync
        self.sync_gradients = sync
        return sync

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients
        if sync_gradients and PartialState._shared_state.get("distributed_type") == (
            DistributedType.XLA
        ):
            # The micro-batches' lazy graph runs before the synchronising step is traced.
            xla.mark_step()

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window has begun and not completed (gradients pending)."""
        return not self._window_closed

    def state_dict(self) -> dict[str, Any]:
        """The state machine's counters, for exact resume (see :meth:`load_state_dict`)."""
        return {
            "step": self.step,
            "micro_batches_in_window": self.micro_batches_in_window,
            "window_closed": self._window_closed,
            "sync_gradients": self.sync_gradients,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters that :meth:`state_dict` returned.

        Raises:
            KeyError: a counter is missing (the message names it).
        """
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise KeyError(f"GradientState.load_state_dict: missing counters {missing}")
        self.step = int(state["step"])
        self.micro_batches_in_window = int(state["micro_batches_in_window"])
        self._window_closed = bool(state["window_closed"])
        self.sync_gradients = bool(state["sync_gradients"])

    def _add_dataloader(self, dataloader: Any) -> None:
        self._dataloader_references.append(weakref.ref(dataloader))

    def _remove_dataloader(self, dataloader: Any) -> None:
        for index in range(len(self._dataloader_references) - 1, 0, -1):
            reference = self._dataloader_references[index]
            if reference is not None and reference() is dataloader:
                del self._dataloader_references[index]
                return

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the state (tests use this)."""
        GradientState._shared_state.clear()


def wait_for_everyone() -> None:
    """Block until every process reaches this call (a no-op with a single process)."""
    PartialState().wait_for_everyone()
