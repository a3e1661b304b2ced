"""accel-amp: mixed precision and gradient accumulation for plain PyTorch training loops.

A printable :class:`PrecisionPolicy` (what ``"no"``/``"fp16"``/``"bf16"``/``"fp8"`` mean on a
device), forward wrapping (autocast in, fp32 out, fully undoable and picklable), the
``GradScaler`` helpers, ``AcceleratedOptimizer`` / ``AcceleratedScheduler``, and
``GradientAccumulator`` — the one owner of ``no_sync``, loss scaling, clipping and exact loss
normalisation, driven by accel-state's ``GradientState``. Depends only on torch and
accel-state.
"""

from __future__ import annotations

from .__about__ import __version__
from .accumulation import (
    DuckGradientSync,
    GradientAccumulationPlugin,
    GradientAccumulator,
    GradientSync,
    make_gradient_accumulation_plugin,
    no_sync,
    plan_accumulation,
)
from .autocast import get_grad_scaler, get_mixed_precision_context_manager
from .engine_capabilities import HasAveragingGroup, OwnsBackward, SumsOverAveragingWorld
from .forward import (
    AutocastForward,
    ConvertOutputsToFp32,
    convert_outputs_to_fp32,
    convert_to_fp32,
    is_forward_wrapped,
    unwrap_forward,
    wrap_forward,
)
from .fp8 import AORecipeKwargs, convert_model_to_fp8, resolve_fp8_backend
from .kwargs import AutocastKwargs, GradScalerKwargs
from .optimizer import AcceleratedOptimizer
from .policy import (
    MIXED_PRECISION_CHOICES,
    MixedPrecision,
    PrecisionPolicy,
    validate_mixed_precision,
)
from .scheduler import AcceleratedScheduler

__all__ = [
    "MIXED_PRECISION_CHOICES",
    "AORecipeKwargs",
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "AutocastForward",
    "AutocastKwargs",
    "ConvertOutputsToFp32",
    "DuckGradientSync",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientAccumulator",
    "GradientSync",
    "HasAveragingGroup",
    "MixedPrecision",
    "OwnsBackward",
    "PrecisionPolicy",
    "SumsOverAveragingWorld",
    "__version__",
    "convert_model_to_fp8",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "get_grad_scaler",
    "get_mixed_precision_context_manager",
    "is_forward_wrapped",
    "make_gradient_accumulation_plugin",
    "no_sync",
    "plan_accumulation",
    "resolve_fp8_backend",
    "unwrap_forward",
    "validate_mixed_precision",
    "wrap_forward",
]
