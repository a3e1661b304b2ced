"""The engine registry: every way accel trains, one row each, and how a run asks for one.

:data:`REGISTRY` is the one table of engines. Each row says what the engine is called, the
``accel launch`` flag, the ``ACCEL_USE_*`` switch and the ``Accelerator`` arguments that ask
for it, the config file's ``distributed_type`` it answers to, whether this release builds it,
and its class as ``"module:Class"`` (imported only when a run trains with it). ``accel
launch`` (accel-launch), ``AcceleratorState`` (here) and the ``Accelerator`` (accel) all read
it, which is why it lives in the lowest package; adding an engine is one row here and one
class in ``accel.engines``.

A run can ask for an engine other than one device or DDP in five ways: an Accelerator
argument (a plugin), an environment switch (``ACCEL_USE_FSDP=true``, usually written by
``accel launch``), a launch flag (``--use_fsdp``), a config file (``distributed_type: FSDP``)
and the ``accel config`` questionnaire. Each engine that this release does not implement is
refused on every one of those paths, before any process trains, by
:func:`refuse_unavailable_engines`: an engine that was asked for is honoured or refused, never
dropped or swapped for DDP (Accelerate 1.15 drops an FSDP or DeepSpeed plugin on a CPU run
without a word and trains DDP). :func:`decide_engine` then picks the row the run trains with,
once, from the requests and the process layout.

Accelerate's own switches (``ACCELERATE_USE_FSDP`` and friends, which ``accelerate launch``
writes) count as requests too: a script moved from Accelerate and started by Accelerate's
launcher must not train silently with another engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch

from .enums import DistributedType
from .environment import (
    ACCEL_USE_DEEPSPEED,
    ACCEL_USE_FSDP,
    ACCEL_USE_MEGATRON_LM,
    ACCEL_USE_PARALLELISM_CONFIG,
    str_to_bool,
)
from .torch_support import TORCH_FEATURES, torch_has

__all__ = [
    "ENGINES",
    "REGISTRY",
    "PARALLELISM_NOT_BUILT",
    "EngineRequest",
    "EngineSpec",
    "EngineUnavailableError",
    "accelerate_switch",
    "argument_requests",
    "config_requests",
    "decide_engine",
    "engine_for_distributed_type",
    "environment_requests",
    "refuse_conflicting_engines",
    "refuse_unavailable_engines",
]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine a run can ask for.

    Attributes:
        key: Short name (``"fsdp"``, ``"deepspeed"``, ...).
        title: What users call it, for messages.
        switch: The ``ACCEL_USE_*`` variable that asks for it (None: no switch).
        flag: The ``accel launch`` flag that asks for it.
        available: Whether this release implements it.
        instead: What a user can do today, for the refusal message.
        engine_class: The class that trains with it, as ``"module:Class"`` (None: not built).
        distributed_type: What the run's ``distributed_type`` is under it (None: the process
            layout's, ``NO`` or ``MULTI_*``).
        arguments: The ``Accelerator`` / ``AcceleratorState`` arguments that ask for it.
        exclusive: Whether it owns the whole model (a run asks for one such engine at most).
        settings: The config file section holding its launch settings (``fsdp_config``), if
            ``accel launch`` resolves and exports settings for it.
        requestable: Whether a run asks for it (False for one device and DDP, which follow
            from the process layout).
        layouts: The process layouts it trains under when nothing else was asked for (one
            device: ``NO``; DDP: the ``MULTI_*`` types of torch.distributed's backends).
        torch_feature: The :data:`~accel_state.torch_support.TORCH_FEATURES` key it needs
            beyond the torch floor (None: the floor suffices); without it the engine is refused
            like one this release does not build.
    """

    key: str
    title: str
    switch: str | None
    flag: str
    available: bool
    instead: str
    engine_class: str | None = None
    distributed_type: DistributedType | None = None
    arguments: tuple[str, ...] = ()
    exclusive: bool = False
    settings: str | None = None
    requestable: bool = True
    layouts: tuple[DistributedType, ...] = ()
    torch_feature: str | None = None


