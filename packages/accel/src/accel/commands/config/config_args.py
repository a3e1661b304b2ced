"""Config-file classes (Accelerate's ``accelerate.commands.config.config_args``).

``ClusterConfig`` and ``load_config_from_file`` are accel-launch's: Accelerate's keys, old
spellings converted, unknown keys refused. ``default_config_file`` is where accel's default
config lives (``$ACCEL_HOME`` or ``$XDG_CONFIG_HOME/accel``). SageMaker configs are refused:
accel does not launch on SageMaker.
"""

from __future__ import annotations

from accel.unavailable import unavailable_class
from accel_launch.config import (
    BaseConfig,
    ClusterConfig,
    default_config_path,
    load_config_from_file,
)

__all__ = [
    "BaseConfig",
    "ClusterConfig",
    "SageMakerConfig",
    "cache_dir",
    "default_config_file",
    "default_json_config_file",
    "default_yaml_config_file",
    "load_config_from_file",
]

default_yaml_config_file = str(default_config_path())
default_config_file = default_yaml_config_file
default_json_config_file = str(default_config_path().with_suffix(".json"))
cache_dir = str(default_config_path().parent)

SageMakerConfig = unavailable_class(
    "SageMakerConfig", "Amazon SageMaker launching, which accel does not implement"
)
