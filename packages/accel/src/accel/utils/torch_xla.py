"""Accelerate's ``accelerate.utils.torch_xla``, re-exported from the packages that own it.

torch_xla helpers (Accelerate's ``accelerate.utils.torch_xla``): refusing, as XLA is not in
this release.
"""

from __future__ import annotations

from accel.unavailable import TORCH_XLA

install_xla = TORCH_XLA["install_xla"]

__all__ = [
    "install_xla",
]
