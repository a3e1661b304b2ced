"""Model wrappers: what ``prepare_model`` puts around a model and how to take it off again.

``Accelerator.prepare_model`` hands the model to the run's engine (:mod:`accel.engines`). By
default an engine applies, in order: float8 conversion (``mixed_precision="fp8"``), the
mixed-precision forward (accel-amp's autocast with fp32 outputs), placement on the device (not
for a model dispatched with an ``hf_device_map``), its wrapper (only around a trainable model
outside evaluation mode), and ``torch.compile``, whole or by regions, as the dynamo plugin
says. The wrapper is ``DistributedDataParallel`` under DDP (with ``device_ids`` on GPU-like
devices; without them on CPU processes and for a dispatched model) and nothing for one process
or tensor parallelism alone. FSDP2 differs: it shards the model in place (``fully_shard``, so
the same object comes back) and casts through its own ``MixedPrecisionPolicy`` instead of the
autocast forward. DeepSpeed prepares the model together with its optimizer and returns its
``DeepSpeedEngine``, which holds the model in ``.module``.

:func:`extract_model_from_parallel` walks back through these layers: the compile wrapper (or
the twin regional compilation makes), DDP, ``DataParallel`` and ``DeepSpeedEngine`` (by their
``.module``) and, with ``keep_fp32_wrapper=False``, the mixed-precision forward. FSDP2's
sharding is not undone: the model it returns is the user's own, sharded.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch

from accel_amp import unwrap_forward

from .compilation import has_compiled_regions

__all__ = [
    "extract_model_from_parallel",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "get_module_class_from_name",
    "has_multi_device_map",
    "is_compiled_module",
    "is_peft_model",
    "model_has_dtensor",
]


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
        keep_torch_compile: Keep the ``torch.compile`` wrapper, or the twin made by
            ``compile_regions`` (return it around the unwrapped module) instead of returning
            the plain module.
        recursive: Also unwrap DDP modules nested inside the model.
    """
    regions = isinstance(model, torch.nn.Module) and has_compiled_regions(model)
    compiled = is_compiled_module(model) or regions
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
        if regions:  # not a submodule: the twin's state dict stays its own
            compiled_wrapper.__dict__["_orig_mod"] = model
        else:
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


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every module of ``model``, each after all of its children; ``model`` itself last.

    With ``return_fqns`` the items are ``(qualified name, module)`` pairs (``""`` for the
    root).
    """
    ordered: list[tuple[str, torch.nn.Module]] = []
    pending: list[tuple[str, torch.nn.Module]] = [("", model)]
    while pending:
        name, module = pending.pop()
        ordered.append((name, module))
        for child_name, child in module.named_children():
            pending.append((f"{name}.{child_name}" if name else child_name, child))
    ordered.reverse()
    return ordered if return_fqns else [module for _, module in ordered]


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or a TP plan)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a transformers model was sharded with (None: not sharded).

    transformers < 5 records it as ``model.tp_size``; transformers >= 5 in
    ``model.config.distributed_config``.
    """
    size = getattr(model, "tp_size", None)
    if size is not None:
        return int(size)
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed, dict):
        size = distributed.get("tp_size")
    else:
        size = getattr(distributed, "tp_size", None)
    return None if size is None else int(size)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` (once unwrapped) is a PEFT ``PeftModel`` (False without peft)."""
    from accel_state.imports import is_peft_available

    if not is_peft_available():
        return False
    import peft

    return isinstance(extract_model_from_parallel(model), peft.PeftModel)


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
    """The class named ``name`` among ``module`` and its descendants (depth first), or None."""
    for candidate in module.modules():
        if type(candidate).__name__ == name:
            return type(candidate)
    return None
