"""The local-file trackers: ``JSONLTracker`` (no dependency) and ``TensorBoardTracker``."""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

from accel_state.files import atomic_write

from .base import GeneralTracker, install_command, on_main_process
from .values import (
    check_no_kwargs,
    check_step,
    check_values,
    flatten_config,
    image_array,
    jsonable_mapping,
    scalar,
)

__all__ = ["JSONLTracker", "TensorBoardTracker"]

_TENSORBOARD_INSTALL = install_command("tensorboard")


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
        check_no_kwargs("JSONLTracker", "__init__", kwargs)
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
        config = jsonable_mapping(values, "the configuration")
        text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False, ensure_ascii=False)
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.config_path, text + "\n")

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
        check_no_kwargs("JSONLTracker", "log", kwargs)
        step = check_step(step)
        metrics = jsonable_mapping(values, "values")
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
        """Record ``values`` as TensorBoard hyperparameters and in a ``hparams.yml``.

        ``add_hparams`` receives the configuration flattened (nested dicts as ``a/b`` names,
        unsupported values as ``str()``); ``<logging_dir>/<run_name>/<unix time>/hparams.yml``
        receives it as it is (tensors and numpy values as numbers or lists), as Accelerate
        writes it.

        Args:
            values: The configuration, keyed by name.

        Raises:
            TypeError: ``values`` is not a dict, or a value has no JSON/YAML form (nothing
                is written then).
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"the configuration must be a dict of name -> value, got {type(values).__name__}"
            )
        config = jsonable_mapping(values, "the configuration")
        writer = self._writer()
        writer.add_hparams(flatten_config(values), metric_dict={})
        writer.flush()
        # As Accelerate: the configuration also goes to <run dir>/<unix time>/hparams.yml.
        import yaml

        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(config, handle)

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
        step = check_step(step)
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a dict of name -> value, got {type(values).__name__}")
        calls: list[tuple[str, str, Any]] = []
        for key, value in values.items():
            if isinstance(value, str):
                calls.append(("add_text", key, value))
            elif (number := scalar(value)) is not None:
                calls.append(("add_scalar", key, number))
            elif isinstance(value, Mapping):
                group: dict[str, Any] = {}
                for sub_key, sub_value in value.items():
                    sub_number = scalar(sub_value)
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
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write images with ``SummaryWriter.add_images``.

        Args:
            values: Per name, a list of images (numpy arrays or tensors, ``H, W, C``, ``H, W``
                or channels-first ``C, H, W``; PIL images), stacked into one ``N, H, W, C``
                batch; or, as in Accelerate, one array/tensor batch in ``add_images``'
                ``dataformats`` (``NCHW`` unless ``dataformats=`` says otherwise), passed
                as it is.
            step: The global step, or ``None``.
            **kwargs: Passed to ``add_images`` (``dataformats``, ``walltime``).

        Raises:
            ValueError: the images of one name differ in shape.
        """
        step = check_step(step)
        batches: list[tuple[str, Any, dict[str, Any]]] = []
        for key, value in check_values(values).items():
            if not isinstance(value, (list, tuple)):
                batches.append((key, value, kwargs))
                continue
            import numpy as np

            arrays = [np.asarray(image_array(image)) for image in value]
            arrays = [array[..., None] if array.ndim == 2 else array for array in arrays]
            if len({array.shape for array in arrays}) > 1:
                raise ValueError(
                    f"cannot log the images {key!r} to TensorBoard: their shapes differ "
                    f"({sorted({array.shape for array in arrays})}); log them under "
                    "separate names"
                )
            batches.append((key, np.stack(arrays), {"dataformats": "NHWC", **kwargs}))
        writer = self._writer()
        for key, batch, options in batches:
            writer.add_images(key, batch, global_step=step, **options)
        writer.flush()

    @on_main_process
    def finish(self) -> None:
        """Flush and close the ``SummaryWriter``."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
