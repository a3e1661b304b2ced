"""Training engines: one class per way of training, behind one protocol (:mod:`.base`).

:func:`select_engine` picks the engine for the run's distributed type from :data:`ENGINES`
(a tensor-parallel ``ParallelismConfig`` without FSDP2 takes :data:`TENSOR_PARALLEL`
instead of DDP);
the engine modules are imported only when selected (DeepSpeed's imports ``deepspeed``).
Megatron-LM is refused before an engine is selected (``accel_state.engine_requests``), so it
is not in the table.
"""

from __future__ import annotations

import importlib

from accel_state import DistributedType

from .base import CheckpointLayout, Engine, EngineOptions

__all__ = [
    "ENGINES",
    "TENSOR_PARALLEL",
    "CheckpointLayout",
    "Engine",
    "EngineOptions",
    "select_engine",
]

_DDP = "accel.engines.ddp:DDPEngine"
#: The engine of a run whose ``ParallelismConfig`` has ``tp_size > 1`` and no FSDP2.
TENSOR_PARALLEL = "accel.engines.tensor_parallel:TensorParallelEngine"

#: The engine class of each distributed type, as ``"module:Class"``.
ENGINES: dict[DistributedType, str] = {
    DistributedType.NO: "accel.engines.single:SingleDeviceEngine",
    DistributedType.MULTI_CPU: _DDP,
    DistributedType.MULTI_GPU: _DDP,
    DistributedType.MULTI_XPU: _DDP,
    DistributedType.MULTI_NPU: _DDP,
    DistributedType.MULTI_MLU: _DDP,
    DistributedType.MULTI_SDAA: _DDP,
    DistributedType.MULTI_MUSA: _DDP,
    DistributedType.MULTI_HPU: _DDP,
    DistributedType.FSDP: "accel.engines.fsdp2:FSDP2Engine",
    DistributedType.DEEPSPEED: "accel.engines.deepspeed:DeepSpeedZeroEngine",
    DistributedType.XLA: "accel.engines.xla:XLAEngine",
}


def select_engine(options: EngineOptions) -> Engine:
    """Build the engine for ``options.state.distributed_type``.

    Raises:
        ValueError: no engine trains under that distributed type (the message lists the
            types that have one).
    """
    distributed_type = options.state.distributed_type
    target = ENGINES.get(distributed_type)
    config = getattr(options.state, "parallelism_config", None)
    if (
        config is not None
        and config.tp_enabled
        and getattr(options.state, "device_mesh", None) is not None
        and target == _DDP
    ):
        # Tensor parallelism alone: a DTensor model, no data-parallel wrapper.
        target = TENSOR_PARALLEL
    if target is None:
        choices = ", ".join(str(kind) for kind in ENGINES)
        raise ValueError(
            f"no training engine for distributed_type={distributed_type}: accel trains under "
            f"{choices}"
        )
    module_name, class_name = target.split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: Engine = engine_class(options)
    return engine
