"""Accelerate's ``accelerate.utils.deepspeed``, re-exported from the packages that own it.

``DummyOptim`` / ``DummyScheduler``, the engine wrappers, ``get_active_deepspeed_plugin`` and
accel's ``zero3_init_context`` (build a model partitioned under ZeRO-3) are the DeepSpeed
engine's own (:mod:`accel.engines.deepspeed`), ``HfDeepSpeedConfig`` is the config reader
transformers asks (:mod:`accel.engines.hf_deepspeed_config`); ``GatheredParameters`` and
``map_pytorch_optim_to_deepspeed`` import and refuse when used (``deepspeed.zero.
GatheredParameters`` is the gathering).
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
from accel.engines.hf_deepspeed_config import HfDeepSpeedConfig
from accel.unavailable import DEEPSPEED

map_pytorch_optim_to_deepspeed = DEEPSPEED["map_pytorch_optim_to_deepspeed"]

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
