"""Errors raised by accel_state's collectives and process-group handling."""

from __future__ import annotations

__all__ = ["DistributedOperationException"]


class DistributedOperationException(Exception):
    """A collective could not run: ranks disagree about it, or not every rank entered it.

    The message names the operation (``gather``, ``reduce``, ...) and, where known, what
    each rank passed or was doing.
    """
