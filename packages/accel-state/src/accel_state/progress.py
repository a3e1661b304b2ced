"""Progress bars for long loads and saves: shown on a terminal, never in logs or CI output.

:func:`progress_bar` is what accel's long operations (loading checkpoints, ``load_pretrained``,
``save_model``, ``accel merge-weights``) report their progress through. A bar is shown only
when all of these hold: tqdm is installed, standard error is a terminal (so nothing reaches a
log file or a CI job's output), ``ACCEL_DISABLE_PROGRESS_BAR`` is not set to a true value, and
this process is the local main process (the others stay quiet). Otherwise the caller gets an
object whose ``update`` does nothing, so progress code needs no branches.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .environment import ACCEL_DISABLE_PROGRESS_BAR, parse_flag_from_env

__all__ = ["Progress", "progress_bar", "progress_enabled"]


class Progress(Protocol):
    """What :func:`progress_bar` yields: a tqdm bar, or a stand-in that ignores updates."""

    def update(self, n: float = 1) -> Any:
        """Advance the bar by ``n`` units."""


class _Silent:
    """The stand-in bar: updates are counted (for tests and callers) and shown nowhere."""

    def __init__(self) -> None:
        self.n: float = 0

    def update(self, n: float = 1) -> None:
        self.n += n


def _is_local_main_process() -> bool:
    from .state import PartialState

    if not PartialState._shared_state:
        return True
    return bool(PartialState().is_local_main_process)


def progress_enabled() -> bool:
    """Whether a progress bar would be shown now (see the module docstring for the rules).

    Raises:
        ValueError: ``ACCEL_DISABLE_PROGRESS_BAR`` holds something that is not a truth value.
    """
    if parse_flag_from_env(ACCEL_DISABLE_PROGRESS_BAR):
        return False
    stream = sys.stderr
    isatty = getattr(stream, "isatty", None)
    if stream is None or isatty is None or not isatty():
        return False
    return _is_local_main_process()


@contextmanager
def progress_bar(total: float, description: str, unit: str = "it") -> Iterator[Progress]:
    """A progress bar over ``total`` units while the block runs, closed when it ends.

    Args:
        total: How many units the work has (shard files, bytes, tensors...).
        description: The bar's label, e.g. ``"Loading checkpoint shards"``.
        unit: The unit's name shown by the bar (``"shard"``, ``"B"``...).

    Yields:
        The bar: call ``update(n)`` as units complete. Without a terminal, with
        ``ACCEL_DISABLE_PROGRESS_BAR`` set, without tqdm or off the local main process, an
        object whose ``update`` does nothing visible.
    """
    bar: Any = None
    if total > 0 and progress_enabled():
        try:
            tqdm = importlib.import_module("tqdm.auto").tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            scaled = unit == "B"
            bar = tqdm(
                total=total,
                desc=description,
                unit=unit,
                unit_scale=scaled,
                unit_divisor=1024 if scaled else 1000,
                leave=False,
            )
    try:
        yield bar if bar is not None else _Silent()
    finally:
        if bar is not None:
            bar.close()
