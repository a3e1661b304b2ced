"""accel: run a plain PyTorch training loop anywhere, with Accelerate's public API.

``import accel`` offers the top-level names of ``accelerate`` that accel implements, so a
script written for Accelerate runs after replacing ``accelerate`` with ``accel``. The objects
come from the packages that own them (``accel_state``, ``accel_data``, ``accel_amp``,
``accel_bigmodel``, ``accel_launch``) and from this package's own modules; nothing here is a
copy or a wrapper.

Helpers that Accelerate keeps in ``accelerate.utils`` live in :mod:`accel.utils`; the modules
``accel.state``, ``accel.data_loader``, ``accel.optimizer``, ``accel.scheduler``,
``accel.launchers``, ``accel.logging``, ``accel.big_modeling``, ``accel.hooks`` and
``accel.parallelism_config`` mirror Accelerate's modules of the same names, and are attributes
of the package as Accelerate's are (``accel.utils.gather`` works without a separate import).

What ``import accel`` loads is what a training loop needs to construct an ``Accelerator``;
every other name, and those modules, load on first use (module ``__getattr__``), so that the
engines, the trackers, the launcher's config and the big-model machinery cost nothing to a
run that does not use them (``tests/test_import_cost.py`` lists what ``import accel`` must not
load).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .__about__ import __version__
from .accelerator import Accelerator

if TYPE_CHECKING:
    from accel_amp import AutocastKwargs, GradScalerKwargs
    from accel_bigmodel import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        infer_auto_device_map,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
        load_pretrained,
    )
    from accel_data import DataLoaderConfiguration, skip_first_batches
    from accel_launch import debug_launcher, notebook_launcher
    from accel_state import (
        DistributedType,
        InitProcessGroupKwargs,
        PartialState,
        is_rich_available,
        synchronize_rng_states,
    )

    from . import big_modeling as big_modeling
    from . import data_loader as data_loader
    from . import hooks as hooks
    from . import launchers as launchers
    from . import logging as logging
    from . import optimizer as optimizer
    from . import parallelism_config as parallelism_config
    from . import scheduler as scheduler
    from . import state as state
    from . import utils as utils
    from .alias import install_as_accelerate
    from .engine_plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from .handlers import DDPCommunicationHookType, DistributedDataParallelKwargs, ProfileKwargs
    from .inference import prepare_pippy
    from .memory import find_executable_batch_size
    from .parallelism_config import ParallelismConfig

#: Where each lazily loaded name lives: ``"module:attribute"``, or ``"module"`` for a module.
_LAZY: dict[str, str] = {
    "AutocastKwargs": "accel_amp:AutocastKwargs",
    "GradScalerKwargs": "accel_amp:GradScalerKwargs",
    **{
        name: f"accel_bigmodel:{name}"
        for name in (
            "cpu_offload",
            "cpu_offload_with_hook",
            "disk_offload",
            "dispatch_model",
            "infer_auto_device_map",
            "init_empty_weights",
            "init_on_device",
            "load_checkpoint_and_dispatch",
            "load_checkpoint_in_model",
            "load_pretrained",
        )
    },
    "DataLoaderConfiguration": "accel_data:DataLoaderConfiguration",
    "skip_first_batches": "accel_data:skip_first_batches",
    "debug_launcher": "accel_launch:debug_launcher",
    "notebook_launcher": "accel_launch:notebook_launcher",
    **{
        name: f"accel_state:{name}"
        for name in (
            "DistributedType",
            "InitProcessGroupKwargs",
            "PartialState",
            "is_rich_available",
            "synchronize_rng_states",
        )
    },
    **{
        name: f"accel.{name}"
        for name in (
            "big_modeling",
            "data_loader",
            "hooks",
            "launchers",
            "logging",
            "optimizer",
            "parallelism_config",
            "scheduler",
            "state",
            "utils",
        )
    },
    "install_as_accelerate": "accel.alias:install_as_accelerate",
    "DeepSpeedPlugin": "accel.engine_plugins:DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin": "accel.engine_plugins:FullyShardedDataParallelPlugin",
    "DDPCommunicationHookType": "accel.handlers:DDPCommunicationHookType",
    "DistributedDataParallelKwargs": "accel.handlers:DistributedDataParallelKwargs",
    "ProfileKwargs": "accel.handlers:ProfileKwargs",
    "prepare_pippy": "accel.inference:prepare_pippy",
    "find_executable_batch_size": "accel.memory:find_executable_batch_size",
    "ParallelismConfig": "accel.parallelism_config:ParallelismConfig",
}


def __getattr__(name: str) -> Any:
    """Load a lazily offered name on first use (then it is a plain attribute)."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "__version__",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "install_as_accelerate",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_pretrained",
    "notebook_launcher",
    "prepare_pippy",
    "skip_first_batches",
    "synchronize_rng_states",
]
