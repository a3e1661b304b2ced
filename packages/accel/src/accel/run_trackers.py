"""The ``Accelerator``'s tracker methods: start the trackers of ``log_with``, log to them.

:class:`RunTrackers` builds the trackers (see :mod:`accel.tracking`) on the processes
where they run, finds them by name and logs to all of them.
"""

from __future__ import annotations

from typing import Any

from .run_views import RunViews
from .tracking.base import BlankTracker, GeneralTracker

__all__ = ["RunTrackers"]


class RunTrackers(RunViews):
    """The Accelerator's methods that start, find and log to its trackers."""

    log_with: list[Any]
    trackers: list[GeneralTracker]

    # --- trackers -------------------------------------------------------------------------------

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers chosen by ``log_with`` and record ``config``.

        Each tracker is built (names and classes as ``cls(project_name, logging_dir,
        **init_kwargs[name])`` when it needs a logging directory, else
        ``cls(project_name, **init_kwargs[name])``; instances as given), started, and given
        ``config`` with ``store_init_configuration``. A tracker with ``main_process_only``
        (every built-in one) exists on the main process only: elsewhere ``get_tracker``
        returns a tracker whose methods do nothing.

        Args:
            project_name: The run's name; each tracker uses it as its run, project or
                experiment name (as Accelerate's trackers do).
            config: The hyperparameters to record, or ``None``.
            init_kwargs: Per tracker name, keyword arguments of its constructor, e.g.
                ``{"wandb": {"mode": "offline"}}``.

        Raises:
            ImportError: a tracker's library is missing (the message gives the pip command).
        """
        from .tracking.registry import make_trackers  # the tracker modules load when used

        wanted = [spec for spec in self.log_with if self.is_main_process or not _main_only(spec)]
        self.trackers = []
        for tracker in make_trackers(wanted, project_name, self.logging_dir, init_kwargs):
            tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)
            self.trackers.append(tracker)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its raw object with ``unwrap=True``).

        Returns a blank tracker (every method, ``log_images`` and ``log_table`` included,
        does nothing) when none has that name here, e.g. on processes other than the main one.
        """
        for tracker in self.trackers:
            if tracker.name == name:
                return getattr(tracker, "tracker", None) if unwrap else tracker
        # Not started here (e.g. on a process other than the main one): a tracker whose
        # methods do nothing, so logging code runs unchanged on every process.
        return BlankTracker(name)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` to every started tracker of this process."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))


def _main_only(spec: Any) -> bool:
    """Whether a tracker spec (name, class or instance) runs on the main process only."""
    if isinstance(spec, str):  # a built-in or registered name: ask its class
        from .tracking.registry import LOGGER_TYPE_TO_CLASS

        spec = LOGGER_TYPE_TO_CLASS.get(spec, GeneralTracker)
    return bool(getattr(spec, "main_process_only", True))
