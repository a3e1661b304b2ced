"""Experiment trackers: the ``GeneralTracker`` interface and the trackers accel ships.

A tracker receives the run's configuration once (``store_init_configuration``) and metrics
at every logging step (``log``). The ``Accelerator`` builds the trackers named by its
``log_with`` argument (see :func:`filter_trackers`), calls ``start()`` on each, and forwards
``Accelerator.log`` to them on the main process.

Built-in trackers:

- ``"jsonl"`` (:class:`JSONLTracker`): no dependency; one JSON object per line in
  ``<logging_dir>/<run_name>/metrics.jsonl`` and the configuration in ``config.json``.
- ``"tensorboard"`` (:class:`TensorBoardTracker`): needs ``pip install "accel[tensorboard]"``.

Any other backend plugs in by subclassing :class:`GeneralTracker` and passing an instance (or
the class) in ``log_with``.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeAlias, TypeVar, cast

import torch

from accel_state import LoggerType, PartialState
from accel_state.imports import is_tensorboard_available
from accel_state.logging import get_logger

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

_F = TypeVar("_F", bound=Callable[..., Any])

_TENSORBOARD_INSTALL = 'pip install "accel[tensorboard]"'


def _warn(message: str) -> None:
    """Log a warning once per run: on the main process when a state exists, else plainly."""
    if PartialState._shared_state:
        get_logger(__name__).warning(message)
    else:
        logging.getLogger(__name__).warning(message)


def _is_main_process() -> bool:
    """Whether this process should do main-process-only work (True without a state)."""
    if not PartialState._shared_state:
        return True
    return bool(PartialState().is_main_process)


def on_main_process(method: _F) -> _F:
    """Make a tracker method a no-op on non-main processes when ``main_process_only`` is set.

    The check happens at each call (decorating ``__init__`` works: other ranks then build an
    empty tracker). Without an initialised ``PartialState`` the method always runs: a lone
    script is the main process.
    """

    @functools.wraps(method)
    def gated(self: GeneralTracker, *args: Any, **kwargs: Any) -> Any:
        if self.main_process_only and not _is_main_process():
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


# --- value conversion -----------------------------------------------------------------------

_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _finite_or_text(value: float) -> float | str:
    """JSON has no NaN or infinity: write them as the strings ``NaN``, ``Infinity``..."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return _NON_FINITE[value]
    return float(value)


def _is_numpy(value: Any) -> bool:
    return type(value).__module__.partition(".")[0] == "numpy" and hasattr(value, "tolist")


def _jsonable(value: Any, path: str) -> Any:
    """Convert ``value`` into plain JSON data (tensors and numpy values included).

    Raises:
        TypeError: something in ``value`` has no JSON form; the message names ``path``.
    """
    if value is None or isinstance(value, (bool, str)):
        # str.__str__ drops str subclasses (enums) to their plain text.
        return value if not isinstance(value, str) else str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _finite_or_text(value)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        return _jsonable(data.item() if data.ndim == 0 else data.tolist(), path)
    if _is_numpy(value):
        return _jsonable(value.item() if getattr(value, "ndim", 0) == 0 else value.tolist(), path)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"cannot log {path}: its key {key!r} is a {type(key).__name__}, and JSON "
                    "object keys must be strings"
                )
            out[key] = _jsonable(item, f"{path}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(
        f"cannot log {path}: a value of type {type(value).__qualname__} has no JSON form; log "
        "numbers, strings, booleans, None, tensors, numpy values, or lists/dicts of them "
        "(convert it, e.g. with str(), first)"
    )


def _jsonable_mapping(values: Any, what: str) -> dict[str, Any]:
    """Convert a mapping of named values; every key must be a string."""
    if not isinstance(values, Mapping):
        raise TypeError(f"{what} must be a dict of name -> value, got {type(values).__name__}")
    out: dict[str, Any] = {}
    for key, item in values.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{what} has the key {key!r} of type {type(key).__name__}: names must be strings"
            )
        out[key] = _jsonable(item, repr(key))
    return out


