"""Accelerate's ``accelerate.launchers``: the in-process launchers, from accel-launch."""

from __future__ import annotations

from accel_launch.launchers import PrepareForLaunch, debug_launcher, notebook_launcher

__all__ = ["PrepareForLaunch", "debug_launcher", "notebook_launcher"]
