"""``accel config default`` as functions (Accelerate's ``accelerate.commands.config.default``).

``write_basic_config`` is accel-launch's: one process per CUDA/XPU/NPU device of this machine
(one on MPS or a CPU-only machine, with ``use_cpu: true`` on the CPU), written as YAML
(JSON for a ``.json`` name) to accel's default file unless another is given. An existing file
is never overwritten.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from accel_launch.config import write_basic_config

from .config_utils import SubcommandHelpFormatter

__all__ = ["default_command_parser", "default_config_command", "description", "write_basic_config"]

description = "Create a default config file for accel with only a few flags set."


def default_command_parser(
    parser: Any, parents: Sequence[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """Add the ``default`` subcommand to ``parser`` (the ``config`` subparsers) and return it."""
    sub: argparse.ArgumentParser = parser.add_parser(
        "default",
        parents=list(parents),
        help=description,
        formatter_class=SubcommandHelpFormatter,
    )
    sub.add_argument(
        "--config_file",
        default=None,
        dest="save_location",
        help="where to write (default: accel's default config file)",
    )
    sub.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16", "fp8"],
        type=str,
        default="no",
        help="the mixed precision of the runs",
    )
    sub.set_defaults(func=default_config_command)
    return sub


def default_config_command(args: argparse.Namespace) -> None:
    """Write the file for ``args.mixed_precision`` at ``args.save_location``; say where.

    Raises:
        ValueError: ``args.mixed_precision`` is not one of the choices.
    """
    written = write_basic_config(args.mixed_precision, args.save_location)
    if written:
        print(f"accel configuration saved at {written}")
