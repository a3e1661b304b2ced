"""``CometMLTracker``: Comet experiments (``pip install "accel[comet-ml]"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import GeneralTracker, import_library, install_command, on_main_process
from .values import check_step, check_values, image_list, jsonable, pil_image, require_rows, scalar

__all__ = ["CometMLTracker"]

_INSTALL = install_command("comet-ml")


def _comet_ml() -> Any:
    return import_library("comet_ml", "CometMLTracker", "comet-ml")


class CometMLTracker(GeneralTracker):
    """Log to a Comet experiment in the project named after the run.

    ``start()`` calls ``comet_ml.start(project_name=run_name, **kwargs)``; the API key comes
    from Comet's configuration (``COMET_API_KEY`` or ``~/.comet.config``). Offline, nothing
    is sent: ``init_kwargs={"comet_ml": {"online": False}}`` (with
    ``experiment_config=comet_ml.ExperimentConfig(offline_directory=...)``) writes a zip to
    upload later with ``comet upload``.

    Args:
        run_name: The Comet project (``init_trackers``'s ``project_name``).
        **kwargs: Passed to ``comet_ml.start`` (``online``, ``workspace``, ``experiment_key``,
            ``experiment_config``, ...).

    Raises:
        ImportError: comet_ml is not installed (the message gives the pip command).
    """

    name = "comet_ml"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._comet = _comet_ml()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The Comet ``Experiment`` (``None`` before ``start()`` and after ``finish()``)."""
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Start (or resume) the experiment with ``comet_ml.start``."""
        self.writer = self._comet.start(project_name=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as the experiment's parameters (nested dicts are flattened)."""
        config = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }
        self.writer.log_parameters(config)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step``, as Accelerate does.

        Numbers (one-element tensors and numpy values included) go to ``log_metric``, strings
        to ``log_other``, dicts of numbers to ``log_metrics`` (their own names, no prefix);
        ``**kwargs`` go to ``log_metric`` / ``log_other`` / ``log_metrics``.

        Raises:
            TypeError: a value is none of these (nothing of this call is logged then).
        """
        step = check_step(step)
        calls: list[tuple[str, str, Any]] = []
        for key, value in check_values(values).items():
            if isinstance(value, str):
                calls.append(("log_other", key, value))
            elif (number := scalar(value)) is not None:
                calls.append(("log_metric", key, number))
            elif isinstance(value, Mapping):
                group = {str(name): scalar(item) for name, item in value.items()}
                if any(item is None for item in group.values()):
                    raise TypeError(f"cannot log {key!r} to Comet: its dict must hold numbers")
                calls.append(("log_metrics", key, group))
            else:
                raise TypeError(
                    f"cannot log {key!r} ({type(value).__name__}) to Comet: log numbers, "
                    "strings or dicts of numbers (images: tracker.log_images)"
                )
        if step is not None:
            self.writer.set_step(step)
        for method, key, value in calls:
            if method == "log_other":
                self.writer.log_other(key, value, **kwargs)
            elif method == "log_metric":
                self.writer.log_metric(key, value, step=step, **kwargs)
            else:
                self.writer.log_metrics(value, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images with ``Experiment.log_image(image, name=name, step=step)``.

        Arrays and tensors are turned into PIL images first (Comet's own conversion of arrays
        needs matplotlib, and drops the image with only a log line when it is missing).

        Args:
            values: Per name, a list of images (or one): numpy arrays, tensors, PIL images.
            step: The global step, or ``None``.
            **kwargs: Passed to ``log_image`` (e.g. ``image_format``).

        Raises:
            ImportError: Pillow is not installed.
            ValueError: an array is not an image.
            RuntimeError: Comet did not take an image (its own error is logged above).
        """
        step = check_step(step)
        converted = [
            (key, pil_image(image, key, _INSTALL))
            for key, images in check_values(values).items()
            for image in image_list(images)
        ]
        for key, image in converted:
            if self.writer.log_image(image, name=key, step=step, **kwargs) is None:
                raise RuntimeError(
                    f"Comet did not log the image {key!r} (see its COMET ERROR message above)"
                )

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a table as the CSV asset ``<table_name>.csv`` (``Experiment.log_table``).

        Args:
            table_name: The asset's name (``.csv`` is added when missing).
            columns: The header row (none when ``None``).
            data: The rows.
            dataframe: A pandas DataFrame instead of ``columns`` and ``data``.
            step: The global step, or ``None``.
            **kwargs: Passed to ``Experiment.log_table``.

        Raises:
            ValueError: neither ``data`` nor ``dataframe`` was given.
        """
        require_rows(table_name, data, dataframe)
        step = check_step(step)
        if step is not None:
            self.writer.set_step(step)
        filename = table_name if table_name.endswith(".csv") else f"{table_name}.csv"
        if dataframe is not None:
            self.writer.log_table(filename, tabular_data=dataframe, **kwargs)
        else:
            self.writer.log_table(
                filename,
                tabular_data=jsonable(data, table_name),
                headers=list(columns) if columns else False,
                **kwargs,
            )

    @on_main_process
    def finish(self) -> None:
        """End the experiment (offline: write its archive)."""
        if self.writer is not None:
            self.writer.end()
            self.writer = None
