"""The precision policy: one object that says what mixed precision means on this device.

Users of Accelerate repeatedly expect ``mixed_precision="bf16"`` to shrink the weights; it
does not — weights, gradients and optimizer state stay fp32 and only autocast regions compute
in low precision. :class:`PrecisionPolicy` makes that explicit (parameter, compute, gradient
reduction and output dtypes, whether a loss scaler is used) and :meth:`PrecisionPolicy.describe`
prints it in one line with the expected bytes per parameter.

Unlike Accelerate, ``"fp16"`` on CPU is real (autocast to float16 with a CPU ``GradScaler``)
where torch supports it, and a clear error where it does not — never a silent no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from .fp8 import FP8Backend, resolve_fp8_backend
from .kwargs import AutocastKwargs, GradScalerKwargs

__all__ = [
    "MIXED_PRECISION_CHOICES",
    "MixedPrecision",
    "PrecisionPolicy",
    "validate_mixed_precision",
]

MixedPrecision = Literal["no", "fp16", "bf16", "fp8"]
MIXED_PRECISION_CHOICES: tuple[str, ...] = ("no", "fp16", "bf16", "fp8")

# Device types whose autocast supports float16 and which have a GradScaler in torch.amp.
_FP16_ACCELERATORS = frozenset({"cuda", "xpu", "npu", "mlu", "musa", "hpu", "sdaa", "mps", "xla"})
# Distributed types whose engine owns precision itself (no autocast, no GradScaler from us).
_ENGINE_OWNED = frozenset({"DEEPSPEED", "MEGATRON_LM"})


def validate_mixed_precision(value: Any, name: str = "mixed_precision") -> str:
    """Return ``value`` lower-cased if it names a precision.

    Raises:
        ValueError: ``value`` is not one of ``no``, ``fp16``, ``bf16``, ``fp8``; the message
            names the argument, the value and the choices.
    """
    lowered = str(value).lower() if value is not None else "no"
    if lowered not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"{name}={value!r} is not a mixed precision: choose one of "
            f"{', '.join(repr(choice) for choice in MIXED_PRECISION_CHOICES)}"
        )
    return lowered


@functools.cache
def cpu_supports_fp16() -> bool:
    """Whether this torch autocasts to float16 on CPU and has a CPU ``GradScaler``."""
    if not hasattr(torch.amp, "GradScaler"):
        return False
    is_available = getattr(torch.amp, "is_autocast_available", None)
    if is_available is not None and not is_available("cpu"):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context = torch.autocast("cpu", dtype=torch.float16)
    return context.fast_dtype == torch.float16 and context._enabled and not caught


def _bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return True


# State tensors per parameter, in the parameter's dtype, for torch's optimizers.
def _optimizer_state_slots(optimizer: Any) -> tuple[str, int] | None:
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # AcceleratedOptimizer and similar wrappers
    name = type(inner).__name__
    group: Mapping[str, Any] = inner.param_groups[0] if getattr(inner, "param_groups", None) else {}
    optim = torch.optim
    if isinstance(inner, (optim.Adam, optim.AdamW)):
        return name, 2 + int(bool(group.get("amsgrad", False)))
    if isinstance(inner, optim.SGD):
        return name, int(bool(group.get("momentum", 0)))
    if isinstance(inner, optim.RMSprop):
        return name, 1 + int(bool(group.get("momentum", 0))) + int(bool(group.get("centered")))
    if isinstance(inner, (optim.Adamax, optim.NAdam, optim.RAdam, optim.Adadelta, optim.Rprop)):
        return name, 2
    if isinstance(inner, (optim.Adagrad, optim.ASGD)):
        return name, 1
    return None


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """What a mixed-precision setting means for one device.

    Build it with :meth:`resolve`. Weights are never cast: ``param_dtype`` is the dtype the
    model was created in (fp32 for a normal model), gradients and their all-reduce use it too,
    autocast regions compute in ``compute_dtype``, and the wrapped forward returns floating
    outputs in ``output_dtype``.

    Attributes:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        device_type: The torch device type the policy was resolved for.
        param_dtype: dtype of weights, gradients and optimizer state.
        compute_dtype: dtype autocast computes matmuls and convolutions in.
        reduce_dtype: dtype gradients are all-reduced in.
        output_dtype: dtype of the wrapped forward's floating outputs (``None``: unchanged).
        autocast: Whether forwards run under ``torch.autocast`` (Accelerate's ``native_amp``).
        scaler: Whether losses are scaled by a ``GradScaler`` (fp16).
        fp8_backend: The FP8 backend for ``"fp8"`` (``"AO"`` for torchao), else ``None``.
        owner: Who applies the precision: ``"accel"`` or the engine (``"deepspeed"``).
    """

    mixed_precision: str
    device_type: str
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = None
    autocast: bool = False
    scaler: bool = False
    fp8_backend: FP8Backend | None = None
    owner: str = "accel"

    @classmethod
    def resolve(
        cls,
        mixed_precision: str | None,
        device: torch.device | str | None = None,
        *,
        distributed_type: Any = None,
        scaler_kwargs: GradScalerKwargs | None = None,
        param_dtype: torch.dtype = torch.float32,
        fp8_backend: str | None = None,
    ) -> PrecisionPolicy:
        """Decide the policy for ``mixed_precision`` on ``device``.

        Args:
            mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (``None`` = ``"no"``).
            device: Where the model computes (default: CPU).
            distributed_type: The run's ``DistributedType``; DeepSpeed and Megatron-LM apply
                precision themselves, so the policy then neither autocasts nor scales.
            scaler_kwargs: ``GradScalerKwargs``; ``enabled=False`` turns the fp16 scaler off.
            param_dtype: dtype the model's weights are in (reported, never changed).
            fp8_backend: For ``"fp8"``: ``"AO"`` (torchao); ``None`` picks an installed one.

        Raises:
            ValueError: unknown ``mixed_precision``; fp16 on a device without float16
                autocast; bf16 on a GPU without bfloat16.
            ImportError: ``"fp8"`` without an FP8 backend installed, naming the extra.
        """
        precision = validate_mixed_precision(mixed_precision)
        device_type = torch.device(device).type if device is not None else "cpu"
        engine = str(getattr(distributed_type, "value", distributed_type or "")).upper()
        if precision == "no":
            return cls("no", device_type, param_dtype, param_dtype, param_dtype)
        if engine in _ENGINE_OWNED:
            compute = torch.float16 if precision == "fp16" else torch.bfloat16
            return cls(
                precision,
                device_type,
                param_dtype,
                compute,
                param_dtype,
                owner=engine.lower().replace("_lm", "-lm"),
            )
        scaler_on = scaler_kwargs.enabled if scaler_kwargs is not None else True
        if precision == "fp16":
            if device_type == "cpu" and not cpu_supports_fp16():
                raise ValueError(
                    f"mixed_precision='fp16' on CPU needs float16 autocast and a CPU GradScaler, "
                    f"which torch {torch.__version__} lacks: use mixed_precision='bf16' on CPU, "
                    "or upgrade torch"
                )
            if device_type != "cpu" and device_type not in _FP16_ACCELERATORS:
                raise ValueError(
                    f"mixed_precision='fp16' is not supported on device type {device_type!r}: "
                    f"use one of cpu, {', '.join(sorted(_FP16_ACCELERATORS))}, or "
                    "mixed_precision='bf16'/'no'"
                )
            return cls(
                "fp16",
                device_type,
                param_dtype,
                torch.float16,
                param_dtype,
                output_dtype=torch.float32,
                autocast=True,
                scaler=scaler_on,
            )
        if not _bf16_supported(device_type):
            raise ValueError(
                f"mixed_precision={precision!r} needs bfloat16, which this {device_type} device "
                "does not support: use mixed_precision='fp16' (with loss scaling) or 'no'"
            )
        backend = resolve_fp8_backend(fp8_backend) if precision == "fp8" else None
        return cls(
            precision,
            device_type,
            param_dtype,
            torch.bfloat16,
            param_dtype,
            output_dtype=torch.float32,
            autocast=True,
            fp8_backend=backend,
        )

    def autocast_context(
        self, autocast_kwargs: AutocastKwargs | Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Any]:
        """A fresh ``torch.autocast`` for this policy, or a null context when it does not autocast.

        Args:
            autocast_kwargs: ``AutocastKwargs`` (only its changed fields are passed) or a
                mapping of ``torch.autocast`` keyword arguments.
        """
        if not self.autocast:
            return contextlib.nullcontext()
        kwargs = autocast_arguments(autocast_kwargs)
        return torch.autocast(self.device_type, dtype=self.compute_dtype, **kwargs)

    def bytes_per_parameter(self, optimizer: Any = None) -> dict[str, int | None]:
        """Expected persistent bytes per parameter for weights, gradients and optimizer state.

        ``optimizer_state`` is ``None`` when no optimizer is given or its state is unknown.
        Autocast's low-precision weight copies are transient and not counted.
        """
        width = torch.empty((), dtype=self.param_dtype).element_size()
        slots = _optimizer_state_slots(optimizer) if optimizer is not None else None
        return {
            "weights": width,
            "grads": width,
            "optimizer_state": slots[1] * width if slots is not None else None,
        }

    def describe(self, optimizer: Any = None) -> str:
        """One line: precision, compute dtype, scaler and bytes per parameter."""
        counts = self.bytes_per_parameter(optimizer)
        weights, grads, state = counts["weights"], counts["grads"], counts["optimizer_state"]
        if self.owner != "accel":
            how = f"applied by {self.owner} (its config decides dtypes and loss scaling)"
        elif self.autocast:
            how = f"autocast {_dtype(self.compute_dtype)} on {self.device_type}"
            if self.fp8_backend is not None:
                how += f" + fp8 linear layers via {self.fp8_backend}"
        else:
            how = f"no autocast, compute {_dtype(self.compute_dtype)} on {self.device_type}"
        scaler = "GradScaler (dynamic loss scale)" if self.scaler else "no loss scaler"
        outputs = _dtype(self.output_dtype) if self.output_dtype is not None else "as computed"
        memory = f"bytes/param: weights {weights} + grads {grads}"
        if state is not None:
            slots = _optimizer_state_slots(optimizer)
            name = slots[0] if slots is not None else "optimizer"
            memory += f" + optimizer {state} ({name}) = {weights + grads + state}"  # type: ignore[operator]
        else:
            memory += " + optimizer state (Adam-style adds 2 x param bytes)"
        return (
            f"accel precision: {self.mixed_precision} | {how} | params {_dtype(self.param_dtype)}, "
            f"grads reduced in {_dtype(self.reduce_dtype)}, outputs {outputs} | {scaler} | {memory}"
        )

    def __str__(self) -> str:
        return self.describe()


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast_arguments(
    autocast_kwargs: AutocastKwargs | Mapping[str, Any] | None,
) -> dict[str, Any]:
    if autocast_kwargs is None:
        return {}
    if isinstance(autocast_kwargs, AutocastKwargs):
        return autocast_kwargs.to_kwargs()
    if isinstance(autocast_kwargs, Mapping):
        return dict(autocast_kwargs)
    raise TypeError(
        f"autocast_kwargs={autocast_kwargs!r} must be an AutocastKwargs or a dict of "
        "torch.autocast keyword arguments"
    )
