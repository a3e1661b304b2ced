"""``SwanLabTracker``: SwanLab experiments (``pip install "accel[swanlab]"``)."""

from __future__ import annotations

from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, image_array, image_list, jsonable, scalar

__all__ = ["SwanLabTracker"]


def _swanlab() -> Any:
    return import_library("swanlab", "SwanLabTracker", "swanlab")


class SwanLabTracker(GeneralTracker):
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
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._swanlab = _swanlab()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The SwanLab run (``None`` before ``start()`` and after ``finish()``)."""
        return self.run

    @on_main_process
    def start(self) -> None:
        """Start the experiment (``swanlab.init``)."""
        self.run = self._swanlab.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the experiment's config (a value set again replaces the old one)."""
        config = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }
        self.run.config.update(config)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step`` (``run.log``): numbers, and SwanLab objects as given."""
        step = check_step(step)
        converted: dict[str, Any] = {}
        for key, value in check_values(values).items():
            number = scalar(value)
            converted[key] = value if number is None else number
        self.run.log(converted, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images, each a ``swanlab.Image``.

        Args:
            values: Per name, a list of images (or one): numpy arrays, tensors, PIL images.
            step: The global step, or ``None``.
            **kwargs: Passed to ``run.log``.
        """
        images = {
            key: [self._swanlab.Image(image_array(image)) for image in image_list(value)]
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
        if data is None:
            raise ValueError(
                f"log_table({table_name!r}) needs rows: pass data=[[...], ...] (with columns=...) "
                "or dataframe=..."
            )
        rows = jsonable(data, table_name)
        if columns is None:
            if not rows:
                raise ValueError(
                    f"log_table({table_name!r}) got neither columns nor a header row in data"
                )
            columns, rows = rows[0], rows[1:]
        table = self._swanlab.echarts.Table()
        table.add([str(column) for column in columns], rows)
        self.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the experiment."""
        if self.run is not None:
            self.run.finish()
            self.run = None
