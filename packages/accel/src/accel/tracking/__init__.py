"""Experiment trackers: the ``GeneralTracker`` interface and the trackers accel ships.

A tracker receives the run's configuration once (``store_init_configuration``) and metrics
at every logging step (``log``). The ``Accelerator`` builds the trackers named by its
``log_with`` argument (see :func:`filter_trackers`), calls ``start()`` on each, and forwards
``Accelerator.log`` to them on the main process.

Built-in trackers, each behind its own extra of ``accel``:

- ``"jsonl"`` (:class:`JSONLTracker`): no dependency; one JSON object per line in
  ``<logging_dir>/<run_name>/metrics.jsonl`` and the configuration in ``config.json``.
- ``"tensorboard"`` (:class:`TensorBoardTracker`): ``pip install "accel[tensorboard]"``.
- ``"wandb"`` (:class:`WandBTracker`), ``"mlflow"`` (:class:`MLflowTracker`),
  ``"comet_ml"`` (:class:`CometMLTracker`), ``"aim"`` (:class:`AimTracker`), ``"clearml"``
  (:class:`ClearMLTracker`), ``"dvclive"`` (:class:`DVCLiveTracker`), ``"swanlab"``
  (:class:`SwanLabTracker`) and ``"trackio"`` (:class:`TrackioTracker`): each needs its
  library, ``pip install "accel[<name>]"`` (``accel[comet-ml]`` for Comet).

Naming a tracker whose library is missing raises ``ImportError`` with the pip command;
``log_with="all"`` takes every installed one. Any other backend plugs in by subclassing
:class:`GeneralTracker` (gate its methods with :func:`on_main_process`) and either passing
it in ``log_with`` or registering it with :func:`register_tracker_class`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import GeneralTracker, on_main_process

if TYPE_CHECKING:
    from .aim import AimTracker
    from .clearml import ClearMLTracker
    from .comet import CometMLTracker
    from .dvclive import DVCLiveTracker
    from .local import JSONLTracker, TensorBoardTracker
    from .mlflow import MLflowTracker
    from .registry import (
        AVAILABILITY as AVAILABILITY,
    )
    from .registry import (
        LOGGER_TYPE_TO_CLASS,
        filter_trackers,
        get_available_trackers,
        register_tracker_class,
    )
    from .registry import (
        make_trackers as make_trackers,
    )
    from .swanlab import SwanLabTracker
    from .trackio import TrackioTracker
    from .wandb import WandBTracker

# The tracker modules and the registry load on first use: ``import accel`` needs only the
# ``GeneralTracker`` interface. ``AVAILABILITY`` and ``make_trackers`` are internal: the
# Accelerator and the tests use them.
_LAZY: dict[str, str] = {
    "AimTracker": "aim",
    "ClearMLTracker": "clearml",
    "CometMLTracker": "comet",
    "DVCLiveTracker": "dvclive",
    "JSONLTracker": "local",
    "TensorBoardTracker": "local",
    "MLflowTracker": "mlflow",
    "SwanLabTracker": "swanlab",
    "TrackioTracker": "trackio",
    "WandBTracker": "wandb",
    **{
        name: "registry"
        for name in (
            "AVAILABILITY",
            "LOGGER_TYPE_TO_CLASS",
            "filter_trackers",
            "get_available_trackers",
            "make_trackers",
            "register_tracker_class",
        )
    },
}


def __getattr__(name: str) -> Any:
    """Load a tracker module or the registry when one of its names is first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel.tracking' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]