def _check_step(step: Any) -> int | None:
    """Accept ``None`` or an integer (Python, numpy or 0-d tensor) as the step."""
    if step is None:
        return None
    if isinstance(step, torch.Tensor) and step.ndim == 0 and not step.is_floating_point():
        return int(step.item())
    if _is_numpy(step) and getattr(step, "ndim", 1) == 0 and hasattr(step, "__index__"):
        return int(step)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    raise TypeError(f"step must be an int or None, got {step!r} ({type(step).__name__})")


def _check_no_kwargs(tracker: str, method: str, kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise TypeError(
            f"{tracker}.{method} got unexpected keyword arguments {sorted(kwargs)}: it takes none "
            "(they usually come from init_kwargs / log_kwargs keyed by the tracker's name)"
        )


# --- JSON lines -----------------------------------------------------------------------------


class JSONLTracker(GeneralTracker):
    """A dependency-free tracker writing JSON lines under ``<logging_dir>/<run_name>/``.

    Every ``log`` call appends one line to ``metrics.jsonl``::

        {"step": 3, "time": 1718000000.123, "loss": 0.25, "lr": 0.001}

    ``time`` is the Unix time of the call. Tensors and numpy values become numbers (0-d) or
    nested lists; JSON has no NaN or infinity, so non-finite floats are written as the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (every line is strict JSON). Each line is
    flushed as soon as it is written, so a crash loses no logged step; a resumed run appends
    to the same file. ``store_init_configuration`` writes ``config.json`` (sorted keys,
    indent 2) atomically: a reader sees the old file or the new one, never half of one.

    Args:
        run_name: The run's name (``Accelerator.init_trackers``'s ``project_name``); the
            files go in ``<logging_dir>/<run_name>/``.
        logging_dir: The directory holding the runs (the Accelerator's ``logging_dir``).
        **kwargs: Not accepted; present so every tracker has the same constructor shape.

    Raises:
        TypeError: a keyword argument was given.
        ValueError: ``run_name`` is empty or an absolute path.
    """

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    #: Keys every line carries; metrics with these names would be overwritten.
    RESERVED_KEYS = ("step", "time")

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        _check_no_kwargs("JSONLTracker", "__init__", kwargs)
        run_name = os.fspath(run_name)
        if not run_name or os.path.isabs(run_name):
            raise ValueError(
                f"run_name={run_name!r} must be a non-empty relative name: the tracker writes "
                "into <logging_dir>/<run_name>/"
            )
        self.run_name = run_name
        #: The run's own directory, ``<logging_dir>/<run_name>``.
        self.logging_dir = Path(logging_dir) / run_name
        self._file: IO[str] | None = None

    @property
    def metrics_path(self) -> Path:
        """Path of the metrics file, ``<logging_dir>/<run_name>/metrics.jsonl``."""
        return self.logging_dir / "metrics.jsonl"

    @property
    def config_path(self) -> Path:
        """Path of the configuration file, ``<logging_dir>/<run_name>/config.json``."""
        return self.logging_dir / "config.json"

    @property
    def tracker(self) -> IO[str] | None:
        """The open metrics file.

        ``None`` before ``start()`` (or the first ``log``) and after ``finish()``.
        """
        return self._file

    def _open(self) -> IO[str]:
        if self._file is None or self._file.closed:
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        return self._file

    @on_main_process
    def start(self) -> None:
        """Create the run directory and open ``metrics.jsonl`` for appending."""
        self._open()

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Write ``values`` to ``config.json``, replacing any previous configuration.

        Args:
            values: The configuration; tensors and numpy values are converted, non-finite
                floats written as strings, path-like values as strings.

        Raises:
            TypeError: a value has no JSON form (the message names its key and type); the
                existing ``config.json`` is left untouched.
        """
        config = _jsonable_mapping(values, "the configuration")
        text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False, ensure_ascii=False)
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.logging_dir / f".config.json.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.config_path)
        finally:
            if temporary.exists():
                temporary.unlink()

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Append one line ``{"step": step, "time": <unix time>, **values}`` and flush it.

        Args:
            values: Metrics keyed by name: numbers, strings, booleans, None, tensors, numpy
                values, or lists/dicts of them.
            step: The global step, or ``None``.
            **kwargs: Not accepted.

        Raises:
            TypeError: a value has no JSON form (the message names its key and type), a key
                is not a string, ``step`` is not an int, or a keyword argument was given.
                Nothing is written then.
            ValueError: a metric is named ``step`` or ``time``.
        """
        _check_no_kwargs("JSONLTracker", "log", kwargs)
        step = _check_step(step)
        metrics = _jsonable_mapping(values, "values")
        clashes = [key for key in self.RESERVED_KEYS if key in metrics]
        if clashes:
            raise ValueError(
                f"cannot log the metric(s) {clashes}: JSONLTracker uses the keys 'step' and "
                "'time' on every line; rename them (e.g. 'train/time')"
            )
        line = json.dumps(
            {"step": step, "time": time.time(), **metrics}, allow_nan=False, ensure_ascii=False
        )
        handle = self._open()
        handle.write(line + "\n")
        handle.flush()

    @on_main_process
    def finish(self) -> None:
        """Close ``metrics.jsonl`` (a later ``log`` reopens it for appending)."""
        if self._file is not None:
            self._file.close()
            self._file = None


# --- TensorBoard ----------------------------------------------------------------------------


def _import_summary_writer() -> type:
    """Return TensorBoard's ``SummaryWriter`` (torch's, else tensorboardX's).

    Raises:
        ImportError: neither is installed; the message gives the pip command.
    """
    try:
        module = importlib.import_module("torch.utils.tensorboard")
    except ImportError as torch_error:
        try:
            module = importlib.import_module("tensorboardX")
        except ImportError:
            raise ImportError(
                "TensorBoardTracker (log_with='tensorboard') needs TensorBoard, which is not "
                f"installed: {_TENSORBOARD_INSTALL}"
            ) from torch_error
    return cast(type, module.SummaryWriter)


def _scalar(value: Any) -> int | float | None:
    """The Python number behind ``value``, or ``None`` if it is not a single real number."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return cast(float, value.detach().cpu().item())
    if _is_numpy(value) and getattr(value, "size", 0) == 1:
        item = value.item()
        return item if isinstance(item, (bool, int, float)) else None
    return None


def _flatten_hparams(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a configuration into what TensorBoard's hparams plugin accepts.

    Nested dicts become ``a/b`` names (``{"opt": {"lr": 1}}`` -> ``{"opt/lr": 1}``); numbers,
    strings and booleans are kept, anything else goes through ``str()``.
    """
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten_hparams(value, f"{name}/"))
        elif isinstance(value, (bool, str)):
            flat[name] = value
        elif (number := _scalar(value)) is not None:
            flat[name] = number
        else:
            flat[name] = str(value)
    return flat


