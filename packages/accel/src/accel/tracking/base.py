"""The tracker interface: ``GeneralTracker``, ``on_main_process`` and library imports."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, cast

from accel_state import PartialState, get_process_topology
from accel_state.logging import get_logger

__all__ = [
    "BlankTracker",
    "GeneralTracker",
    "import_library",
    "install_command",
    "on_main_process",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def warn(message: str) -> None:
    """Log a warning once per run: on the main process when a state exists, else plainly."""
    if PartialState._shared_state:
        get_logger(__name__).warning(message)
    else:
        logging.getLogger(__name__).warning(message)


def is_main_process() -> bool:
    """Whether this process should do main-process-only work.

    Asks the ``PartialState`` when one exists; before that (a tracker built ahead of the
    ``Accelerator``, as in the custom-tracker recipe) reads the rank from the launcher's
    variables (torchrun, SLURM, Open MPI, MVAPICH, PMI) without starting the process group.
    A process started without a launcher is the main process.

    Raises:
        ValueError: the launcher's variables are inconsistent (the message names them).
    """
    if PartialState._shared_state:
        return bool(PartialState().is_main_process)
    return get_process_topology().rank == 0


def on_main_process(method: _F) -> _F:
    """Make a tracker method a no-op on non-main processes when ``main_process_only`` is set.

    The check happens at each call, so decorating ``__init__`` works: on the other ranks
    the constructor body does not run and the object stays empty (the ``Accelerator`` never
    calls a main-process-only tracker there). It works before the ``Accelerator`` exists:
    the rank then comes from the launcher's environment (see :func:`is_main_process`).
    """

    @functools.wraps(method)
    def gated(self: GeneralTracker, *args: Any, **kwargs: Any) -> Any:
        if self.main_process_only and not is_main_process():
            return None
        return method(self, *args, **kwargs)

    return cast(_F, gated)


class GeneralTracker:
    """Base class of every experiment tracker.

    A subclass sets the class attributes ``name`` (the name used in ``log_with`` and
    ``Accelerator.get_tracker``) and ``requires_logging_directory`` (whether its constructor
    takes a ``logging_dir`` after the run name), defines the ``tracker`` property (the
    underlying object, e.g. a ``SummaryWriter``) and overrides ``store_init_configuration``,
    ``log`` and ``finish``. Expensive setup (opening files, connecting to a server) belongs
    in ``start()``, which the ``Accelerator`` calls after construction.

    ``main_process_only`` (default ``True``) tells the ``Accelerator`` to create and call the
    tracker on the main process only; set it to ``False`` for a tracker every process must
    talk to.

    The ``Accelerator`` constructs a tracker named in ``log_with`` (or passed as a class) as
    ``cls(project_name, logging_dir, **init_kwargs)`` when ``requires_logging_directory`` is
    true, else ``cls(project_name, **init_kwargs)``.

    Args:
        _blank: Build a do-nothing tracker without the checks (what
            ``Accelerator.get_tracker`` returns when no tracker has the requested name).

    Raises:
        NotImplementedError: the subclass does not define ``name``,
            ``requires_logging_directory`` or ``tracker``.
    """

    main_process_only: bool = True
    name: str
    requires_logging_directory: bool

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        cls = type(self)
        missing = [
            attr
            for attr in ("name", "requires_logging_directory", "tracker")
            if not hasattr(cls, attr)
        ]
        if missing:
            raise NotImplementedError(
                f"{cls.__name__} subclasses GeneralTracker but does not define "
                f"{', '.join(missing)}: set the class attributes `name` (str) and "
                "`requires_logging_directory` (bool) and define a `tracker` property "
                "returning the underlying tracking object"
            )

    def start(self) -> None:
        """Do the expensive setup (open files, connect); called once after construction."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters / configuration.

        Args:
            values: Configuration values, keyed by name.
        """

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record metrics for one step.

        Args:
            values: Metric values, keyed by name.
            step: The global step the values belong to.
            **kwargs: Tracker-specific options.
        """

    def finish(self) -> None:
        """Flush and close whatever the tracker holds; called by ``end_training``."""


class BlankTracker(GeneralTracker):
    """What ``Accelerator.get_tracker`` returns for a tracker that is not started here.

    On the processes other than the main one (or for a name not in ``log_with``) every
    method, including a tracker's own such as ``log_images`` or ``log_table``, does nothing
    and returns ``None``, so logging code runs unchanged on every process.
    """

    name = "blank"
    requires_logging_directory = False
    tracker = None

    def __init__(self, name: str = "blank") -> None:
        super().__init__(_blank=True)
        self.name = name

    def __getattr__(self, attribute: str) -> Callable[..., None]:
        if attribute.startswith("_"):
            raise AttributeError(attribute)

        def do_nothing(*args: Any, **kwargs: Any) -> None:
            return None

        return do_nothing


def install_command(extra: str) -> str:
    """The pip command that installs the library behind the tracker extra ``extra``."""
    return f'pip install "accel[{extra}]"'


def import_library(module: str, tracker: str, extra: str) -> ModuleType:
    """Import a tracker's library, or say exactly how to install it.

    Args:
        module: The library's import name (``"wandb"``).
        tracker: The tracker class, for the message (``"WandBTracker"``).
        extra: accel's extra that installs the library (``"wandb"``).

    Raises:
        ImportError: the library is not installed; the message gives the pip command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{tracker} (log_with={extra.replace('-', '_')!r}) needs the {module!r} package, "
            f"which is not installed: {install_command(extra)}"
        ) from error
