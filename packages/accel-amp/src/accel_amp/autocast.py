"""Accelerate's module-level helpers that read the run's state: autocast and the GradScaler.

Both consult ``AcceleratorState`` (device, mixed precision, distributed type), so they work
once an ``Accelerator`` — or a bare ``AcceleratorState(mixed_precision=...)`` — exists. Code
that already holds a :class:`~accel_amp.policy.PrecisionPolicy` uses
``policy.autocast_context()`` instead.
"""

from __future__ import annotations

import contextlib
import importlib
from contextlib import AbstractContextManager
from typing import Any

import torch

from accel_state import AcceleratorState, DistributedType

from .kwargs import AutocastKwargs
from .policy import autocast_arguments, cpu_supports_fp16

__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager"]

_BF16_AUTOCAST_TYPES = frozenset(
    {
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_HPU,
        DistributedType.FSDP,
        DistributedType.XLA,
    }
)


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager[Any]:
    """The autocast context for the current ``AcceleratorState``.

    fp16 autocasts to float16; bf16 and fp8 autocast to bfloat16 (for the distributed types
    where accel owns precision); without ``native_amp`` the context does nothing.

    Args:
        native_amp: Whether mixed precision is applied through ``torch.autocast``.
        autocast_kwargs: Extra ``torch.autocast`` arguments (only changed fields pass).
    """
    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    kwargs = autocast_arguments(autocast_kwargs)
    device_type = state.device.type
    if state.distributed_type == DistributedType.XLA and device_type == "xla":
        device_type = "cuda" if torch.cuda.is_available() else device_type
    if state.mixed_precision == "fp16":
        return torch.autocast(device_type, dtype=torch.float16, **kwargs)
    if state.mixed_precision in ("bf16", "fp8") and state.distributed_type in _BF16_AUTOCAST_TYPES:
        return torch.autocast(device_type, dtype=torch.bfloat16, **kwargs)
    return torch.autocast(device_type, **kwargs)


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> Any:
    """A loss scaler for fp16 training on the current device.

    FSDP gets torch's ``ShardedGradScaler``, XLA gets torch_xla's scaler, every other
    setting ``torch.amp.GradScaler(<device type>)`` — on CPU too, where torch supports it.

    Args:
        distributed_type: Overrides the state's distributed type.
        **kwargs: ``GradScaler`` arguments (``GradScalerKwargs().to_kwargs()``).

    Raises:
        ValueError: CPU fp16 is not supported by this torch.
    """
    state = AcceleratorState()
    distributed_type = distributed_type if distributed_type is not None else state.distributed_type
    device_type = state.device.type
    if distributed_type == DistributedType.FSDP:
        sharded = importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")
        return sharded.ShardedGradScaler(device=device_type, **kwargs)
    if distributed_type == DistributedType.XLA:
        return importlib.import_module("torch_xla.amp").GradScaler(**kwargs)
    if device_type == "cpu" and not cpu_supports_fp16():
        raise ValueError(
            f"fp16 loss scaling on CPU needs torch.amp.GradScaler('cpu'), which torch "
            f"{torch.__version__} lacks: use mixed_precision='bf16' on CPU, or upgrade torch"
        )
    return torch.amp.GradScaler(device_type, **kwargs)
