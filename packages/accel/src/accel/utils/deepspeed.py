"""Accelerate's ``accelerate.utils.deepspeed``, re-exported from the packages that own it.

``DummyOptim`` / ``DummyScheduler``, the engine wrappers, ``get_active_deepspeed_plugin`` and
accel's ``zero3_init_context`` (build a model partitioned under ZeRO-3) are the DeepSpeed
engine's own (:mod:`accel.engines.deepspeed`), ``map_pytorch_optim_to_deepspeed`` (the CPU
optimizer ZeRO-Offload needs) is :mod:`accel.engines.deepspeed_cpu_optimizer`'s, and
``HfDeepSpeedConfig`` is the config reader transformers asks
(:mod:`accel.engines.hf_deepspeed_config`). Importing them does not import DeepSpeed (only
using them does), so ``accel.utils`` offers them whether DeepSpeed is installed or not, where
``accelerate.utils`` offers them only with DeepSpeed installed.
"""

from __future__ import annotations

from accel.engine_plugins import (
    DummyOptim,
    DummyScheduler,
)
from accel.engines.deepspeed import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    get_active_deepspeed_plugin,
    zero3_init_context,
)
from accel.engines.deepspeed_cpu_optimizer import map_pytorch_optim_to_deepspeed
from accel.engines.hf_deepspeed_config import HfDeepSpeedConfig

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
    "zero3_init_context",
]
