"""``TrackioTracker``: Trackio's local store (``pip install "accel[trackio]"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, image_array, jsonable, scalar

__all__ = ["TrackioTracker"]


def _trackio() -> Any:
    return import_library("trackio", "TrackioTracker", "trackio")


class TrackioTracker(GeneralTracker):
    """Log to a Trackio run in the project named after the run.

    ``start()`` calls ``trackio.init(project=run_name, **kwargs)``. Trackio keeps its runs in
    a local SQLite store (``TRACKIO_DIR``); ``space_id=`` syncs them to a Hugging Face Space.
    Unlike Accelerate's, the tracker runs on the main process only: other ranks do not
    start runs of their own.

    Args:
        run_name: The Trackio project (``init_trackers``'s ``project_name``).
        **kwargs: Passed to ``trackio.init`` (``name``, ``config``, ``space_id``, ...).

    Raises:
        ImportError: trackio is not installed (the message gives the pip command).
    """

    name = "trackio"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._trackio = _trackio()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The Trackio run (``None`` before ``start()`` and after ``finish()``)."""
        return self.run

    @on_main_process
    def start(self) -> None:
        """Start the run (``trackio.init``)."""
        self.run = self._trackio.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config."""
        config = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }
        self.run.config.update(config)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step`` (``run.log``): numbers, and Trackio objects as given."""
        step = check_step(step)
        converted: dict[str, Any] = {}
        for key, value in check_values(values).items():
            number = scalar(value)
            converted[key] = value if number is None else number
        self.run.log(converted, step=step, **kwargs)

    @on_main_process
    def log_images(
        self, values: dict[str, Sequence[Any]], step: int | None = None, **kwargs: Any
    ) -> None:
        """Log images (numpy arrays, tensors or PIL images; one or a list per name)."""
        images: dict[str, Any] = {}
        for key, value in check_values(values).items():
            many = value if isinstance(value, (list, tuple)) else [value]
            converted = [self._trackio.Image(image_array(image)) for image in many]
            images[key] = converted[0] if len(converted) == 1 else converted
        self.log(images, step=step, **kwargs)

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
        """Log a ``trackio.Table`` from ``columns`` + ``data`` rows, or a ``dataframe``."""
        if data is None and dataframe is None:
            raise ValueError(
                f"log_table({table_name!r}) needs rows: pass data=[[...], ...] (with columns=...) "
                "or dataframe=..."
            )
        table = self._trackio.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
            self.run = None
