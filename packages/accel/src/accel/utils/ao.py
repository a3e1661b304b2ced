"""Accelerate's ``accelerate.utils.ao``, re-exported from the packages that own it.

torchao FP8 helpers (Accelerate's ``accelerate.utils.ao``).
"""

from __future__ import annotations

from accel_amp.fp8 import (
    convert_model_to_fp8_ao,
    filter_first_and_last_linear_layers,
    filter_linear_layers,
    find_first_last_linear_layers,
    has_ao_layers,
)

__all__ = [
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
]
