"""Which training engine a run asks for, where the request came from, and its refusal.

A run can ask for an engine other than DDP in five ways: an Accelerator argument (a plugin),
an environment switch (``ACCEL_USE_FSDP=true``, usually written by ``accel launch``), a launch
flag (``--use_fsdp``), a config file (``distributed_type: FSDP``) and the ``accel config``
questionnaire. Each engine that this release does not implement is refused on every one of
those paths, before any process trains, by :func:`refuse_unavailable_engines`: an engine that
was asked for is honoured or refused, never dropped or swapped for DDP (Accelerate 1.15 drops an
FSDP or DeepSpeed plugin on a CPU run without a word and trains DDP).

The table :data:`ENGINES` is the one place that says which engines exist; ``accel launch``
(accel-launch) and the ``Accelerator`` (accel) both read it, which is why it lives in the
lowest package. When an engine lands, its row's ``available`` becomes True and the same paths
reach it.

Accelerate's own switches (``ACCELERATE_USE_FSDP`` and friends, which ``accelerate launch``
writes) count as requests too: a script moved from Accelerate and started by Accelerate's
launcher must not train silently with another engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from .environment import (
    ACCEL_USE_DEEPSPEED,
    ACCEL_USE_FSDP,
    ACCEL_USE_MEGATRON_LM,
    ACCEL_USE_PARALLELISM_CONFIG,
    str_to_bool,
)

__all__ = [
    "ENGINES",
    "PARALLELISM_NOT_BUILT",
    "EngineRequest",
    "EngineSpec",
    "EngineUnavailableError",
    "accelerate_switch",
    "argument_requests",
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
    """

    key: str
    title: str
    switch: str | None
    flag: str
    available: bool
    instead: str


_DDP_INSTEAD = (
    "to train with DDP instead (every process then holds the whole model, its gradients and "
    "its optimizer state), or run this script with Accelerate"
)

#: Every engine besides single-device and DDP training, by key.
ENGINES: dict[str, EngineSpec] = {
    spec.key: spec
    for spec in (
        EngineSpec(
            "fsdp",
            "FSDP (fully sharded data parallel)",
            ACCEL_USE_FSDP,
            "--use_fsdp",
            True,
            _DDP_INSTEAD,
        ),
        EngineSpec(
            "deepspeed",
            "DeepSpeed (ZeRO)",
            ACCEL_USE_DEEPSPEED,
            "--use_deepspeed",
            True,
            _DDP_INSTEAD,
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
        ),
        EngineSpec(
            "parallelism_config",
            "ParallelismConfig (HSDP, tensor, context and sequence parallelism)",
            ACCEL_USE_PARALLELISM_CONFIG,
            "--use_parallelism_config",
            True,
            _DDP_INSTEAD,
        ),
        EngineSpec(
            "xla",
            "XLA / TPU (torch_xla)",
            None,
            "--tpu",
            True,
            "to train on CPU or GPU processes instead",
        ),
    )
}


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
    """An engine was asked for that this release of accel does not implement.

    Attributes:
        request: The refused :class:`EngineRequest`.
    """

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        spec = ENGINES[request.engine]
        super().__init__(
            f"{spec.title} was requested by {request.source}, but this release of accel does "
            f"not implement it, so nothing was started. {_capitalise(request.undo)} "
            f"{spec.instead}. accel never trains with another engine than the one asked for."
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


#: The engine each plugin argument of ``Accelerator`` / ``AcceleratorState`` asks for.
_ARGUMENT_ENGINES: dict[str, str] = {
    "deepspeed_plugin": "deepspeed",
    "deepspeed_plugins": "deepspeed",
    "fsdp_plugin": "fsdp",
    "megatron_lm_plugin": "megatron_lm",
    "torch_tp_plugin": "parallelism_config",
    "parallelism_config": "parallelism_config",
}


def argument_requests(owner: str, arguments: Mapping[str, object]) -> list[EngineRequest]:
    """The engine requests among plugin ``arguments`` given to ``owner`` (None: not given).

    Args:
        owner: The callable that received them, for messages (``"Accelerator"``).
        arguments: Argument name to value; names outside the plugin arguments are ignored.
    """
    return [
        EngineRequest(
            _ARGUMENT_ENGINES[name], f"{owner}({name}=...)", f"remove {name} from {owner}(...)"
        )
        for name, value in arguments.items()
        if name in _ARGUMENT_ENGINES and value is not None
    ]


#: Engines that each own the whole model: a run asks for one of them at most.
_EXCLUSIVE = ("fsdp", "deepspeed", "megatron_lm")


def refuse_conflicting_engines(requests: Iterable[EngineRequest]) -> None:
    """Refuse requests for two engines that each own the whole model (FSDP and DeepSpeed).

    Raises:
        ValueError: naming both engines and where each request came from.
    """
    first: dict[str, EngineRequest] = {}
    for request in requests:
        if request.engine in _EXCLUSIVE:
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
    """Raise for the first request whose engine this release does not implement.

    Raises:
        EngineUnavailableError: naming the engine, where the request came from and what to do.
    """
    for request in requests:
        if not ENGINES[request.engine].available:
            raise EngineUnavailableError(request)
