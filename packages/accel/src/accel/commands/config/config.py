"""``accel config`` as functions (Accelerate's ``accelerate.commands.config.config``).

``config_command`` asks the questionnaire on the terminal (accel-launch's: the kind of run,
processes, machines, DeepSpeed or FSDP2, mixed precision) and writes the answers to
``--config_file`` or accel's default file, YAML (JSON for a ``.json`` name). Answers that
describe a launch accel would refuse stop it before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from accel_launch.config import ClusterConfig, default_config_path

from .cluster import get_cluster_input

__all__ = [
    "config_command",
    "config_command_parser",
    "description",
    "get_user_input",
    "main",
]

description = (
    "Ask a few questions and save the answers as the config file `accel launch` reads "
    "(run it first on a new machine)"
)


def get_user_input() -> ClusterConfig:
    """Ask the questions on the terminal; return the config (local machines only).

    Raises:
        ValueError: an answer is not one of the choices, or describes a launch accel
            refuses (SageMaker is not offered: accel does not launch there).
        EOFError: the input ended before the last question.
    """
    return get_cluster_input()


def config_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``config`` parser (``--config_file``), or its subparser added to ``subparsers``."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("config", description=description)
    else:
        parser = argparse.ArgumentParser("accel config", description=description)
    parser.add_argument(
        "--config_file", default=None, help="where to write (default: accel's default file)"
    )
    parser.set_defaults(func=config_command)
    return parser


def config_command(args: argparse.Namespace) -> None:
    """Ask the questions, write the answers to ``args.config_file``, and say where.

    Raises:
        ValueError, EOFError: as :func:`get_user_input`; nothing is written then.
    """
    config = get_user_input()
    target = args.config_file if args.config_file is not None else default_config_path()
    written = config.to_yaml_file(target)  # JSON for a .json name
    print(f"accel configuration saved at {os.fspath(written)}")


def main() -> int:
    """``accel config`` from ``sys.argv``; return the exit code (2 when refused)."""
    args = config_command_parser().parse_args()
    try:
        config_command(args)
    except (ValueError, OSError, EOFError) as error:
        print(f"accel config: {error or 'the input ended'}; nothing was written", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
