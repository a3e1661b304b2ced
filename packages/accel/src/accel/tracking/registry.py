"""Which trackers ``log_with`` can name, which are installed, and building them."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, cast

from accel_state import LoggerType
from accel_state.imports import (
    is_aim_available,
    is_clearml_available,
    is_comet_ml_available,
    is_dvclive_available,
    is_mlflow_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_trackio_available,
    is_wandb_available,
)

from .aim import AimTracker
from .base import GeneralTracker, install_command
from .clearml import ClearMLTracker
from .comet import CometMLTracker
from .dvclive import DVCLiveTracker
from .local import JSONLTracker, TensorBoardTracker
from .mlflow import MLflowTracker
from .swanlab import SwanLabTracker
from .trackio import TrackioTracker
from .wandb import WandBTracker

logger = logging.getLogger(__name__)

# --- selection ------------------------------------------------------------------------------

#: The trackers ``log_with`` can name: the built-in ones, then those given to
#: :func:`register_tracker_class`.
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "jsonl": JSONLTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "mlflow": MLflowTracker,
    "comet_ml": CometMLTracker,
    "aim": AimTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}

AVAILABILITY: dict[str, Callable[[], bool]] = {
    "jsonl": lambda: True,
    "tensorboard": is_tensorboard_available,
    "wandb": is_wandb_available,
    "mlflow": is_mlflow_available,
    "comet_ml": is_comet_ml_available,
    "aim": is_aim_available,
    "clearml": is_clearml_available,
    "dvclive": is_dvclive_available,
    "swanlab": is_swanlab_available,
    "trackio": is_trackio_available,
}

#: The extra of ``accel`` that installs each built-in tracker's library.
_EXTRAS: dict[str, str] = {
    name: name.replace("_", "-") for name in LOGGER_TYPE_TO_CLASS if name != "jsonl"
}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a ``GeneralTracker`` subclass available to ``log_with`` by its ``name``.

    Register before building the ``Accelerator`` that uses it. The class is built as
    ``cls(project_name, logging_dir, **init_kwargs)`` when ``requires_logging_directory`` is
    true, else ``cls(project_name, **init_kwargs)``.

    Raises:
        ValueError: not a ``GeneralTracker`` subclass, or without a ``name`` or a
            ``requires_logging_directory`` class attribute.
    """
    import warnings

    if not _is_tracker_class(tracker_class):
        raise ValueError(
            f"register_tracker_class({tracker_class!r}): pass a subclass of GeneralTracker"
        )
    name = getattr(tracker_class, "name", None)
    if not name:
        raise ValueError(
            f"{tracker_class.__name__} needs a non-empty `name` class attribute to be registered"
        )
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            f"{tracker_class.__name__} needs a `requires_logging_directory` class attribute "
            "(True if it writes into a logging directory, else False) to be registered"
        )
    if name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(
            f"A tracker named {name!r} is already registered "
            f"({LOGGER_TYPE_TO_CLASS[name].__name__}); {tracker_class.__name__} replaces it",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class
    AVAILABILITY.setdefault(name, lambda: True)


def get_available_trackers() -> list[str]:
    """Names of the trackers whose dependencies are installed (``"jsonl"`` always)."""
    return [name for name in LOGGER_TYPE_TO_CLASS if AVAILABILITY.get(name, lambda: True)()]


#: What ``filter_trackers`` returns per tracker: a built-in name, a class, or an instance.
_TrackerSpec: TypeAlias = "str | GeneralTracker | type[GeneralTracker]"


def _is_tracker_class(item: Any) -> bool:
    return isinstance(item, type) and issubclass(item, GeneralTracker)


def _require_directory(label: str, logging_dir: Any, name: str) -> None:
    if logging_dir is None:
        # Accelerate's wording first (scripts match it), then which entry and the fix.
        raise ValueError(
            f"Logging with `{name}` requires a `logging_dir` to be passed in: log_with includes "
            f"{label}, which writes files, but no logging directory was given; pass "
            "project_dir=... to Accelerator (or project_config=ProjectConfiguration("
            "project_dir=..., logging_dir=...)), or logging_dir=... to filter_trackers"
        )


def filter_trackers(
    log_with: _TrackerSpec | Sequence[_TrackerSpec] | None,
    logging_dir: str | os.PathLike[str] | None = None,
) -> list[_TrackerSpec]:
    """Resolve ``log_with`` into the trackers to use, as the ``Accelerator`` does.

    Args:
        log_with: ``"all"`` (every built-in tracker whose dependencies are installed; those
            writing files, ``"jsonl"`` included, only when ``logging_dir`` is given), a
            tracker name (``"jsonl"``, ``"wandb"``, ... or a ``LoggerType``), a
            ``GeneralTracker`` instance or subclass, or a list of these; ``None`` for none.
        logging_dir: Where file-writing trackers put their runs.

    Returns:
        In order and without duplicates: built-in tracker names as plain strings (equal to
        their ``LoggerType`` members), custom tracker classes (still to be constructed) and
        custom tracker instances (used as given). ``"all"`` takes the built-in trackers
        whose libraries are installed and that can run (a logging directory for those
        writing files).

    Raises:
        ValueError: an entry is not a known tracker name, ``GeneralTracker`` or subclass (the
            message lists the choices), or a tracker needing a logging directory is
            requested without ``logging_dir``.
        ImportError: a built-in tracker named explicitly has no library installed (the
            message gives the pip command).
    """
    if log_with is None:
        return []
    if isinstance(log_with, (str, GeneralTracker)) or _is_tracker_class(log_with):
        entries: list[Any] = [log_with]
    elif isinstance(log_with, Sequence):
        entries = list(log_with)
    else:
        entries = [log_with]

    selection = _Selection(logging_dir)
    for entry in entries:
        selection.add(entry)
    return selection.chosen


class _Selection:
    """The trackers chosen so far, in order and without duplicates; one method per kind."""

    def __init__(self, logging_dir: str | os.PathLike[str] | None) -> None:
        self.logging_dir = logging_dir
        self.chosen: list[_TrackerSpec] = []

    def add(self, entry: Any) -> None:
        if isinstance(entry, GeneralTracker):
            if not any(entry is existing for existing in self.chosen):
                self.chosen.append(entry)
        elif _is_tracker_class(entry):
            self.add_class(entry)
        elif isinstance(entry, str):
            self.add_name(entry)
        else:
            raise ValueError(_unknown_message(entry))

    def add_class(self, tracker: type[GeneralTracker]) -> None:
        if getattr(tracker, "requires_logging_directory", False):
            name = getattr(tracker, "name", tracker.__name__)
            _require_directory(tracker.__name__, self.logging_dir, name)
        if tracker not in self.chosen:
            self.chosen.append(tracker)

    def add_name(self, entry: str) -> None:
        name = str(entry).lower()
        if name == LoggerType.ALL:
            for builtin in get_available_trackers():
                self.add_builtin(builtin, explicit=False)
        elif name in LOGGER_TYPE_TO_CLASS:
            self.add_builtin(name, explicit=True)
        else:
            raise ValueError(_unknown_message(entry))

    def add_builtin(self, name: str, explicit: bool) -> None:
        if name in self.chosen:
            return
        if not AVAILABILITY.get(name, lambda: True)():
            # Only an explicit name gets here ("all" takes the installed ones): refuse it
            # rather than train without the tracker that was asked for.
            extra = _EXTRAS.get(name)
            fix = install_command(extra) if extra else f"install the library {name!r} needs"
            raise ImportError(
                f"log_with names the tracker {name!r}, but its library is not installed: {fix} "
                "(or leave it out of log_with)"
            )
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory:
            if not explicit and self.logging_dir is None:
                # "all" is the trackers that can run here: one that writes files cannot
                # without a logging directory (Accelerate's "all" is the installed libraries).
                logger.info(
                    f"log_with='all' leaves out {name!r}: it writes files and no logging "
                    "directory was given (pass project_dir=... to the Accelerator to include it)"
                )
                return
            _require_directory(repr(name), self.logging_dir, name)
        self.chosen.append(name)


def _choices() -> list[str]:
    return [str(LoggerType.ALL), *LOGGER_TYPE_TO_CLASS]


def _unknown_message(entry: Any) -> str:
    return (
        f"log_with contains {entry!r} ({type(entry).__name__}), which is not a tracker: use one "
        f"of {', '.join(repr(n) for n in _choices())}, a GeneralTracker subclass, or an "
        "instance of one"
    )


def make_trackers(
    trackers: Sequence[_TrackerSpec],
    project_name: str,
    logging_dir: str | os.PathLike[str] | None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[GeneralTracker]:
    """Construct the trackers :func:`filter_trackers` selected (for ``init_trackers``).

    Names and classes are constructed as ``cls(project_name, logging_dir, **kw)`` when they
    need a logging directory, else ``cls(project_name, **kw)``, with ``kw`` taken from
    ``init_kwargs[tracker.name]``; instances are returned as given. ``start()`` is not
    called.
    """
    init_kwargs = init_kwargs or {}
    built: list[GeneralTracker] = []
    for spec in trackers:
        if isinstance(spec, GeneralTracker):
            built.append(spec)
            continue
        cls = LOGGER_TYPE_TO_CLASS[spec] if isinstance(spec, str) else spec
        kwargs = dict(init_kwargs.get(cls.name, {}))
        factory = cast(Callable[..., GeneralTracker], cls)
        if cls.requires_logging_directory:
            _require_directory(repr(cls.name), logging_dir, cls.name)
            built.append(factory(project_name, logging_dir, **kwargs))
        else:
            built.append(factory(project_name, **kwargs))
    return built
