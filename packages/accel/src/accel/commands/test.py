"""``accel test`` as functions (Accelerate's ``accelerate.commands.test``)."""

from __future__ import annotations

import argparse
from typing import Any

from accel_launch.cli import selftest

__all__ = ["main", "test_command", "test_command_parser"]


def test_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``accel test`` parser (``--config_file``), or its subparser added to ``subparsers``."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("test")
    else:
        parser = argparse.ArgumentParser("accel test")
    parser.add_argument("--config_file", default=None, help="the config file to launch with")
    parser.set_defaults(func=test_command)
    return parser


def test_command(args: argparse.Namespace) -> None:
    """Run the 2-process self-check of ``accel test``.

    Raises:
        RuntimeError: the check failed (its exit code is in the message).
    """
    code = selftest(getattr(args, "config_file", None))
    if code != 0:
        raise RuntimeError(f"accel test failed with exit code {code}; see the output above")


def main() -> None:
    """``accel test`` from ``sys.argv``."""
    test_command(test_command_parser().parse_args())


if __name__ == "__main__":
    main()
