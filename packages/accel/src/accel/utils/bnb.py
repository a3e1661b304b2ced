"""Accelerate's ``accelerate.utils.bnb``, re-exported from the packages that own it.

bitsandbytes quantisation (Accelerate's ``accelerate.utils.bnb``): the configuration and checks
are real; quantising refuses (accel does not quantise models).
"""

from __future__ import annotations

from accel.quantization import (
    get_keys_to_not_convert,
    get_parameter_device,
    get_quantized_model_device_map,
    has_4bit_bnb_layers,
    load_and_quantize_model,
    quantize_and_offload_8bit,
    replace_with_bnb_layers,
)

__all__ = [
    "get_keys_to_not_convert",
    "get_parameter_device",
    "get_quantized_model_device_map",
    "has_4bit_bnb_layers",
    "load_and_quantize_model",
    "quantize_and_offload_8bit",
    "replace_with_bnb_layers",
]
