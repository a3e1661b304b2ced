"""``DVCLiveTracker``: DVCLive's files in a folder (``pip install "accel[dvclive]"``)."""

from __future__ import annotations

from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import (
    check_no_kwargs,
    check_step,
    check_values,
    image_array,
    image_list,
    jsonable,
    numbers_only,
)

__all__ = ["DVCLiveTracker"]


def _dvclive() -> Any:
    return import_library("dvclive", "DVCLiveTracker", "dvclive")


class DVCLiveTracker(GeneralTracker):
    """Log with ``dvclive.Live``: ``params.yaml``, ``metrics.json`` and ``plots/`` in its folder.

    Args:
        run_name: Not used by DVCLive (as in Accelerate); name the folder with ``dir=``.
        live: A ``dvclive.Live`` to use instead of creating one.
        **kwargs: Passed to ``dvclive.Live`` (``dir``, ``save_dvc_exp``, ``report``, ...).

    Raises:
        ImportError: dvclive is not installed (the message gives the pip command).
    """

    name = "dvclive"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self._dvclive = _dvclive()
        self.run_name = run_name
        self.live = live
        self.init_kwargs = dict(kwargs)
        self._skipped: set[str] = set()

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live`` (``None`` before ``start()``)."""
        return self.live

    @on_main_process
    def start(self) -> None:
        """Create the ``Live`` (unless one was given)."""
        if self.live is None:
            self.live = self._dvclive.Live(**self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Write ``values`` into ``params.yaml`` (``Live.log_params``)."""
        self.live.log_params(
            {
                key: jsonable(value, repr(key))
                for key, value in check_values(values, "the configuration").items()
            }
        )

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step`` (the next step when ``None``) with ``Live.log_metric``.

        DVCLive's metrics are numbers (one-element tensors and numpy values included) and
        strings: any other value is left out, with a warning naming its key the first time,
        as in Accelerate. Each call ends the step (``Live.next_step``).

        Args:
            values: The metrics, keyed by name.
            step: The global step, or ``None``.
            **kwargs: Passed to ``Live.log_metric`` (``timestamp``, ``plot``).
        """
        step = check_step(step)
        numbers = numbers_only(
            check_values(values),
            "DVCLiveTracker",
            self._skipped,
            "save other data with tracker.tracker.log_artifact",
            strings=True,
        )
        if step is not None:
            self.live.step = step
        for key, value in numbers.items():
            self.live.log_metric(key, value, **kwargs)
        self.live.next_step()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Save images with ``Live.log_image`` under ``<dir>/plots/images``.

        One image per name is saved as ``<name>.png``, several as ``<name>_<i>.png`` (a name
        with an image extension keeps it). DVCLive keeps one file per name: a later step
        replaces it.

        Args:
            values: Per name, a list of images (or one): numpy arrays, tensors, PIL images.
            step: Not used by DVCLive's images (its step is the metrics').
            **kwargs: Not used (``Live.log_image`` takes none).
        """
        check_step(step)
        check_no_kwargs("DVCLiveTracker", "log_images", kwargs)
        for key, images in check_values(values).items():
            many = image_list(images)
            for index, image in enumerate(many):
                base, dot, extension = key.rpartition(".")
                stem, suffix = (base, f".{extension}") if dot else (key, ".png")
                filename = f"{stem}{suffix}" if len(many) == 1 else f"{stem}_{index}{suffix}"
                self.live.log_image(filename, image_array(image))

    @on_main_process
    def finish(self) -> None:
        """End the ``Live`` (writes the summary and, if asked, the DVC experiment)."""
        if self.live is not None:
            self.live.end()
