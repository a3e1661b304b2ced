"""Accelerate's ``accelerate.utils.torch_xla``, re-exported from the packages that own it.

``install_xla`` (Accelerate's notebook installer of torch_xla) imports and refuses when called:
accel never installs packages. Training on XLA devices is the XLA engine's
(:mod:`accel.engines.xla`), not this module's.
"""

from __future__ import annotations

from accel.unavailable import TORCH_XLA

install_xla = TORCH_XLA["install_xla"]

__all__ = [
    "install_xla",
]
