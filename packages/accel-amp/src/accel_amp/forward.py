"""Forward wrapping: a model's forward runs under autocast and returns fp32 outputs.

``wrap_forward(model, policy)`` sets an instance attribute ``model.forward`` to
``ConvertOutputsToFp32(AutocastForward(original))``; the class is never touched, each layer
exposes ``__wrapped__`` (so ``inspect.signature(model.forward)`` still shows the original
signature), and ``model._original_forward`` remembers what to restore.
``unwrap_forward(model, keep_fp32_wrapper=False)`` restores the model exactly — the instance
attribute is removed again when the original was the class's own method.

Unlike Accelerate, whose wrapped forward raises ``PicklingError``, a wrapped model pickles and
deep-copies (for EMA copies, ``torch.save(model)``, multiprocessing): the wrappers hold only
the original forward and plain settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from accel_state.structures import recursively_apply

from .policy import PrecisionPolicy, autocast_arguments

__all__ = [
    "AutocastForward",
    "ConvertOutputsToFp32",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "is_forward_wrapped",
    "unwrap_forward",
    "wrap_forward",
]

_HALF = (torch.float16, torch.bfloat16)


def _is_half_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor) and data.dtype in _HALF


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def convert_to_fp32(tensor: Any) -> Any:
    """Return ``tensor`` (or a nested structure) with every fp16/bf16 tensor cast to fp32.

    Other leaves (fp32 or integer tensors, non-tensors) are returned unchanged; lists,
    tuples, namedtuples and mappings (including ``ModelOutput``-style dict subclasses) keep
    their types.
    """
    return recursively_apply(_to_fp32, tensor, test_type=_is_half_tensor)


class ConvertOutputsToFp32:
    """A callable that runs ``model_forward`` and casts its half-precision outputs to fp32.

    Picklable whenever ``model_forward`` is. ``__wrapped__`` is ``model_forward``.
    """

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped forward and cast its half-precision outputs to fp32."""
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __repr__(self) -> str:
        return f"ConvertOutputsToFp32({self.model_forward!r})"


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> ConvertOutputsToFp32:
    """Wrap ``model_forward`` so its fp16/bf16 outputs come back as fp32."""
    return ConvertOutputsToFp32(model_forward)


class AutocastForward:
    """A callable that runs ``forward`` under ``torch.autocast(device_type, dtype, **kwargs)``.

    A fresh autocast context is entered on every call, so the wrapper is re-entrant and holds
    no torch state: it pickles whenever ``forward`` does.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        device_type: str,
        dtype: torch.dtype,
        autocast_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.forward = forward
        self.device_type = device_type
        self.dtype = dtype
        self.autocast_kwargs = dict(autocast_kwargs or {})
        functools.update_wrapper(self, forward, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped forward under autocast."""
        with torch.autocast(self.device_type, dtype=self.dtype, **self.autocast_kwargs):
            return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AutocastForward({self.forward!r}, {self.device_type!r}, {self.dtype})"


def is_forward_wrapped(model: torch.nn.Module) -> bool:
    """Whether :func:`wrap_forward` wrapped ``model``'s forward (and it was not undone)."""
    return "_original_forward" in model.__dict__


def wrap_forward(
    model: torch.nn.Module,
    policy: PrecisionPolicy,
    autocast_kwargs: Any = None,
) -> torch.nn.Module:
    """Make ``model``'s forward run under the policy's autocast with fp32 outputs, in place.

    A policy that does not autocast leaves the model alone. Wrapping twice replaces the first
    wrapper rather than nesting a second one.

    Args:
        model: The module; only its instance ``forward`` attribute changes.
        policy: The resolved :class:`PrecisionPolicy`.
        autocast_kwargs: ``AutocastKwargs`` or a dict of ``torch.autocast`` keyword arguments.

    Returns:
        ``model`` itself.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model={type(model).__name__} must be a torch.nn.Module to wrap its forward"
        )
    if not policy.autocast:
        return model
    if is_forward_wrapped(model):
        unwrap_forward(model, keep_fp32_wrapper=False)
    original = model.forward
    wrapped: Callable[..., Any] = AutocastForward(
        original, policy.device_type, policy.compute_dtype, autocast_arguments(autocast_kwargs)
    )
    if policy.output_dtype is not None:
        wrapped = ConvertOutputsToFp32(wrapped)
    # Through __dict__: nn.Module.__setattr__ would type-check the values.
    model.__dict__["_original_forward"] = original
    model.__dict__["forward"] = wrapped
    return model


def unwrap_forward(model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
    """Undo :func:`wrap_forward` unless ``keep_fp32_wrapper``; return ``model``.

    With ``keep_fp32_wrapper=True`` (Accelerate's default for ``unwrap_model``) the model keeps
    its autocast + fp32 forward. Otherwise the ``__wrapped__`` chain is followed back to the
    original forward: a class method is restored by deleting the instance attribute (the
    model is then exactly as before wrapping), any other original is put back as it was. If
    the user replaced ``forward`` after wrapping (even with a ``functools.wraps`` decorator
    around accel's wrapper), that replacement is left in place.
    """
    if keep_fp32_wrapper:
        return model
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return model
    current = model.__dict__.get("forward")
    if not isinstance(current, (ConvertOutputsToFp32, AutocastForward)):
        return model  # replaced by the user after wrapping: theirs stays
    while current is not None and current is not original and current != original:
        current = getattr(current, "__wrapped__", None)
    if current is None:
        return model
    class_forward = getattr(type(model), "forward", None)
    if getattr(original, "__self__", None) is model and (
        getattr(original, "__func__", None) is class_forward
    ):
        model.__dict__.pop("forward", None)
    else:
        model.__dict__["forward"] = original
    return model
