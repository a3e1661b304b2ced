"""The Accelerator's own configuration objects: DDP, profiler, project layout, torch.compile.

Kwargs handlers defined lower down are re-exported by ``accel`` (``InitProcessGroupKwargs``
from accel-state, ``AutocastKwargs`` / ``GradScalerKwargs`` from accel-amp); these are the ones
only the Accelerator uses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from accel_state import BaseEnum, DynamoBackend
from accel_state.environment import (
    ACCEL_DYNAMO_BACKEND,
    ACCEL_DYNAMO_MODE,
    ACCEL_DYNAMO_USE_DYNAMIC,
    ACCEL_DYNAMO_USE_FULLGRAPH,
    ACCEL_DYNAMO_USE_REGIONAL_COMPILATION,
    lookup_variable,
    parse_flag_from_env,
    read_variable,
)
from accel_state.kwargs import KwargsHandler

__all__ = [
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
]


class DDPCommunicationHookType(BaseEnum):
    """Gradient-communication hooks for DDP (compression before the all-reduce)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


_HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel`` and its comm hook.

    Args:
        dim: Passed to DDP (the batch dimension).
        broadcast_buffers: Passed to DDP.
        bucket_cap_mb: Passed to DDP.
        find_unused_parameters: Passed to DDP.
        check_reduction: Passed to DDP.
        gradient_as_bucket_view: Passed to DDP.
        static_graph: Passed to DDP.
        comm_hook: Compression hook: ``fp16``, ``bf16``, ``power_sgd``, ``batched_power_sgd``.
        comm_wrapper: ``fp16`` / ``bf16`` wrapper around a PowerSGD hook.
        comm_state_option: Keyword arguments of ``PowerSGDState``.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: Literal["no", "fp16", "bf16"] | DDPCommunicationHookType = (
        DDPCommunicationHookType.NO
    )
    comm_state_option: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        if self.comm_wrapper not in (
            DDPCommunicationHookType.NO,
            DDPCommunicationHookType.FP16,
            DDPCommunicationHookType.BF16,
        ):
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper.value!r}): a "
                "wrapper is 'no', 'fp16' or 'bf16'"
            )

    def to_dict(self, ignore_keys: tuple[str, ...] = _HOOK_FIELDS) -> dict[str, Any]:
        """The fields passed to DDP (the hook settings are left out by default)."""
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def to_kwargs(self) -> dict[str, Any]:
        """The DDP keyword arguments that differ from the defaults."""
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Register the configured communication hook on a DDP ``model``."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[DDPCommunicationHookType, Callable[..., Any]] = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        hook = hooks[self.comm_hook]
        state: Any = None
        if self.comm_hook in (
            DDPCommunicationHookType.POWER_SGD,
            DDPCommunicationHookType.BATCHED_POWER_SGD,
        ):
            state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
            if self.comm_wrapper == DDPCommunicationHookType.FP16:
                hook = default_hooks.fp16_compress_wrapper(hook)
            elif self.comm_wrapper == DDPCommunicationHookType.BF16:
                hook = default_hooks.bf16_compress_wrapper(hook)
        model.register_comm_hook(state, hook)  # type: ignore[operator]


