"""Accelerate's ``accelerate.commands.to_fsdp2``: the ``to-fsdp2`` parser, refusing to run.

Running it is refused until the FSDP2 engine lands (the converted config would be refused).
"""

from __future__ import annotations

import argparse
from typing import Any

from accel.unavailable import unavailable_function

__all__ = ["convert_config_to_fsdp2", "to_fsdp2_command", "to_fsdp2_command_parser"]

_FEATURE = "the FSDP engine, which is not in this release of accel (FSDP configs are refused)"


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``to-fsdp2`` parser (Accelerate's arguments), or its subparser."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("to-fsdp2")
    else:
        parser = argparse.ArgumentParser("accel to-fsdp2")
    parser.add_argument("--config_file", type=str, required=True, help="the FSDP1 config")
    parser.add_argument("--overwrite", action="store_true", default=False)
    parser.add_argument("--output_file", type=str, default=None)
    parser.set_defaults(func=to_fsdp2_command)
    return parser


convert_config_to_fsdp2 = unavailable_function("convert_config_to_fsdp2", _FEATURE)
to_fsdp2_command = unavailable_function("to_fsdp2_command", _FEATURE)