class TensorBoardTracker(GeneralTracker):
    """Log to TensorBoard event files in ``<logging_dir>/<run_name>/``.

    Needs TensorBoard: ``pip install "accel[tensorboard]"``. The writer is
    ``torch.utils.tensorboard.SummaryWriter`` (tensorboardX's when only that is installed),
    created by ``start()`` (or by the first call that needs it).

    ``log`` sends numbers (and one-element tensors / numpy values) to ``add_scalar``, strings
    to ``add_text`` and dicts of numbers to ``add_scalars``; ``**kwargs`` go to those calls.
    ``store_init_configuration`` records the configuration with ``add_hparams`` (nested dicts
    flattened to ``a/b`` names, unsupported values as ``str()``).

    Args:
        run_name: The run's name (``Accelerator.init_trackers``'s ``project_name``).
        logging_dir: The directory holding the runs (the Accelerator's ``logging_dir``).
        **kwargs: Passed to ``SummaryWriter`` (e.g. ``flush_secs``).

    Raises:
        ImportError: TensorBoard is not installed.
    """

    name = "tensorboard"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self._writer_class = _import_summary_writer()
        self.run_name = run_name
        #: The run's own directory, ``<logging_dir>/<run_name>``, where events are written.
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = dict(kwargs)
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter`` (``None`` before ``start()`` and after ``finish()``)."""
        return self.writer

    def _writer(self) -> Any:
        if self.writer is None:
            self.writer = self._writer_class(self.logging_dir, **self.init_kwargs)
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Create the ``SummaryWriter``."""
        self._writer()

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as TensorBoard hyperparameters.

        Args:
            values: The configuration, keyed by name.

        Raises:
            TypeError: ``values`` is not a dict.
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"the configuration must be a dict of name -> value, got {type(values).__name__}"
            )
        writer = self._writer()
        writer.add_hparams(_flatten_hparams(values), metric_dict={})
        writer.flush()

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write ``values`` at ``step``.

        Args:
            values: Numbers (or one-element tensors / numpy values), strings, or dicts of
                numbers (plotted together with ``add_scalars``).
            step: The global step, or ``None``.
            **kwargs: Passed to ``add_scalar`` / ``add_text`` / ``add_scalars``.

        Raises:
            TypeError: a value is of another type (the message names its key and type);
                nothing is written then.
        """
        step = _check_step(step)
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a dict of name -> value, got {type(values).__name__}")
        calls: list[tuple[str, str, Any]] = []
        for key, value in values.items():
            if isinstance(value, str):
                calls.append(("add_text", key, value))
            elif (number := _scalar(value)) is not None:
                calls.append(("add_scalar", key, number))
            elif isinstance(value, Mapping):
                group: dict[str, Any] = {}
                for sub_key, sub_value in value.items():
                    sub_number = _scalar(sub_value)
                    if sub_number is None:
                        raise TypeError(
                            f"cannot log {key!r}[{sub_key!r}] to TensorBoard: add_scalars "
                            f"takes numbers, got {type(sub_value).__qualname__}"
                        )
                    group[str(sub_key)] = sub_number
                calls.append(("add_scalars", key, group))
            else:
                raise TypeError(
                    f"cannot log {key!r} to TensorBoard: a value of type "
                    f"{type(value).__qualname__} is not a number, one-element tensor, string "
                    "or dict of numbers"
                )
        writer = self._writer()
        for method, key, value in calls:
            getattr(writer, method)(key, value, global_step=step, **kwargs)
        writer.flush()

    @on_main_process
    def finish(self) -> None:
        """Flush and close the ``SummaryWriter``."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# --- selection ------------------------------------------------------------------------------

