"""Accelerate's ``accelerate.utils.other``, re-exported from the packages that own it.

Assorted model and process helpers (Accelerate's ``accelerate.utils.other``).
"""

from __future__ import annotations

from accel.compilation import (
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    has_compiled_regions,
    has_repeated_blocks,
    is_repeated_blocks,
)
from accel.models import (
    extract_model_from_parallel,
    get_model_tp_size,
    get_module_children_bottom_up,
    is_compiled_module,
    model_has_dtensor,
)
from accel_launch.estimate import (
    convert_bytes,
)
from accel_state import (
    wait_for_everyone,
)
from accel_state.serialization import (
    clean_state_dict_for_safetensors,
    load,
    save,
)
from accel_state.structures import (
    get_pretty_name,
    merge_dicts,
    recursive_getattr,
)
from accel_state.topology import (
    check_os_kernel,
    get_free_port,
    is_port_in_use,
)

__all__ = [
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "convert_bytes",
    "extract_model_from_parallel",
    "get_free_port",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "get_pretty_name",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_compiled_module",
    "is_port_in_use",
    "is_repeated_blocks",
    "load",
    "merge_dicts",
    "model_has_dtensor",
    "recursive_getattr",
    "save",
    "wait_for_everyone",
]
