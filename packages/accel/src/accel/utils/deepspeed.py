"""Accelerate's ``accelerate.utils.deepspeed``, re-exported from the packages that own it.

DeepSpeed helpers (Accelerate's ``accelerate.utils.deepspeed``): ``DummyOptim`` /
``DummyScheduler`` build; the engine wrappers refuse, as the DeepSpeed engine is not in this
release.
"""

from __future__ import annotations

from accel.engine_plugins import (
    DummyOptim,
    DummyScheduler,
)
from accel.unavailable import DEEPSPEED

DeepSpeedEngineWrapper = DEEPSPEED["DeepSpeedEngineWrapper"]
DeepSpeedOptimizerWrapper = DEEPSPEED["DeepSpeedOptimizerWrapper"]
DeepSpeedSchedulerWrapper = DEEPSPEED["DeepSpeedSchedulerWrapper"]
HfDeepSpeedConfig = DEEPSPEED["HfDeepSpeedConfig"]
get_active_deepspeed_plugin = DEEPSPEED["get_active_deepspeed_plugin"]
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
]
