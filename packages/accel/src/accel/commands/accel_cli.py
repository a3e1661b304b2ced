"""The ``accel`` command's entry point (Accelerate's ``accelerate.commands.accelerate_cli``)."""

from __future__ import annotations

from accel_launch.cli import main

__all__ = ["main"]


if __name__ == "__main__":
    raise SystemExit(main())
