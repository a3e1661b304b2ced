"""Training engines: one class per way of training, behind one protocol (:mod:`.base`).

Which engine a run trains with is decided once, by ``AcceleratorState`` from the requests the
Accelerator's connector (:mod:`accel.options`) read: the row of the one registry
(:data:`accel_state.engine_requests.REGISTRY`) in ``state.engine``. :func:`select_engine`
builds that row's class; engine modules are imported only when selected (DeepSpeed's imports
``deepspeed``). Adding an engine is one registry row and one class here.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

from accel_state import DistributedType
from accel_state.engine_requests import (
    REGISTRY,
    EngineSpec,
    engine_for_distributed_type,
)

from .base import CheckpointLayout, Engine, EngineOptions, JointSetup

__all__ = [
    "ENGINES",
    "TENSOR_PARALLEL",
    "CheckpointLayout",
    "Engine",
    "EngineOptions",
    "JointSetup",
    "engine_class",
    "select_engine",
]


def _class_of(key: str) -> str:
    return str(next(spec.engine_class for spec in REGISTRY if spec.key == key))


#: The engine of a run whose ``ParallelismConfig`` has ``tp_size > 1`` and no FSDP2.
TENSOR_PARALLEL = _class_of("parallelism_config")


def _engines_by_type() -> dict[DistributedType, str]:
    found = {}
    for kind in DistributedType:
        try:
            found[kind] = str(engine_for_distributed_type(kind).engine_class)
        except ValueError:
            continue  # no built engine trains under it (Megatron-LM)
    return found


#: The engine class of each distributed type, as ``"module:Class"``: a view of the registry.
ENGINES: MappingProxyType[DistributedType, str] = MappingProxyType(_engines_by_type())


def engine_class(spec: EngineSpec) -> type[Engine]:
    """The class of a registry row (its module imported now).

    Raises:
        ValueError: the row names no class (an engine this release does not build).
    """
    if spec.engine_class is None:
        raise ValueError(f"{spec.title} has no engine class: this release does not build it")
    module_name, class_name = spec.engine_class.split(":")
    found: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return found


def select_engine(options: EngineOptions) -> Engine:
    """Build the engine the run's state decided on (``options.engine``, ``state.engine``).

    Options without that decision (a state built by hand) get the engine of the state's
    ``distributed_type``.

    Raises:
        ValueError: no engine trains under that distributed type (the message lists the
            types that have one).
    """
    spec = options.engine
    if spec is None:
        spec = engine_for_distributed_type(options.state.distributed_type)
    return engine_class(spec)(options)
