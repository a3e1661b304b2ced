"""One process on one device (CPU, one GPU, MPS, ...): the base engine as it is."""

from __future__ import annotations

from .base import Engine

__all__ = ["SingleDeviceEngine"]


class SingleDeviceEngine(Engine):
    """No process group, no wrapper: the model trains as the user built it."""

    name = "single device"
