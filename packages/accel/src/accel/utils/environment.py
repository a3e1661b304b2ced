"""Accelerate's ``accelerate.utils.environment``, re-exported from the packages that own it.

Environment variables, hardware probes and NUMA affinity (Accelerate's
``accelerate.utils.environment``).
"""

from __future__ import annotations

from accel_state.devices import (
    check_cuda_fp8_capability,
    check_cuda_p2p_ib_support,
    get_current_device_type,
    get_driver_version,
    get_gpu_info,
    override_numa_affinity,
    set_numa_affinity,
)
from accel_state.environment import (
    clear_environment,
    convert_dict_to_env_variables,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accelerate_environment,
    str_to_bool,
)
from accel_state.imports import (
    are_libraries_initialized,
)
from accel_state.topology import (
    CPUInformation,
    get_cpu_distributed_information,
)

__all__ = [
    "CPUInformation",
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "get_current_device_type",
    "get_driver_version",
    "get_gpu_info",
    "get_int_from_env",
    "override_numa_affinity",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "set_numa_affinity",
    "str_to_bool",
]
