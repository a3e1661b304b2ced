"""``ClearMLTracker``: ClearML tasks (``pip install "accel[clearml]"``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, image_array, jsonable, numbers_only, require_rows

__all__ = ["ClearMLTracker"]

_SERIES_PREFIXES = ("eval", "test", "train")


def _clearml() -> Any:
    return import_library("clearml", "ClearMLTracker", "clearml")


def title_series(name: str) -> tuple[str, str]:
    """ClearML's (title, series) of a logged name: ``"eval_loss"`` -> ``("loss", "eval")``.

    A name starting with ``eval_``, ``test_`` or ``train_`` goes to that series without the
    prefix; any other name goes to the ``train`` series whole (as in Accelerate).
    """
    for prefix in _SERIES_PREFIXES:
        if name.startswith(f"{prefix}_"):
            return name[len(prefix) + 1 :], prefix
    return name, "train"


class ClearMLTracker(GeneralTracker):
    """Log to a ClearML task (the one already running, or a new one).

    ``start()`` reuses ``Task.current_task()`` when the script created one (``finish`` then
    leaves it open), else calls ``Task.init(project_name=..., task_name=..., **kwargs)``;
    ``CLEARML_PROJECT`` and ``CLEARML_TASK`` override the run name. Offline
    (``CLEARML_OFFLINE_MODE=1`` or ``Task.set_offline(True)``), the task is written to a
    session folder for ``clearml-task --import-offline-session`` later.

    Args:
        run_name: Project and task name (``init_trackers``'s ``project_name``).
        **kwargs: Passed to ``Task.init`` (``project_name``/``task_name`` win over the run
            name, then ``tags``, ``reuse_last_task_id``, ...).

    Raises:
        ImportError: clearml is not installed (the message gives the pip command).
    """

    name = "clearml"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._clearml = _clearml()
        self.user_provided_run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.task: Any = None
        self._initialized_externally = False
        self._skipped: set[str] = set()

    @property
    def tracker(self) -> Any:
        """The ClearML ``Task`` (``None`` before ``start()`` and after ``finish()``)."""
        return self.task

    @on_main_process
    def start(self) -> None:
        """Reuse the running task or create one."""
        Task = self._clearml.Task
        current = Task.current_task()
        if current is not None:
            self.task, self._initialized_externally = current, True
            return
        arguments = dict(self.init_kwargs)
        arguments.setdefault(
            "project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name)
        )
        name = self.user_provided_run_name
        arguments.setdefault("task_name", os.environ.get("CLEARML_TASK", name))
        self.task = Task.init(**arguments)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> Any:
        """Connect ``values`` to the task as its configuration (``Task.connect_configuration``)."""
        config = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }
        return self.task.connect_configuration(config)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report the numbers in ``values``: scalars at ``step``, single values without one.

        Names are split into title and series as :func:`title_series` says. ClearML scalars
        are numbers: any other value is left out, with a warning naming its key the first time.
        """
        step = check_step(step)
        logger = self.task.get_logger()
        numbers = numbers_only(
            check_values(values),
            "ClearMLTracker",
            self._skipped,
            "report text with task.get_logger().report_text",
        )
        for key, value in numbers.items():
            if step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = title_series(key)
                logger.report_scalar(
                    title=title, series=series, value=value, iteration=step, **kwargs
                )

    @on_main_process
    def log_images(
        self, values: dict[str, Sequence[Any]], step: int | None = None, **kwargs: Any
    ) -> None:
        """Report images (numpy arrays, tensors or PIL images; one or a list per name)."""
        step = check_step(step)
        logger = self.task.get_logger()
        for key, images in check_values(values).items():
            title, series = title_series(key)
            many = images if isinstance(images, (list, tuple)) else [images]
            for index, image in enumerate(many):
                label = series if len(many) == 1 else f"{series}_{index}"
                array = image_array(image)
                logger.report_image(
                    title=title, series=label, iteration=step or 0, image=array, **kwargs
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
        """Report a table: ``columns`` + ``data`` rows, or a ``dataframe``.

        Without ``columns``, the first row of ``data`` is the header (as in Accelerate).
        """
        step = check_step(step)
        if dataframe is None:
            require_rows(table_name, data, dataframe)
            rows = jsonable(data, table_name)
            table: Any = [list(columns), *rows] if columns else rows
        else:
            table = dataframe
        title, series = title_series(table_name)
        self.task.get_logger().report_table(
            title=title, series=series, iteration=step or 0, table_plot=table, **kwargs
        )

    @on_main_process
    def finish(self) -> None:
        """Close the task, unless the script created it (then it stays the script's)."""
        if self.task is not None and not self._initialized_externally:
            self.task.close()
        self.task = None
