"""Accelerate's ``accelerate.utils.deepspeed``, re-exported from the packages that own it.

``DummyOptim`` / ``DummyScheduler``, the engine wrappers and ``get_active_deepspeed_plugin``
are the DeepSpeed engine's own (:mod:`accel.engines.deepspeed`); ``HfDeepSpeedConfig``,
``GatheredParameters`` and ``map_pytorch_optim_to_deepspeed`` import and refuse when used
(``DeepSpeedPlugin.deepspeed_config`` is the config, ``deepspeed.zero.GatheredParameters`` the
gathering).
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
)
from accel.unavailable import DEEPSPEED

HfDeepSpeedConfig = DEEPSPEED["HfDeepSpeedConfig"]
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
