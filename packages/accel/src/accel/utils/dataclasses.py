"""Accelerate's ``accelerate.utils.dataclasses``, re-exported from the packages that own it.

Configuration classes, kwargs handlers, plugins and enums (Accelerate's
``accelerate.utils.dataclasses``).
"""

from __future__ import annotations

from accel.engine_plugins import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    MegatronLMPlugin,
    TorchTensorParallelPlugin,
)
from accel.handlers import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from accel.models import (
    get_module_class_from_name,
)
from accel.parallelism_config import (
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from accel.quantization import (
    BnbQuantizationConfig,
)
from accel.unavailable import MEGATRON_LM
from accel_amp import (
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
)
from accel_amp.fp8 import (
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from accel_bigmodel import (
    CustomDtype,
)
from accel_data import (
    DataLoaderConfiguration,
)
from accel_state.enums import (
    BaseEnum,
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    EnumWithContains,
    FP8BackendType,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from accel_state.kwargs import (
    InitProcessGroupKwargs,
    KwargsHandler,
)
from accel_state.structures import (
    TensorInformation,
)

add_model_config_to_megatron_parser = MEGATRON_LM["add_model_config_to_megatron_parser"]
parse_bert_config = MEGATRON_LM["parse_bert_config"]
parse_glm4_moe_config = MEGATRON_LM["parse_glm4_moe_config"]
parse_gpt2_config = MEGATRON_LM["parse_gpt2_config"]
parse_llama_config = MEGATRON_LM["parse_llama_config"]
parse_t5_config = MEGATRON_LM["parse_t5_config"]

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "BaseEnum",
    "BnbQuantizationConfig",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MSAMPRecipeKwargs",
    "MegatronLMPlugin",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TensorInformation",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "add_model_config_to_megatron_parser",
    "get_module_class_from_name",
    "parse_bert_config",
    "parse_glm4_moe_config",
    "parse_gpt2_config",
    "parse_llama_config",
    "parse_t5_config",
]
