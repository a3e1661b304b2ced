"""Accelerate's ``accelerate.utils.transformer_engine``, re-exported from the packages that own it.

Transformer Engine helpers (Accelerate's ``accelerate.utils.transformer_engine``):
``has_transformer_engine_layers`` answers; the conversions refuse (accel drives FP8 through
torchao).
"""

from __future__ import annotations

from accel.unavailable import TRANSFORMER_ENGINE
from accel_amp.fp8 import (
    has_transformer_engine_layers,
)

apply_fp8_autowrap = TRANSFORMER_ENGINE["apply_fp8_autowrap"]
contextual_fp8_autocast = TRANSFORMER_ENGINE["contextual_fp8_autocast"]
convert_model = TRANSFORMER_ENGINE["convert_model"]

__all__ = [
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "has_transformer_engine_layers",
]
