"""Model wrappers: what ``prepare_model`` puts around a model and how to take it off again.

``Accelerator.prepare_model`` applies, in order, the precision wrapper (accel-amp), placement,
DistributedDataParallel (GPU-like devices with ``device_ids``, CPU multi-process without) and
``torch.compile``. ``extract_model_from_parallel`` walks back through those layers.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch

from accel_amp import unwrap_forward
from accel_state import DistributedType

__all__ = ["extract_model_from_parallel", "has_multi_device_map", "is_compiled_module"]

# Distributed types whose models are wrapped in DistributedDataParallel by prepare_model.
DDP_TYPES = frozenset(
    {
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_CPU,
    }
)


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns for a module."""
    compiled = getattr(torch._dynamo.eval_frame, "OptimizedModule", None)
    return compiled is not None and isinstance(module, compiled)


def has_multi_device_map(model: Any) -> bool:
    """Whether ``model`` was dispatched over several devices (a big-model ``hf_device_map``)."""
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and len(set(device_map.values())) > 1


_DATA_PARALLEL = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def extract_model_from_parallel(
    model: Any,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> Any:
    """Return the user's model from inside the wrappers ``prepare`` added.

    Args:
        model: A prepared model.
        keep_fp32_wrapper: Keep the mixed-precision forward (autocast + fp32 outputs);
            ``False`` restores the original forward.
        keep_torch_compile: Keep the ``torch.compile`` wrapper (return it around the
            unwrapped module) instead of returning the plain module.
        recursive: Also unwrap DDP modules nested inside the model.
    """
    compiled = is_compiled_module(model)
    compiled_wrapper = model if compiled else None
    if compiled:
        model = model._orig_mod
    wrappers = _DATA_PARALLEL + _engine_wrapper_types()
    while isinstance(model, wrappers):
        model = cast(Any, model).module
    if recursive:
        for name, child in list(model.named_children()):
            unwrapped = extract_model_from_parallel(child, keep_fp32_wrapper, True, True)
            if unwrapped is not child:
                setattr(model, name, unwrapped)
    if not keep_fp32_wrapper:
        unwrap_forward(model, keep_fp32_wrapper=False)
    if keep_torch_compile and compiled_wrapper is not None:
        compiled_wrapper._orig_mod = model
        return compiled_wrapper
    return model


def _engine_wrapper_types() -> tuple[type, ...]:
    """Engine wrappers that hold the user's model in ``.module``, if their library is loaded."""
    found: list[type] = []
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None:
        engine = getattr(deepspeed, "DeepSpeedEngine", None)
        if isinstance(engine, type):
            found.append(engine)
    return tuple(found)
