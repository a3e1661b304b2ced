"""Regional compilation: ``torch.compile`` each repeated block once instead of the whole model.

A transformer is mostly N copies of one block class in an ``nn.ModuleList``. Compiling the
whole model traces all N; compiling each block separately hits the compiler's cache after the
first, so the cold start is about one block's compile instead of N's, with nearly the same
speed-up. :func:`compile_regions` returns a twin of the model (the original is left as it
was): modules holding repeated blocks are shallow-copied with their children compiled region
by region, every other leaf-most child is compiled whole, and the twin's ``_orig_mod`` is the
original model, as for ``torch.compile``. ``TorchDynamoPlugin(use_regional_compilation=True)``
makes ``Accelerator.prepare`` use it.
"""

from __future__ import annotations

import copy
import types
from typing import Any, cast

import torch

from .unavailable import unavailable_function

__all__ = [
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_repeated_blocks",
]


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.ModuleList`` of two or more modules of one class."""
    if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
        return False
    first = type(module[0])
    return all(type(child) is first for child in module)


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its descendants is a list of repeated blocks."""
    return any(is_repeated_blocks(child) for child in module.modules())


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a twin made by :func:`compile_regions`."""
    return "_orig_mod" in module.__dict__ and "_accel_compiled_regions" in module.__dict__


def _twin(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy whose children can be replaced without touching ``module``."""
    twin = copy.copy(module)
    # Own dicts (parameters, buffers, children, hooks), the same tensors inside.
    for name, value in list(vars(twin).items()):
        if isinstance(value, dict):
            twin.__dict__[name] = copy.copy(value)
    # Methods bound to the original instance (a wrapped forward) are bound to the twin.
    for name, value in list(vars(module).items()):
        if isinstance(value, types.MethodType) and value.__self__ is module:
            setattr(twin, name, types.MethodType(value.__func__, twin))
    return twin


def _compile(module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
    if is_repeated_blocks(module):
        blocks = cast(torch.nn.ModuleList, module)
        return torch.nn.ModuleList(
            [cast(torch.nn.Module, torch.compile(b, **kwargs)) for b in blocks]
        )
    if has_repeated_blocks(module):
        twin = _twin(module)
        for name, child in module.named_children():
            twin._modules[name] = _compile(child, kwargs)
        return twin
    compiled: torch.nn.Module = torch.compile(module, **kwargs)  # type: ignore[assignment]
    return compiled


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Compile ``module`` region by region (each repeated block once); return the twin.

    Args:
        module: The model. It is not changed.
        **compile_kwargs: Passed to every ``torch.compile`` call (``backend``, ``mode``, ...).

    Returns:
        A twin of ``module`` of the same class whose repeated blocks (and other leaf-most
        children) are ``torch.compile`` wrappers; ``twin._orig_mod`` is ``module``. Without any
        repeated block the whole module is compiled, as ``torch.compile(module)``.
    """
    if not has_repeated_blocks(module):
        compiled: torch.nn.Module = torch.compile(module, **compile_kwargs)  # type: ignore[assignment]
        return compiled
    twin = _compile(module, compile_kwargs)
    twin.__dict__["_orig_mod"] = module
    twin.__dict__["_accel_compiled_regions"] = True
    return twin


#: Accelerate's engine-specific regional compilation: accel's engines compile with the
#: dynamo plugin (``TorchDynamoPlugin(use_regional_compilation=True)``) themselves.
compile_regions_deepspeed = unavailable_function(
    "compile_regions_deepspeed",
    "Accelerate's DeepSpeed-specific regional compilation, which accel does not have",
    "Set TorchDynamoPlugin(use_regional_compilation=True) on the Accelerator instead.",
)
compile_regions_fsdp2 = unavailable_function(
    "compile_regions_fsdp2",
    "Accelerate's FSDP2-specific regional compilation, which accel does not have",
    "Set TorchDynamoPlugin(use_regional_compilation=True) on the Accelerator instead.",
)