def _hook_type(value: Any, name: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(str(getattr(value, "value", value)).lower())
    except ValueError:
        raise ValueError(
            f"DistributedDataParallelKwargs({name}={value!r}): choose one of "
            f"{', '.join(DDPCommunicationHookType.list())}"
        ) from None


_ACTIVITIES = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "xpu": "XPU",
    "mtia": "MTIA",
    "hpu": "HPU",
}


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments for ``torch.profiler.profile`` used by ``Accelerator.profile()``.

    Args:
        activities: Subset of ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"``
            (``None``: torch's default).
        schedule_option: Keyword arguments of ``torch.profiler.schedule`` (``wait``,
            ``warmup``, ``active``, ``repeat``, ``skip_first``).
        on_trace_ready: Called by torch when a trace is ready.
        record_shapes: torch's flag of the same name.
        profile_memory: torch's flag of the same name.
        with_stack: torch's flag of the same name.
        with_flops: torch's flag of the same name.
        with_modules: torch's flag of the same name.
        output_trace_dir: Where each process writes ``profile_<rank>.json`` on exit.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for activity in self.activities or []:
            if activity not in _ACTIVITIES:
                raise ValueError(
                    f"ProfileKwargs(activities=[..., {activity!r}]): choose from "
                    f"{', '.join(_ACTIVITIES)}"
                )

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` configured from these fields."""
        activities = (
            [getattr(torch.profiler.ProfilerActivity, _ACTIVITIES[a]) for a in self.activities]
            if self.activities is not None
            else None
        )
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a run keeps its logs and checkpoints.

    Args:
        project_dir: Root folder of the run.
        logging_dir: Folder for trackers (default: ``project_dir``).
        automatic_checkpoint_naming: Name checkpoints ``checkpoints/checkpoint_<n>``.
        total_limit: Keep at most this many automatic checkpoints.
        iteration: The number of the next automatic checkpoint.
        save_on_each_node: Save on every node's main process instead of only the first.
        async_save: ``save_state()`` returns once the state is copied into host memory and
            writes the files in the background (accel's addition; see
            ``Accelerator.save_state``).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir`` and default ``logging_dir`` to it."""
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def __post_init__(self) -> None:
        if self.project_dir is not None:
            self.project_dir = os.fspath(Path(self.project_dir))
        self.set_directories(self.project_dir)
        if self.total_limit is not None and (
            isinstance(self.total_limit, bool)
            or not isinstance(self.total_limit, int)
            or self.total_limit < 1
        ):
            raise ValueError(
                f"ProjectConfiguration(total_limit={self.total_limit!r}): must be an integer "
                ">= 1, or None to keep every checkpoint"
            )
        if not isinstance(self.async_save, bool):
            raise ValueError(
                f"ProjectConfiguration(async_save={self.async_save!r}): must be True or False"
            )


@dataclasses.dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How ``prepare`` compiles models with ``torch.compile``.

    Every setting left at ``None`` is read from the environment, as in Accelerate (transformers'
    ``Trainer`` passes ``backend=None`` unless ``torch_compile_backend`` is set).

    Args:
        backend: A ``DynamoBackend`` (``"no"`` disables compilation); ``None``:
            ``ACCEL_DYNAMO_BACKEND``, else ``"no"``.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ...; ``None``:
            ``ACCEL_DYNAMO_MODE``, else ``"default"``.
        fullgraph: Compile the whole model as one graph; ``None``: ``ACCEL_DYNAMO_USE_FULLGRAPH``.
        dynamic: Dynamic shapes; ``None``: ``ACCEL_DYNAMO_USE_DYNAMIC`` when set, else torch
            decides.
        options: Backend options.
        disable: Turn ``torch.compile`` into a no-op.
        use_regional_compilation: Compile each repeated block once instead of the whole model;
            ``None``: ``ACCEL_DYNAMO_USE_REGIONAL_COMPILATION``.

    Raises:
        ValueError: an unknown backend (given or from the environment).
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        backend = self.backend
        source = "backend"
        if backend is None:
            source, backend = lookup_variable(ACCEL_DYNAMO_BACKEND) or ("backend", "no")
        name = str(getattr(backend, "value", backend)).upper()
        if name not in DynamoBackend:
            raise ValueError(
                f"TorchDynamoPlugin({source}={backend!r}): choose one of "
                f"{', '.join(b.lower() for b in DynamoBackend.list())}"
            )
        self.backend = DynamoBackend(name)
        if self.mode is None:
            self.mode = read_variable(ACCEL_DYNAMO_MODE) or "default"
        if self.fullgraph is None:
            self.fullgraph = parse_flag_from_env(ACCEL_DYNAMO_USE_FULLGRAPH)
        if self.dynamic is None and read_variable(ACCEL_DYNAMO_USE_DYNAMIC) is not None:
            self.dynamic = parse_flag_from_env(ACCEL_DYNAMO_USE_DYNAMIC)
        if self.use_regional_compilation is None:
            self.use_regional_compilation = parse_flag_from_env(
                ACCEL_DYNAMO_USE_REGIONAL_COMPILATION
            )

    @property
    def enabled(self) -> bool:
        """Whether models are compiled."""
        return self.backend != DynamoBackend.NO

    def to_dict(self) -> dict[str, Any]:
        """The settings, with the backend as ``torch.compile`` names it (lower case)."""
        settings = super().to_dict()
        settings["backend"] = DynamoBackend(self.backend).value.lower()
        return settings

    def to_kwargs(self) -> dict[str, Any]:
        """The changed settings that are ``torch.compile`` arguments (not regional compilation)."""
        changed = super().to_kwargs()
        changed.pop("use_regional_compilation", None)
        return changed

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` (``mode`` and ``options`` exclude each other)."""
        kwargs: dict[str, Any] = {
            "backend": DynamoBackend(self.backend).value.lower(),
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "disable": self.disable,
        }
        if self.options is not None:
            kwargs["options"] = self.options
        else:
            kwargs["mode"] = self.mode
        return kwargs
