"""Config files (Accelerate's ``accelerate.commands.config``); see :mod:`.config_args`."""

from __future__ import annotations

from .config_args import ClusterConfig, default_config_file, load_config_from_file

__all__ = ["ClusterConfig", "default_config_file", "load_config_from_file"]
