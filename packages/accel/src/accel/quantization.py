"""bitsandbytes quantisation: Accelerate's configuration, and a clear refusal to quantise.

``BnbQuantizationConfig`` keeps Accelerate 1.15's fields, defaults and checks, so a config
built for Accelerate builds with accel. accel does not quantise models itself:
``load_and_quantize_model`` and the layer-replacing helpers raise ``NotImplementedError``
pointing at transformers' ``BitsAndBytesConfig``. ``has_4bit_bnb_layers`` answers for real.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from accel_bigmodel import CustomDtype

from .unavailable import unavailable_function

__all__ = [
    "BnbQuantizationConfig",
    "get_keys_to_not_convert",
    "get_parameter_device",
    "get_quantized_model_device_map",
    "has_4bit_bnb_layers",
    "load_and_quantize_model",
    "quantize_and_offload_8bit",
    "replace_with_bnb_layers",
]

_COMPUTE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass
class BnbQuantizationConfig:
    """bitsandbytes 8-bit or 4-bit settings (Accelerate 1.15's fields and checks).

    Raises:
        ValueError: both or neither of ``load_in_8bit`` / ``load_in_4bit``; a value of the
            wrong type; an unknown quant type or compute dtype.
    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: torch.dtype | None = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None

    def __post_init__(self) -> None:
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, not {getattr(self, name)!r}")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both True: choose one")
        if not self.load_in_4bit and not self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both False: choose one")
        if isinstance(self.llm_int8_threshold, bool) or not isinstance(
            self.llm_int8_threshold, int | float
        ):
            raise ValueError(
                f"llm_int8_threshold must be a number, not {self.llm_int8_threshold!r}"
            )
        if self.bnb_4bit_quant_type not in ("fp4", "nf4"):
            raise ValueError(
                f"bnb_4bit_quant_type must be in ['fp4','nf4'] but found {self.bnb_4bit_quant_type}"
            )
        if isinstance(self.bnb_4bit_compute_dtype, str):
            if self.bnb_4bit_compute_dtype not in _COMPUTE_DTYPES:
                raise ValueError(
                    "bnb_4bit_compute_dtype must be in ['fp32','fp16','bf16'] but found "
                    f"{self.bnb_4bit_compute_dtype}"
                )
            self.bnb_4bit_compute_dtype = _COMPUTE_DTYPES[self.bnb_4bit_compute_dtype]
        elif not isinstance(self.bnb_4bit_compute_dtype, torch.dtype):
            raise ValueError("bnb_4bit_compute_dtype must be a string or a torch.dtype")
        for name in ("skip_modules", "keep_in_fp32_modules"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list of strings")
        self.target_dtype = CustomDtype.INT4 if self.load_in_4bit else torch.int8


def has_4bit_bnb_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes 4-bit linears (False without bitsandbytes)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    import bitsandbytes

    return any(isinstance(module, bitsandbytes.nn.Linear4bit) for module in model.modules())


_BNB = "bitsandbytes quantisation, which accel does not implement"
_INSTEAD = (
    "Load the model quantised with transformers (from_pretrained(..., "
    "quantization_config=BitsAndBytesConfig(...))), then prepare or dispatch it with accel."
)
load_and_quantize_model = unavailable_function("load_and_quantize_model", _BNB, _INSTEAD)
replace_with_bnb_layers = unavailable_function("replace_with_bnb_layers", _BNB, _INSTEAD)
quantize_and_offload_8bit = unavailable_function("quantize_and_offload_8bit", _BNB, _INSTEAD)
get_keys_to_not_convert = unavailable_function("get_keys_to_not_convert", _BNB, _INSTEAD)
get_quantized_model_device_map = unavailable_function(
    "get_quantized_model_device_map", _BNB, _INSTEAD
)


def get_parameter_device(parameter: torch.nn.Module) -> torch.device:
    """The device of ``parameter``'s (a module's) first parameter.

    Raises:
        StopIteration: the module has no parameter.
    """
    return next(parameter.parameters()).device