_DDP_INSTEAD = (
    "to train with DDP instead (every process then holds the whole model, its gradients and "
    "its optimizer state), or run this script with Accelerate"
)

#: Every engine accel knows, one row each: the one table (see the module docstring).
REGISTRY: tuple[EngineSpec, ...] = (
    EngineSpec(
        "single",
        "one device",
        None,
        "--num_processes 1",
        True,
        "",
        engine_class="accel.engines.single:SingleDeviceEngine",
        requestable=False,
        layouts=(DistributedType.NO,),
    ),
    EngineSpec(
        "ddp",
        "DDP (distributed data parallel)",
        None,
        "--multi_gpu",
        True,
        "",
        engine_class="accel.engines.ddp:DDPEngine",
        requestable=False,
        layouts=(
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
            DistributedType.MULTI_XPU,
            DistributedType.MULTI_NPU,
            DistributedType.MULTI_MLU,
            DistributedType.MULTI_SDAA,
            DistributedType.MULTI_MUSA,
            DistributedType.MULTI_HPU,
        ),
    ),
    EngineSpec(
        "fsdp",
        "FSDP (fully sharded data parallel)",
        ACCEL_USE_FSDP,
        "--use_fsdp",
        True,
        _DDP_INSTEAD,
        engine_class="accel.engines.fsdp2:FSDP2Engine",
        distributed_type=DistributedType.FSDP,
        arguments=("fsdp_plugin",),
        exclusive=True,
        settings="fsdp_config",
        torch_feature="fully_shard",
    ),
    EngineSpec(
        "deepspeed",
        "DeepSpeed (ZeRO)",
        ACCEL_USE_DEEPSPEED,
        "--use_deepspeed",
        True,
        _DDP_INSTEAD,
        engine_class="accel.engines.deepspeed:DeepSpeedZeroEngine",
        distributed_type=DistributedType.DEEPSPEED,
        arguments=("deepspeed_plugin", "deepspeed_plugins"),
        exclusive=True,
        settings="deepspeed_config",
    ),
    EngineSpec(
        "megatron_lm",
        "Megatron-LM",
        ACCEL_USE_MEGATRON_LM,
        "--use_megatron_lm",
        False,
        "to train with DDP instead. accel deliberately does not build Megatron-LM (its own "
        "loop, GPU only, BERT/GPT/T5 model providers): a model too big for one device "
        "trains with FSDP2 and tensor parallelism (ParallelismConfig(dp_shard_size=..., "
        "tp_size=...) with fsdp_plugin; accel.utils.apply_tensor_parallel splits it)",
        distributed_type=DistributedType.MEGATRON_LM,
        arguments=("megatron_lm_plugin",),
        exclusive=True,
    ),
    EngineSpec(
        # Its class trains tensor parallelism alone; with an FSDP plugin the mesh is FSDP2's
        # and with data parallelism alone it is DDP's (see decide_engine).
        "parallelism_config",
        "ParallelismConfig (HSDP, tensor, context and sequence parallelism)",
        ACCEL_USE_PARALLELISM_CONFIG,
        "--use_parallelism_config",
        True,
        _DDP_INSTEAD,
        engine_class="accel.engines.tensor_parallel:TensorParallelEngine",
        arguments=("torch_tp_plugin", "parallelism_config"),
    ),
    EngineSpec(
        "xla",
        "XLA / TPU (torch_xla)",
        None,
        "--tpu",
        True,
        "to train on CPU or GPU processes instead",
        engine_class="accel.engines.xla:XLAEngine",
        distributed_type=DistributedType.XLA,
    ),
)

#: The engines a run can ask for (besides one device and DDP), by key: a view of
#: :data:`REGISTRY` that every request path reads.
ENGINES: dict[str, EngineSpec] = {spec.key: spec for spec in REGISTRY if spec.requestable}


