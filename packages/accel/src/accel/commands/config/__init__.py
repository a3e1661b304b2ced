"""Config files and ``accel config`` (Accelerate's ``accelerate.commands.config``).

:mod:`.config_args` holds the config classes and :func:`load_config_from_file`; the
subcommands are :mod:`.config` (the questionnaire), :mod:`.default` (``write_basic_config``)
and :mod:`.update`. :func:`get_config_parser` assembles them as Accelerate's does and
:func:`main` runs it (the questionnaire when no subcommand is given).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .config import config_command_parser
from .config_args import ClusterConfig, default_config_file, load_config_from_file
from .default import default_command_parser
from .update import update_command_parser

__all__ = [
    "ClusterConfig",
    "config_command_parser",
    "default_command_parser",
    "default_config_file",
    "get_config_parser",
    "load_config_from_file",
    "main",
    "update_command_parser",
]


def get_config_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``config`` parser with its ``default`` and ``update`` subcommands."""
    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser = config_command_parser(subparsers)
    commands = parser.add_subparsers(title="subcommands", dest="subcommand")
    default_command_parser(commands, parents=[parent])
    update_command_parser(commands, parents=[parent])
    return parser


def main() -> int:
    """``accel config [default|update]`` from ``sys.argv``; return the exit code.

    A refused request (a bad answer, a missing file) prints one line and returns 2.
    """
    parser = get_config_parser()
    args = parser.parse_args()
    try:
        args.func(args)
    except (ValueError, OSError, EOFError) as error:
        print(f"accel config: {error or 'the input ended'}", file=sys.stderr)
        return 2
    return 0
