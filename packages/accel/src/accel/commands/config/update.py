"""``accel config update`` as functions (Accelerate's ``accelerate.commands.config.update``).

The config file is read with accel's loader (old spellings converted, unknown keys refused)
and written back with today's keys: in place, or, for the default file, to accel's default
file (Accelerate's default file is only read, when accel has none).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from accel_launch.config import update_config_file

from .config_utils import SubcommandHelpFormatter

__all__ = ["description", "update_command_parser", "update_config", "update_config_command"]

description = "Rewrite an existing config file with today's keys, keeping its settings."


def update_config(args: argparse.Namespace) -> str:
    """Rewrite ``args.config_file`` (None: the default file); return the path written.

    Raises:
        ValueError: the file does not exist (or, for None, no default file does), as
            Accelerate raises; or it cannot be read as a config.
    """
    try:
        _, written, _ = update_config_file(getattr(args, "config_file", None))
    except FileNotFoundError as error:
        raise ValueError(str(error)) from error
    return os.fspath(written)


def update_command_parser(
    parser: Any, parents: Sequence[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """Add the ``update`` subcommand to ``parser`` (the ``config`` subparsers) and return it."""
    sub: argparse.ArgumentParser = parser.add_parser(
        "update",
        parents=list(parents),
        help=description,
        formatter_class=SubcommandHelpFormatter,
    )
    sub.add_argument(
        "--config_file", default=None, help="the file to update (default: the default file)"
    )
    sub.set_defaults(func=update_config_command)
    return sub


def update_config_command(args: argparse.Namespace) -> None:
    """Rewrite the config file and say where it was written.

    Raises:
        ValueError: as :func:`update_config`.
    """
    written = update_config(args)
    print(f"Successfully updated the configuration file at {written}.")
