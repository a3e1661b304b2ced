"""Accelerate's ``accelerate.commands.merge``: the ``merge-weights`` parser, refusing to run.

Merging sharded FSDP checkpoints is refused until the FSDP2 engine lands.
"""

from __future__ import annotations

import argparse
from typing import Any

from accel.unavailable import unavailable_function

__all__ = ["merge_command", "merge_command_parser"]


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser (Accelerate's arguments), or its subparser."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("merge-weights")
    else:
        parser = argparse.ArgumentParser("accel merge-weights")
    parser.add_argument("checkpoint_directory", type=str)
    parser.add_argument("output_path", type=str)
    parser.add_argument("--unsafe_serialization", action="store_true", default=False)
    parser.add_argument("--remove_checkpoint_dir", action="store_true", default=False)
    parser.set_defaults(func=merge_command)
    return parser


merge_command = unavailable_function(
    "merge_command",
    "sharded FSDP checkpoints, which this release of accel does not write (no FSDP engine)",
    "accel's own checkpoints hold full weights already (save_model, save_state).",
)