#: The trackers ``log_with`` can name: the built-in ones, then those given to
#: :func:`register_tracker_class`.
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "jsonl": JSONLTracker,
    "tensorboard": TensorBoardTracker,
}

_AVAILABILITY: dict[str, Callable[[], bool]] = {
    "jsonl": lambda: True,
    "tensorboard": is_tensorboard_available,
}

_INSTALL_HINTS: dict[str, str] = {"tensorboard": _TENSORBOARD_INSTALL}


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
    _AVAILABILITY.setdefault(name, lambda: True)


def _not_shipped(class_name: str, tracker_name: str, library: str) -> type[GeneralTracker]:
    """A tracker of Accelerate's that accel does not ship yet: importable, refusing to build."""

    def __init__(self: GeneralTracker, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{class_name}: accel does not ship the {library} tracker yet. Wrap {library} in a "
            "GeneralTracker subclass (see register_tracker_class), or log with 'jsonl' or "
            "'tensorboard'"
        )

    namespace = {
        "__init__": __init__,
        "name": tracker_name,
        "requires_logging_directory": False,
        "tracker": None,
        "__doc__": f"Accelerate's {library} tracker: not shipped by accel yet (building raises).",
    }
    return cast(type[GeneralTracker], type(class_name, (GeneralTracker,), namespace))


WandBTracker = _not_shipped("WandBTracker", "wandb", "Weights & Biases")
CometMLTracker = _not_shipped("CometMLTracker", "comet_ml", "Comet")
AimTracker = _not_shipped("AimTracker", "aim", "Aim")
MLflowTracker = _not_shipped("MLflowTracker", "mlflow", "MLflow")
ClearMLTracker = _not_shipped("ClearMLTracker", "clearml", "ClearML")
DVCLiveTracker = _not_shipped("DVCLiveTracker", "dvclive", "DVCLive")
SwanLabTracker = _not_shipped("SwanLabTracker", "swanlab", "SwanLab")
TrackioTracker = _not_shipped("TrackioTracker", "trackio", "Trackio")


def get_available_trackers() -> list[str]:
    """Names of the trackers whose dependencies are installed (``"jsonl"`` always)."""
    return [name for name in LOGGER_TYPE_TO_CLASS if _AVAILABILITY.get(name, lambda: True)()]


#: What ``filter_trackers`` returns per tracker: a built-in name, a class, or an instance.
_TrackerSpec: TypeAlias = "str | GeneralTracker | type[GeneralTracker]"


