"""``SwanLabTracker``: SwanLab experiments (``pip install "accel[swanlab]"``)."""

from __future__ import annotations

from typing import Any

from .base import on_main_process
from .init_run import InitRunTracker
from .values import check_values, image_array, image_list, jsonable, require_rows

__all__ = ["SwanLabTracker"]


class SwanLabTracker(InitRunTracker):
    """Log to a SwanLab experiment in the project named after the run.

    ``start()`` calls ``swanlab.init(project=run_name, **kwargs)``; without an account,
    ``init_kwargs={"swanlab": {"mode": "offline", "log_dir": ...}}`` keeps everything on disk
    (``swanlab sync`` uploads it later; ``mode="local"`` also needs ``swanlab[dashboard]``).
    Unlike Accelerate's, the tracker runs on the main process only: other ranks do not
    start experiments of their own.

    Args:
        run_name: The SwanLab project (``init_trackers``'s ``project_name``).
        **kwargs: Passed to ``swanlab.init`` (``mode``, ``log_dir``, ``name``, ``tags``, ...).

    Raises:
        ImportError: swanlab is not installed (the message gives the pip command).
    """

    name = "swanlab"
    library = "swanlab"

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images, each a ``swanlab.Image``.

        Args:
            values: Per name, a list of images (or one): numpy arrays, tensors, PIL images.
            step: The global step, or ``None``.
            **kwargs: Passed to ``run.log``.
        """
        images = {
            key: [self._library.Image(image_array(image)) for image in image_list(value)]
            for key, value in check_values(values).items()
        }
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
        """Log a table as SwanLab's ``swanlab.echarts.Table``.

        Args:
            table_name: The name the table is logged under.
            columns: The header; without it, the first row of ``data`` is the header.
            data: The rows.
            dataframe: A pandas DataFrame instead of ``columns`` and ``data``.
            step: The global step, or ``None``.
            **kwargs: Passed to ``run.log``.

        Raises:
            ValueError: no rows were given, or no header.
        """
        if dataframe is not None:
            columns = [str(column) for column in dataframe.columns]
            data = dataframe.values.tolist()
        require_rows(table_name, data, dataframe)
        rows = jsonable(data, table_name)
        if columns is None:
            if not rows:
                raise ValueError(
                    f"log_table({table_name!r}) got neither columns nor a header row in data"
                )
            columns, rows = rows[0], rows[1:]
        table = self._library.echarts.Table()
        table.add([str(column) for column in columns], rows)
        self.log({table_name: table}, step=step, **kwargs)
