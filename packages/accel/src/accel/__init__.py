"""accel: run a plain PyTorch training loop anywhere, with Accelerate's public API.

``import accel`` offers the top-level names of ``accelerate`` that accel implements, so a
script written for Accelerate runs after replacing ``accelerate`` with ``accel``. The objects
come from the packages that own them (``accel_state``, ``accel_data``, ``accel_amp``,
``accel_bigmodel``, ``accel_launch``) and from this package's own modules; nothing here is a
copy or a wrapper.

Helpers that Accelerate keeps in ``accelerate.utils`` live in :mod:`accel.utils`; the modules
``accel.state``, ``accel.data_loader``, ``accel.optimizer``, ``accel.scheduler``,
``accel.launchers``, ``accel.logging``, ``accel.big_modeling``, ``accel.hooks`` and
``accel.parallelism_config`` mirror
Accelerate's modules of the same names; like Accelerate's, they are loaded by ``import accel``,
so ``accel.utils.gather`` works without a separate import.
"""

from __future__ import annotations

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
from .__about__ import __version__
from .accelerator import Accelerator
from .alias import install_as_accelerate
from .engine_plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from .handlers import DDPCommunicationHookType, DistributedDataParallelKwargs, ProfileKwargs
from .inference import prepare_pippy
from .memory import find_executable_batch_size
from .parallelism_config import ParallelismConfig

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
