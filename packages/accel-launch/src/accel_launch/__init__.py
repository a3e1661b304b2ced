"""accel-launch: the ``accel`` command and the in-process launchers.

``accel launch`` resolves its settings (flags > ``ACCEL_*`` environment > config file >
defaults, printed with the source of each), then runs the script directly or on torchrun;
``accel config``, ``accel env`` and ``accel test`` manage and check the setup.
``notebook_launcher`` and ``debug_launcher`` start processes from Python. Depends on
accel-state, torch, pyyaml and psutil.
"""

from __future__ import annotations

from .__about__ import __version__
from .config import ClusterConfig, load_config_from_file, write_basic_config
from .launchers import PrepareForLaunch, debug_launcher, notebook_launcher

__all__ = [
    "ClusterConfig",
    "PrepareForLaunch",
    "__version__",
    "debug_launcher",
    "load_config_from_file",
    "notebook_launcher",
    "write_basic_config",
]