def _is_tracker_class(item: Any) -> bool:
    return isinstance(item, type) and issubclass(item, GeneralTracker)


def _require_directory(label: str, logging_dir: Any) -> None:
    if logging_dir is None:
        raise ValueError(
            f"log_with includes {label}, which writes files and needs a logging directory, but "
            "none was given: pass project_dir=... to Accelerator (or "
            "project_config=ProjectConfiguration(project_dir=..., logging_dir=...)), or "
            "logging_dir=... to filter_trackers"
        )


def filter_trackers(
    log_with: _TrackerSpec | Sequence[_TrackerSpec] | None,
    logging_dir: str | os.PathLike[str] | None = None,
) -> list[_TrackerSpec]:
    """Resolve ``log_with`` into the trackers to use, as the ``Accelerator`` does.

    Args:
        log_with: ``"all"`` (every built-in tracker whose dependencies are installed), a
            tracker name (``"jsonl"``, ``"tensorboard"``, or a ``LoggerType``), a
            ``GeneralTracker`` instance or subclass, or a list of these; ``None`` for none.
        logging_dir: Where file-writing trackers put their runs.

    Returns:
        In order and without duplicates: built-in tracker names as plain strings (equal to
        their ``LoggerType`` members), custom tracker classes (still to be constructed) and
        custom tracker instances (used as given). A built-in tracker whose dependency is
        missing is left out with a warning.

    Raises:
        ValueError: an entry is not a known tracker name, ``GeneralTracker`` or subclass (the
            message lists the choices), names an Accelerate tracker accel does not ship, or
            a tracker needing a logging directory is requested without ``logging_dir``.
    """
    if log_with is None:
        return []
    if isinstance(log_with, (str, GeneralTracker)) or _is_tracker_class(log_with):
        entries: list[Any] = [log_with]
    elif isinstance(log_with, Sequence):
        entries = list(log_with)
    else:
        entries = [log_with]

    chosen: list[_TrackerSpec] = []

    def add_builtin(name: str, explicit: bool) -> None:
        if name in chosen:
            return
        if not _AVAILABILITY.get(name, lambda: True)():
            hint = _INSTALL_HINTS.get(name)
            _warn(
                f"Tracker {name!r} was requested in log_with but its dependencies are not "
                "installed, so it is left out" + (f"; to use it: {hint}" if hint else "")
            )
            return
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory:
            _require_directory(f"{name!r}" if explicit else f"'all' (hence {name!r})", logging_dir)
        chosen.append(name)

    for entry in entries:
        if isinstance(entry, GeneralTracker):
            if not any(entry is existing for existing in chosen):
                chosen.append(entry)
        elif _is_tracker_class(entry):
            if getattr(entry, "requires_logging_directory", False):
                _require_directory(entry.__name__, logging_dir)
            if entry not in chosen:
                chosen.append(entry)
        elif isinstance(entry, str):
            name = str(entry).lower()
            if name == LoggerType.ALL:
                for builtin in get_available_trackers():
                    add_builtin(builtin, explicit=False)
            elif name in LOGGER_TYPE_TO_CLASS:
                add_builtin(name, explicit=True)
            elif name in LoggerType:
                raise ValueError(
                    f"log_with={entry!r} names an Accelerate tracker that accel does not ship: "
                    f"use one of {', '.join(repr(n) for n in _choices())}, or wrap the library "
                    "in a GeneralTracker subclass and pass it (or an instance) in log_with"
                )
            else:
                raise ValueError(_unknown_message(entry))
        else:
            raise ValueError(_unknown_message(entry))
    return chosen


def _choices() -> list[str]:
    return [str(LoggerType.ALL), *LOGGER_TYPE_TO_CLASS]


def _unknown_message(entry: Any) -> str:
    return (
        f"log_with contains {entry!r} ({type(entry).__name__}), which is not a tracker: use one "
        f"of {', '.join(repr(n) for n in _choices())}, a GeneralTracker subclass, or an "
        "instance of one"
    )


def _make_trackers(
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
            _require_directory(repr(cls.name), logging_dir)
            built.append(factory(project_name, logging_dir, **kwargs))
        else:
            built.append(factory(project_name, **kwargs))
    return built