#: ``ParallelismConfig`` sizes whose kind of parallelism this release does not build: a size
#: above 1 is refused (by ``accel launch`` and by the Accelerator) before any process group.
PARALLELISM_NOT_BUILT: dict[str, str] = {
    "sp_size": "sequence parallelism (DeepSpeed Ulysses)",
}


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """A request for an engine.

    Attributes:
        engine: A key of :data:`ENGINES`.
        source: Where the request came from, as a user would write it
            (``"--use_fsdp"``, ``"ACCEL_USE_FSDP=true in the environment"``, ...).
        undo: How to withdraw it (``"drop --use_fsdp"``, ...).
    """

    engine: str
    source: str
    undo: str

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(
                f"EngineRequest(engine={self.engine!r}): not an engine; choose one of "
                f"{', '.join(ENGINES)}"
            )


class EngineUnavailableError(NotImplementedError):
    """An engine was asked for that accel or the installed torch cannot train with.

    Either this release does not implement it, or it needs a torch feature
    (:attr:`EngineSpec.torch_feature`) that the installed torch lacks.

    Attributes:
        request: The refused :class:`EngineRequest`.
    """

    def __init__(self, request: EngineRequest, reason: str | None = None) -> None:
        self.request = request
        spec = ENGINES[request.engine]
        why = reason or "this release of accel does not implement it"
        super().__init__(
            f"{spec.title} was requested by {request.source}, but {why}, so nothing was "
            f"started. {_capitalise(request.undo)} {spec.instead}. accel never trains with "
            "another engine than the one asked for."
        )


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def accelerate_switch(switch: str) -> str:
    """Accelerate's name of a switch: ``ACCEL_USE_FSDP`` -> ``ACCELERATE_USE_FSDP``."""
    return "ACCELERATE_" + switch.removeprefix("ACCEL_")


def _is_true(name: str, raw: str) -> bool:
    if not raw.strip():
        return False
    try:
        return bool(str_to_bool(raw, to_bool=True))
    except ValueError as error:
        raise ValueError(f"environment variable {name}={raw!r}: {error}") from None


def environment_requests(environ: Mapping[str, str]) -> list[EngineRequest]:
    """The engine requests that ``environ`` holds (``ACCEL_USE_*`` and ``ACCELERATE_USE_*``).

    Raises:
        ValueError: a switch holds something that is not a truth value (the message names
            the variable and the value).
    """
    requests = []
    for spec in ENGINES.values():
        if spec.switch is None:
            continue
        for name in (spec.switch, accelerate_switch(spec.switch)):
            raw = environ.get(name)
            if raw is None or not _is_true(name, raw):
                continue
            source = f"{name}={raw.strip()} in the environment"
            if name != spec.switch:
                source += (
                    f" (Accelerate's name for {spec.switch}; `accelerate launch {spec.flag}` "
                    "sets it)"
                )
            else:
                source += f" (`accel launch {spec.flag}` sets it)"
            requests.append(EngineRequest(spec.key, source, f"unset {name}"))
    return requests


def argument_requests(owner: str, arguments: Mapping[str, object]) -> list[EngineRequest]:
    """The engine requests among plugin ``arguments`` given to ``owner`` (None: not given).

    Args:
        owner: The callable that received them, for messages (``"Accelerator"``).
        arguments: Argument name to value; names outside the plugin arguments are ignored.
    """
    engine_of = {name: spec.key for spec in ENGINES.values() for name in spec.arguments}
    return [
        EngineRequest(engine_of[name], f"{owner}({name}=...)", f"remove {name} from {owner}(...)")
        for name, value in arguments.items()
        if name in engine_of and value is not None
    ]


def config_requests(
    distributed_type: DistributedType, has_parallelism_config: bool, where: str
) -> list[EngineRequest]:
    """The engine requests of a config file (``distributed_type`` and its sections).

    Args:
        distributed_type: The file's ``distributed_type``.
        has_parallelism_config: Whether it holds a non-empty ``parallelism_config`` section.
        where: The file, as messages name it.
    """
    requests = [
        EngineRequest(
            spec.key,
            f"distributed_type: {distributed_type.value} in {where}",
            f"set distributed_type to MULTI_CPU or MULTI_GPU in {where} (or pass --cpu or "
            "--multi_gpu)",
        )
        for spec in ENGINES.values()
        if spec.distributed_type is not None and spec.distributed_type == distributed_type
    ]
    if has_parallelism_config:
        requests.append(
            EngineRequest(
                "parallelism_config",
                f"the parallelism_config section of {where}",
                f"remove the parallelism_config section from {where}",
            )
        )
    return requests


