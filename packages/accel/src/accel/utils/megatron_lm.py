"""Accelerate's ``accelerate.utils.megatron_lm``, re-exported from the packages that own it.

Megatron-LM helpers (Accelerate's ``accelerate.utils.megatron_lm``): importable; each refuses
when used, as accel does not implement Megatron-LM.
"""

from __future__ import annotations

from accel.unavailable import MEGATRON_LM

AbstractTrainStep = MEGATRON_LM["AbstractTrainStep"]
BertTrainStep = MEGATRON_LM["BertTrainStep"]
GPTTrainStep = MEGATRON_LM["GPTTrainStep"]
MegatronEngine = MEGATRON_LM["MegatronEngine"]
MegatronLMDummyDataLoader = MEGATRON_LM["MegatronLMDummyDataLoader"]
MegatronLMDummyScheduler = MEGATRON_LM["MegatronLMDummyScheduler"]
MegatronLMOptimizerWrapper = MEGATRON_LM["MegatronLMOptimizerWrapper"]
MegatronLMSchedulerWrapper = MEGATRON_LM["MegatronLMSchedulerWrapper"]
T5TrainStep = MEGATRON_LM["T5TrainStep"]
avg_losses_across_data_parallel_group = MEGATRON_LM["avg_losses_across_data_parallel_group"]
finish_mpu_init = MEGATRON_LM["finish_mpu_init"]
gather_across_data_parallel_groups = MEGATRON_LM["gather_across_data_parallel_groups"]
initialize = MEGATRON_LM["initialize"]
model_provider_func = MEGATRON_LM["model_provider_func"]
prepare_data_loader = MEGATRON_LM["prepare_data_loader"]
prepare_model_optimizer_scheduler = MEGATRON_LM["prepare_model_optimizer_scheduler"]
prepare_optimizer = MEGATRON_LM["prepare_optimizer"]
prepare_scheduler = MEGATRON_LM["prepare_scheduler"]

__all__ = [
    "AbstractTrainStep",
    "BertTrainStep",
    "GPTTrainStep",
    "MegatronEngine",
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "MegatronLMOptimizerWrapper",
    "MegatronLMSchedulerWrapper",
    "T5TrainStep",
    "avg_losses_across_data_parallel_group",
    "finish_mpu_init",
    "gather_across_data_parallel_groups",
    "initialize",
    "model_provider_func",
    "prepare_data_loader",
    "prepare_model_optimizer_scheduler",
    "prepare_optimizer",
    "prepare_scheduler",
]
