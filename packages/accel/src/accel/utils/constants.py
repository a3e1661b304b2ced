"""Accelerate's constants (``accelerate.utils.constants``), with the same names and values.

File names and layer lists come from the modules that use them; the version floors and the
SageMaker, launcher and engine lists below are kept as Accelerate defines them, for scripts
and libraries that read them.
"""

from __future__ import annotations

import operator

from accel.checkpointing import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
)
from accel.model_files import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)
from accel_bigmodel import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from accel_state.engine_vocabulary import (
    FSDP_AUTO_WRAP_POLICIES,
    FSDP_BACKWARD_PREFETCHES,
    FSDP_SHARDING_STRATEGIES,
    FSDP_STATE_DICT_TYPES,
)

SAMPLER_NAME = "sampler"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
FSDP_MODEL_NAME = "pytorch_model_fsdp"

SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]

FSDP_SHARDING_STRATEGY = list(FSDP_SHARDING_STRATEGIES)
FSDP_AUTO_WRAP_POLICY = list(FSDP_AUTO_WRAP_POLICIES)
FSDP_BACKWARD_PREFETCH = list(FSDP_BACKWARD_PREFETCHES)
FSDP_STATE_DICT_TYPE = list(FSDP_STATE_DICT_TYPES)
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]

# Version floors (torch unless named otherwise).
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"

DEEPSPEED_MULTINODE_LAUNCHERS = [
    "pdsh",
    "standard",
    "openmpi",
    "mvapich",
    "mpich",
    "nossh",
    "slurm",
]
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]

STR_OPERATION_TO_FUNC = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}

#: ``torch.distributed.run`` options that ``accelerate launch`` passes through.
TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]

CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    *CUDA_DISTRIBUTED_TYPES,
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]

__all__ = [
    "BETA_CP_AVAILABLE_PYTORCH_VERSION",
    "BETA_SP_AVAILABLE_DEEPSPEED_VERSION",
    "BETA_TP_AVAILABLE_PYTORCH_VERSION",
    "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION",
    "CUDA_DISTRIBUTED_TYPES",
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "DTENSOR_PYTORCH_VERSION",
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION",
    "FSDP2_PYTORCH_VERSION",
    "FSDP2_STATE_DICT_TYPE",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_MODEL_NAME",
    "FSDP_PYTORCH_VERSION",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_STATE_DICT_TYPE",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAGEMAKER_PARALLEL_EC2_INSTANCES",
    "SAGEMAKER_PYTHON_VERSION",
    "SAGEMAKER_PYTORCH_VERSION",
    "SAGEMAKER_TRANSFORMERS_VERSION",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "STR_OPERATION_TO_FUNC",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_DYNAMO_MODES",
    "TORCH_LAUNCH_PARAMS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
]