def refuse_conflicting_engines(requests: Iterable[EngineRequest]) -> None:
    """Refuse requests for two engines that each own the whole model (FSDP and DeepSpeed).

    Raises:
        ValueError: naming both engines and where each request came from.
    """
    first: dict[str, EngineRequest] = {}
    for request in requests:
        if ENGINES[request.engine].exclusive:
            first.setdefault(request.engine, request)
    if len(first) > 1:
        listed = "; ".join(
            f"{ENGINES[engine].title} by {request.source}" for engine, request in first.items()
        )
        raise ValueError(
            f"one run can train with one engine, but several were asked for: {listed}. Keep "
            "one request and withdraw the others"
        )


def refuse_unavailable_engines(requests: Iterable[EngineRequest]) -> None:
    """Raise for the first request whose engine accel or the installed torch cannot run.

    An engine is refused when this release does not implement it, or when the installed torch
    lacks its :attr:`EngineSpec.torch_feature`.

    Raises:
        EngineUnavailableError: naming the engine, where the request came from, why (with
            the torch release needed, if that is why) and what to do.
    """
    for request in requests:
        spec = ENGINES[request.engine]
        if not spec.available:
            raise EngineUnavailableError(request)
        if spec.torch_feature is not None and not torch_has(spec.torch_feature):
            feature = TORCH_FEATURES[spec.torch_feature]
            raise EngineUnavailableError(
                request,
                f"it needs {feature.title}, which torch has from {feature.since} on, and this "
                f"is torch {torch.__version__} (pip install 'torch>={feature.since}' to use it)",
            )


def engine_for_distributed_type(distributed_type: DistributedType) -> EngineSpec:
    """The engine a run of ``distributed_type`` trains with when nothing else was asked for.

    ``NO``: one device; a ``MULTI_*`` type: DDP; an engine's own type (``FSDP``,
    ``DEEPSPEED``, ``XLA``): that engine.

    Raises:
        ValueError: no built engine trains under that type (the message lists those that do).
    """
    for spec in REGISTRY:
        if spec.engine_class is not None and (
            distributed_type in spec.layouts or spec.distributed_type == distributed_type
        ):
            return spec
    trained = [
        str(kind)
        for spec in REGISTRY
        if spec.engine_class is not None
        for kind in (*spec.layouts, spec.distributed_type)
        if kind is not None
    ]
    raise ValueError(
        f"no training engine for distributed_type={distributed_type}: accel trains under "
        f"{', '.join(trained)}"
    )


def decide_engine(
    requests: Iterable[EngineRequest],
    layout: DistributedType,
    *,
    tensor_parallel: bool = False,
) -> EngineSpec:
    """The engine a run trains with: decided once, from its requests and process layout.

    An engine that owns the whole model (FSDP2, DeepSpeed) wins when asked for; a
    ``ParallelismConfig`` with tensor parallelism and no such engine trains with the tensor
    parallel engine; otherwise the layout decides (one device, DDP, XLA). Requests must have
    been checked by :func:`refuse_conflicting_engines` and :func:`refuse_unavailable_engines`.

    Args:
        requests: The run's engine requests.
        layout: The process layout's distributed type (``NO``, ``MULTI_CPU``, ``XLA``, ...).
        tensor_parallel: Whether the run's ``ParallelismConfig`` has ``tp_size > 1``.

    Raises:
        ValueError: nothing trains under ``layout``.
    """
    asked = {request.engine for request in requests}
    for spec in ENGINES.values():
        if spec.exclusive and spec.key in asked:
            return spec
    base = engine_for_distributed_type(layout)
    if base.key == "ddp" and tensor_parallel and "parallelism_config" in asked:
        return ENGINES["parallelism_config"]
    return base
