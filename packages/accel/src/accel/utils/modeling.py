"""Accelerate's ``accelerate.utils.modeling``, re-exported from the packages that own it.

Model sizes, device maps, checkpoint loading and tied weights (Accelerate's
``accelerate.utils.modeling``).
"""

from __future__ import annotations

from accel.models import (
    is_peft_model,
)
from accel_amp import (
    get_grad_scaler,
    get_mixed_precision_context_manager,
)
from accel_bigmodel import (
    align_module_device,
    calculate_maximum_sizes,
    check_device_map,
    check_device_same,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    clean_device_map,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    fallback_allocate,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    get_module_leaves,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    id_tensor_storage,
    infer_auto_device_map,
    load_checkpoint_in_model,
    load_offloaded_weights,
    load_state_dict,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)

__all__ = [
    "align_module_device",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "fallback_allocate",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
]
