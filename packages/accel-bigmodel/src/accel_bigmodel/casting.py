"""Layerwise casting: store a model's layers in a small dtype, compute in a larger one.

:func:`attach_layerwise_casting_hooks` puts a :class:`LayerwiseCastingHook` on every supported
layer (convolutions and ``nn.Linear``, see :data:`SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING`):
the layer's weights are kept in ``storage_dtype`` (for example ``torch.float8_e4m3fn``) and
cast to ``compute_dtype`` (for example ``torch.bfloat16``) only for the duration of its
forward. Memory drops to the storage dtype's size; results are those of the compute dtype
applied to weights rounded to the storage dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .hooks import ModelHook, add_hook_to_module

__all__ = [
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "LayerwiseCastingHook",
    "attach_layerwise_casting_hooks",
]

logger = logging.getLogger(__name__)

SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)
"""Layer classes whose weights :func:`attach_layerwise_casting_hooks` stores downcast."""


def _check_dtype(value: Any, argument: str) -> torch.dtype:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"{argument}={value!r} is not a floating-point torch.dtype: use e.g. "
            "torch.float8_e4m3fn, torch.float16 or torch.bfloat16."
        )
    return value


class LayerwiseCastingHook(ModelHook):
    """Keep a layer's floating-point tensors in ``storage_dtype`` except during its forward.

    Args:
        storage_dtype: dtype of the weights between calls (set when the hook is attached).
        compute_dtype: dtype of the weights during the forward.
        non_blocking: cast asynchronously where the device allows it.

    Raises:
        TypeError: a dtype is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool
    ) -> None:
        self.storage_dtype = _check_dtype(storage_dtype, "storage_dtype")
        self.compute_dtype = _check_dtype(compute_dtype, "compute_dtype")
        self.non_blocking = non_blocking

    def __repr__(self) -> str:
        return (
            f"LayerwiseCastingHook(storage_dtype={self.storage_dtype}, "
            f"compute_dtype={self.compute_dtype}, non_blocking={self.non_blocking})"
        )

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Cast the layer to the storage dtype."""
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Cast the layer to the compute dtype (inputs are left as they are)."""
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Cast the layer back to the storage dtype."""
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | Sequence[str] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Store the supported layers of ``module`` in ``storage_dtype``, computing in another.

    Walks ``module``; every submodule that is an instance of
    :data:`SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING` gets a :class:`LayerwiseCastingHook`
    (chained after any hook it already has). A skipped submodule is left as it is, with
    everything below it.

    Args:
        module: the model.
        storage_dtype: dtype the layers are kept in (e.g. ``torch.float8_e4m3fn``).
        compute_dtype: dtype the layers compute in (e.g. ``torch.bfloat16``).
        skip_modules_pattern: regular expression(s) searched in the dotted module names
            (``re.search``); matching modules are skipped (e.g. ``["norm", "lm_head"]``).
        skip_modules_classes: module classes to skip.
        non_blocking: cast asynchronously where the device allows it.

    Raises:
        TypeError: a dtype is not a floating-point ``torch.dtype``, or a skip argument has the
            wrong type.
        re.error: a pattern is not a valid regular expression.

    Example::

        attach_layerwise_casting_hooks(
            model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
            skip_modules_pattern=["norm"],
        )
    """
    _check_dtype(storage_dtype, "storage_dtype")
    _check_dtype(compute_dtype, "compute_dtype")
    if isinstance(skip_modules_pattern, str):
        patterns: tuple[re.Pattern[str], ...] = (re.compile(skip_modules_pattern),)
    elif skip_modules_pattern is None:
        patterns = ()
    else:
        if not all(isinstance(pattern, str) for pattern in skip_modules_pattern):
            raise TypeError(
                f"skip_modules_pattern={skip_modules_pattern!r}: give a string or a sequence of "
                "strings (regular expressions matched against dotted module names)."
            )
        patterns = tuple(re.compile(pattern) for pattern in skip_modules_pattern)
    classes: tuple[type[nn.Module], ...] = ()
    if skip_modules_classes is not None:
        candidates = (
            (skip_modules_classes,)
            if isinstance(skip_modules_classes, type)
            else tuple(skip_modules_classes)
        )
        if not all(isinstance(cls, type) for cls in candidates):
            raise TypeError(
                f"skip_modules_classes={skip_modules_classes!r}: give a tuple of nn.Module classes."
            )
        classes = candidates
    _attach(module, storage_dtype, compute_dtype, patterns, classes, non_blocking, "")


def _attach(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    patterns: tuple[re.Pattern[str], ...],
    classes: tuple[type[nn.Module], ...],
    non_blocking: bool,
    name: str,
) -> None:
    if (classes and isinstance(module, classes)) or any(
        pattern.search(name) for pattern in patterns
    ):
        logger.debug("Layerwise casting skips %r", name)
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        logger.debug("Layerwise casting applied to %r", name)
        add_hook_to_module(
            module,
            LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking),
            append=True,
        )
        return
    for child_name, child in module.named_children():
        _attach(
            child,
            storage_dtype,
            compute_dtype,
            patterns,
            classes,
            non_blocking,
            f"{name}.{child_name}" if name else child_name,
        )
