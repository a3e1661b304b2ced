"""``AimTracker``: runs in a local Aim repository (``pip install "accel[aim]"``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .base import GeneralTracker, import_library, on_main_process
from .values import check_step, check_values, image_array, jsonable, scalar

__all__ = ["AimTracker"]


def _aim() -> Any:
    return import_library("aim", "AimTracker", "aim")


class AimTracker(GeneralTracker):
    """Log to an Aim run in the repository at the logging directory.

    ``start()`` opens ``aim.Run(repo=logging_dir, **kwargs)`` (the repository is created on
    first use) and names the run after the project. ``aim up --repo <logging_dir>`` shows it.

    Aim indexes a run for its queries (``Repo.iter_runs``, the UI) in the background of
    ``aim up``; until then ``Repo.list_all_runs()`` lists it and ``Run(hash, repo=...)``
    opens it.

    Args:
        run_name: The run's name (``init_trackers``'s ``project_name``).
        logging_dir: The Aim repository (``repo=`` among the keyword arguments wins).
        **kwargs: Passed to ``aim.Run`` (``experiment``, ``run_hash``,
            ``system_tracking_interval``, ...).

    Raises:
        ImportError: aim is not installed (the message gives the pip command).
    """

    name = "aim"
    requires_logging_directory = True
    main_process_only = True

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] = ".", **kwargs: Any
    ) -> None:
        super().__init__()
        self._aim = _aim()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        # ``repo=`` in init_kwargs names the repository too (Aim's own argument name).
        self.aim_repo_path = os.fspath(self.init_kwargs.pop("repo", logging_dir))
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The ``aim.Run`` (``None`` before ``start()`` and after ``finish()``)."""
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Open the run in the repository."""
        os.makedirs(self.aim_repo_path, exist_ok=True)
        self.writer = self._aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Store ``values`` as the run's ``hparams``."""
        self.writer["hparams"] = {
            key: jsonable(value, repr(key))
            for key, value in check_values(values, "the configuration").items()
        }

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Track every value at ``step`` (``Run.track``; ``**kwargs`` go to it, e.g. ``context``).

        Raises:
            TypeError: a value is not a number, a string or an Aim object (nothing of this
                call is tracked then).
        """
        step = check_step(step)
        tracked: list[tuple[str, Any]] = []
        for key, value in check_values(values).items():
            number = scalar(value)
            if number is not None:
                tracked.append((key, number))
            elif isinstance(value, str) or type(value).__module__.startswith("aim"):
                tracked.append((key, self._aim.Text(value) if isinstance(value, str) else value))
            else:
                raise TypeError(
                    f"cannot log {key!r} ({type(value).__name__}) to Aim: log numbers, strings "
                    "or aim objects (images: tracker.log_images)"
                )
        for key, value in tracked:
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(
        self,
        values: dict[str, Any],
        step: int | None = None,
        kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Track images: per name, an image, an ``(image, caption)`` pair or a list of them.

        ``kwargs`` holds ``{"aim_image": {...}, "track": {...}}``: options of ``aim.Image``
        and of ``Run.track``, as in Accelerate.
        """
        step = check_step(step)
        image_kwargs = dict((kwargs or {}).get("aim_image", {}))
        track_kwargs = dict((kwargs or {}).get("track", {}))
        for key, value in check_values(values).items():
            entries: Sequence[Any] = value if isinstance(value, list) else [value]
            images = []
            for entry in entries:
                image, caption = entry if isinstance(entry, tuple) else (entry, "")
                images.append(self._aim.Image(image_array(image), caption=caption, **image_kwargs))
            tracked = images[0] if len(images) == 1 and not isinstance(value, list) else images
            self.writer.track(tracked, name=key, step=step, **track_kwargs)

    @on_main_process
    def finish(self) -> None:
        """Close the run."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
