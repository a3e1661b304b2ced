"""Multi-process logging: a logger adapter that logs on the main process only by default.

``tqdm`` (Accelerate's ``accelerate.utils.tqdm``) is a progress bar shown on the local main
process only.

``get_logger(__name__)`` returns a :class:`MultiProcessAdapter`. Each call takes
``main_process_only`` (default ``True``) and ``in_order`` (default ``False``); with
``in_order=True`` every process logs, one after the other in rank order.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import MutableMapping
from typing import Any

from .environment import ACCEL_LOG_LEVEL, read_variable
from .state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger", "tqdm"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` that knows about processes.

    Messages are prefixed with ``[RANK i]`` when several processes run. By default only the
    main process logs; ``main_process_only=False`` lets every process log, and
    ``in_order=True`` makes every process log in rank order (with a barrier between ranks,
    so every process must make the call).

    Raises:
        RuntimeError: a message is logged before ``PartialState()`` (or an ``Accelerator``)
            was created.
    """

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefix the message with the rank when several processes run."""
        state = PartialState()
        if state.num_processes > 1:
            msg = f"[RANK {state.process_index}] {msg}"
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` at ``level`` on the processes selected by the keyword flags."""
        if not PartialState._shared_state:
            raise RuntimeError(
                "You must initialize the accel state by calling either `PartialState()` or "
                "`Accelerator()` before using the logging utility."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if in_order:
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    text, kw = self.process(msg, kwargs)
                    self.logger.log(level, text, *args, **kw)
                state.wait_for_everyone()
            return
        if not main_process_only or state.is_main_process:
            text, kw = self.process(msg, kwargs)
            self.logger.log(level, text, *args, **kw)

    @functools.lru_cache(None)  # noqa: B019 - one warning per distinct message is the point
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """Log a warning once per distinct message."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """Return a multi-process logger for ``name``.

    Args:
        name: Logger name, usually ``__name__``.
        log_level: Level such as ``"INFO"``; defaults to ``ACCEL_LOG_LEVEL`` when set.

    Raises:
        ValueError: the level is not a logging level name.
    """
    level = log_level if log_level is not None else read_variable(ACCEL_LOG_LEVEL)
    logger = logging.getLogger(name)
    if level:
        upper = level.upper()
        if not isinstance(logging.getLevelName(upper), int):
            source = "log_level" if log_level is not None else ACCEL_LOG_LEVEL
            raise ValueError(
                f"{source}={level!r} is not a logging level: use DEBUG, INFO, WARNING, ERROR "
                "or CRITICAL"
            )
        logger.setLevel(upper)
        logger.root.setLevel(upper)
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm`` progress bar shown by the local main process only (Accelerate's wrapper).

    Args:
        *args: Passed to ``tqdm.auto.tqdm`` (the iterable first).
        main_process_only: Hide the bar on every process but local rank 0.
        **kwargs: Passed to ``tqdm.auto.tqdm``; an explicit ``disable=True`` always wins.

    Raises:
        ImportError: tqdm is not installed (with the pip command).
    """
    from .imports import is_tqdm_available

    if not is_tqdm_available():
        raise ImportError("accel's tqdm wrapper needs tqdm: pip install tqdm")
    import importlib

    progress = importlib.import_module("tqdm.auto").tqdm

    disable = bool(kwargs.pop("disable", False))
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return progress(*args, **kwargs, disable=disable)
