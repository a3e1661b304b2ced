"""``TrackioTracker``: Trackio's local store (``pip install "accel[trackio]"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import on_main_process
from .init_run import InitRunTracker
from .values import check_values, image_array, require_rows

__all__ = ["TrackioTracker"]


class TrackioTracker(InitRunTracker):
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
    library = "trackio"

    @on_main_process
    def log_images(
        self, values: dict[str, Sequence[Any]], step: int | None = None, **kwargs: Any
    ) -> None:
        """Log images (numpy arrays, tensors or PIL images; one or a list per name)."""
        images: dict[str, Any] = {}
        for key, value in check_values(values).items():
            many = value if isinstance(value, (list, tuple)) else [value]
            converted = [self._library.Image(image_array(image)) for image in many]
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
        require_rows(table_name, data, dataframe)
        table = self._library.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)
