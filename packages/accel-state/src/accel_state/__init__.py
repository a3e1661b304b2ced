"""accel-state: who this process is, which device it uses, and how processes talk.

The lowest layer of accel: process topology (torchrun, SLURM, Open MPI, PMI), device
discovery, the ``torch.distributed`` process group, the shared ``PartialState`` /
``AcceleratorState`` / ``GradientState``, collectives over nested structures, RNG
synchronisation, multi-process logging and the ``ACCEL_*`` environment contract.
"""

from __future__ import annotations

from .__about__ import __version__
from .collectives import (
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
from .enums import (
    BaseEnum,
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from .environment import (
    clear_environment,
    convert_dict_to_env_variables,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accel_environment,
    str_to_bool,
)
from .exceptions import DistributedOperationException
from .imports import (
    compare_versions,
    is_bf16_available,
    is_cuda_available,
    is_deepspeed_available,
    is_mps_available,
    is_numpy_available,
    is_rich_available,
    is_safetensors_available,
    is_tensorboard_available,
    is_torch_version,
    is_torch_xla_available,
    is_wandb_available,
    is_xpu_available,
)
from .kwargs import InitProcessGroupKwargs, KwargsHandler
from .logging import MultiProcessAdapter, get_logger
from .rng import set_seed, synchronize_rng_state, synchronize_rng_states
from .serialization import clean_state_dict_for_safetensors, load, save
from .state import AcceleratorState, GradientState, PartialState, is_initialized, wait_for_everyone
from .structures import (
    TensorInformation,
    concatenate,
    device_mover,
    find_batch_size,
    find_device,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_torch_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from .topology import ProcessTopology, get_cpu_distributed_information, get_process_topology

__all__ = [
    "AcceleratorState",
    "BaseEnum",
    "CannotPadNestedTensorWarning",
    "ComputeEnvironment",
    "DistributedOperationException",
    "DistributedType",
    "DynamoBackend",
    "GradientState",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MultiProcessAdapter",
    "PartialState",
    "PrecisionType",
    "ProcessTopology",
    "RNGType",
    "SageMakerDistributedType",
    "TensorInformation",
    "__version__",
    "broadcast",
    "broadcast_object_list",
    "clean_state_dict_for_safetensors",
    "clear_environment",
    "compare_versions",
    "concatenate",
    "convert_dict_to_env_variables",
    "copy_tensor_to_devices",
    "device_mover",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "get_cpu_distributed_information",
    "get_data_structure",
    "get_int_from_env",
    "get_logger",
    "get_process_topology",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_bf16_available",
    "is_cuda_available",
    "is_deepspeed_available",
    "is_initialized",
    "is_mps_available",
    "is_namedtuple",
    "is_numpy_available",
    "is_rich_available",
    "is_safetensors_available",
    "is_tensorboard_available",
    "is_torch_tensor",
    "is_torch_version",
    "is_torch_xla_available",
    "is_wandb_available",
    "is_xpu_available",
    "listify",
    "load",
    "pad_across_processes",
    "pad_input_tensors",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accel_environment",
    "recursively_apply",
    "reduce",
    "save",
    "send_to_device",
    "set_seed",
    "slice_tensors",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
]
