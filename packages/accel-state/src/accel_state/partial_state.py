"""Who this process is: ``PartialState``, and the queries it shares with ``AcceleratorState``.

``PartialState`` is a Borg singleton: every instance's ``__dict__`` *is* one class-level dict,
so any instance sees what the first one set up, and ``_reset_state()`` empties it in place
(tests call it after each test). It reads the process topology, picks the device, and joins
the process group. :class:`ProcessQueries` holds what both it and ``AcceleratorState`` answer
from the topology attributes (ranks, main-process decorators, barriers, splitting inputs).

Unlike Accelerate, a bare ``PartialState()`` in a process that a launcher started as one of
several (torchrun, ``srun``, ``mpirun``) joins the group on a CPU-only machine too
(``MULTI_CPU`` over gloo) instead of silently running single-process.
"""

from __future__ import annotations

import contextlib
import functools
import os
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
from .enums import DistributedType
from .environment import (
    ACCEL_CPU_AFFINITY,
    ACCEL_DEBUG_MODE,
    ACCEL_TORCH_DEVICE,
    ACCEL_USE_CPU,
    FORK_LAUNCHED,
    parse_flag_from_env,
    read_variable,
    warn_accelerate_variables,
)
from .kwargs import InitProcessGroupKwargs
from .topology import ProcessTopology, get_process_topology

__all__ = [
    "TORCH_DISTRIBUTED_TYPES",
    "PartialState",
    "ProcessQueries",
    "is_property_of_reset_state",
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


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    """Stand-in for a function that must not run on this process."""
    return None


class ProcessQueries:
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


class PartialState(ProcessQueries):
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
        override = read_variable(ACCEL_TORCH_DEVICE)
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
        if name in self._known_attrs or is_property_of_reset_state(self, name):
            raise AttributeError(
                f"`PartialState` object has no attribute `{name}`. "
                "This happens if `PartialState._reset_state()` was called and "
                "an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'PartialState' object has no attribute '{name}'")


def is_property_of_reset_state(state: Any, name: str) -> bool:
    """Whether ``name`` is a property of ``state``'s class that failed on a reset state."""
    return not state._shared_state and isinstance(getattr(type(state), name, None), property)


def _set_cpu_threads(local_world_size: int) -> None:
    """Share the physical cores between the processes of a node unless the user chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(max(1, physical // max(1, local_world_size)))
