"""Accelerate's ``accelerate.utils.operations``, re-exported from the packages that own it.

Collectives and nested-structure helpers (Accelerate's ``accelerate.utils.operations``).
"""

from __future__ import annotations

from accel.unavailable import DEEPSPEED
from accel_amp import (
    ConvertOutputsToFp32,
    convert_outputs_to_fp32,
    convert_to_fp32,
)
from accel_state.collectives import (
    CannotPadNestedTensorWarning,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    pad_input_tensors,
    reduce,
)
from accel_state.exceptions import (
    DistributedOperationException,
)
from accel_state.structures import (
    concatenate,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    is_torch_xpu_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

GatheredParameters = DEEPSPEED["GatheredParameters"]

__all__ = [
    "CannotPadNestedTensorWarning",
    "ConvertOutputsToFp32",
    "DistributedOperationException",
    "GatheredParameters",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "get_data_structure",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "is_torch_xpu_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]
