"""``accel merge-weights CHECKPOINT OUT``: full safetensors weights from a sharded FSDP2 save.

The parser has Accelerate's arguments; the work is
:func:`accel.engines.fsdp2_merge.merge_fsdp_weights`. ``CHECKPOINT`` may be the checkpoint
folder ``save_state`` wrote or its ``pytorch_model_fsdp_<i>`` folder.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["merge_command", "merge_command_parser"]


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser (Accelerate's arguments), or its subparser."""
    description = "Merge a sharded FSDP2 checkpoint (DCP) into full safetensors weights"
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "merge-weights", description=description, help=description
        )
    else:
        parser = argparse.ArgumentParser("accel merge-weights", description=description)
    parser.add_argument(
        "checkpoint_directory", type=str, help="the checkpoint, or its pytorch_model_fsdp_<i>"
    )
    parser.add_argument("output_path", type=str, help="folder for model.safetensors")
    parser.add_argument(
        "--unsafe_serialization",
        action="store_true",
        default=False,
        help="write pytorch_model.bin (pickle) instead of safetensors",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        action="store_true",
        default=False,
        help="delete the sharded folder once merged",
    )
    parser.set_defaults(func=merge_command)
    return parser


def merge_command(args: argparse.Namespace) -> int:
    """Run ``merge-weights``; return the exit status (2 with a message for a bad folder)."""
    from accel.engines.fsdp2_merge import merge_fsdp_weights

    try:
        written = merge_fsdp_weights(
            args.checkpoint_directory,
            args.output_path,
            safe_serialization=not args.unsafe_serialization,
            remove_checkpoint_dir=args.remove_checkpoint_dir,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"accel {error}", file=sys.stderr)
        return 2
    print(f"merged into {args.output_path}: {', '.join(written)}")
    return 0
