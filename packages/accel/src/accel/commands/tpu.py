"""Accelerate's ``accelerate.commands.tpu``: the ``tpu-config`` parser, refusing to run.

Running commands on a TPU pod is refused, as XLA is not in this release of accel.
"""

from __future__ import annotations

import argparse
from typing import Any

from accel.unavailable import unavailable_function

__all__ = ["tpu_command_launcher", "tpu_command_parser"]


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``tpu-config`` parser (Accelerate's arguments), or its subparser."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("tpu-config")
    else:
        parser = argparse.ArgumentParser("accel tpu-config")
    for name in (
        "--config_file",
        "--tpu_name",
        "--tpu_zone",
        "--command_file",
        "--accelerate_version",
    ):
        parser.add_argument(name, default=None)
    parser.add_argument("--use_alpha", action="store_true")
    parser.add_argument("--command", action="append", nargs="+")
    parser.add_argument("--install_accelerate", action="store_true")
    parser.add_argument("--debug", action="store_true")
    parser.set_defaults(func=tpu_command_launcher)
    return parser


tpu_command_launcher = unavailable_function(
    "tpu_command_launcher", "TPU pods (torch_xla), which are not in this release of accel"
)
