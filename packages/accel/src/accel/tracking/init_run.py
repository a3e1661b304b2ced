"""The trackers whose library starts a run with ``init(project=...)``: wandb, SwanLab, Trackio."""

from __future__ import annotations

from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, jsonable, scalar

__all__ = ["InitRunTracker"]


class InitRunTracker(GeneralTracker):
    """A tracker over a library whose ``init(project=..., **kwargs)`` starts a run.

    The run has ``config.update(dict)``, ``log(values, step=...)`` and ``finish()``: wandb,
    SwanLab and Trackio. A subclass sets ``name`` and ``library`` (the import name; the extra
    of ``accel`` is the tracker's name with ``-`` for ``_``) and adds what its library does
    differently. The library is imported when the tracker is built (an ``ImportError`` with
    the pip command when it is missing); ``start()`` calls ``init(project=run_name,
    **kwargs)`` on the main process.

    Args:
        run_name: The project (``init_trackers``'s ``project_name``).
        **kwargs: Passed to the library's ``init``.
    """

    library: str
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._library = import_library(
            self.library, type(self).__name__, self.name.replace("_", "-")
        )
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The run (``None`` before ``start()`` and after ``finish()``)."""
        return self.run

    def _run(self) -> Any:
        if self.run is None:
            self.run = self._library.init(project=self.run_name, **self.init_kwargs)
        return self.run

    @on_main_process
    def start(self) -> None:
        """Start the run (the library's ``init``)."""
        self._run()

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config, as JSON values.

        Raises:
            TypeError: ``values`` is not a dict of names, or holds a value with no JSON form.
        """
        config = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }
        self._run().config.update(config)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step`` with ``run.log`` (``**kwargs`` go to it).

        Single numbers (tensors and numpy values included) become Python numbers; anything
        else (the library's own objects: images, tables) is passed as given.

        Raises:
            TypeError: ``values`` is not a dict of names or ``step`` is not an int.
        """
        step = check_step(step)
        converted: dict[str, Any] = {}
        for key, value in check_values(values).items():
            number = scalar(value)
            converted[key] = value if number is None else number
        self._run().log(converted, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run (a later call starts a new one)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
