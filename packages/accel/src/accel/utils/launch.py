"""Accelerate's ``accelerate.utils.launch``, re-exported from the packages that own it.

Launcher helpers (Accelerate's ``accelerate.utils.launch``).
"""

from __future__ import annotations

from accel.unavailable import LAUNCHERS
from accel_launch.accelerate_args import (
    env_var_path_add,
    prepare_extend_env_parallelism_config,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
    prepare_tpu,
    setup_fp8_env,
)
from accel_launch.launchers import (
    PrepareForLaunch,
)

prepare_deepspeed_cmd_env = LAUNCHERS["prepare_deepspeed_cmd_env"]
prepare_sagemager_args_inputs = LAUNCHERS["prepare_sagemager_args_inputs"]

__all__ = [
    "PrepareForLaunch",
    "env_var_path_add",
    "prepare_deepspeed_cmd_env",
    "prepare_extend_env_parallelism_config",
    "prepare_multi_gpu_env",
    "prepare_sagemager_args_inputs",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
    "setup_fp8_env",
]
