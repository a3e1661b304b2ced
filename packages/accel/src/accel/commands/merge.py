"""``accel merge-weights CHECKPOINT OUT``: full safetensors weights from a sharded save.

The parser has Accelerate's arguments. An FSDP2 checkpoint (DCP) goes through
:func:`accel.engines.fsdp2_merge.merge_fsdp_weights` (``CHECKPOINT``: the checkpoint folder
``save_state`` wrote or its ``pytorch_model_fsdp_<i>`` folder); a DeepSpeed ZeRO checkpoint
through :func:`accel.engines.deepspeed_merge.merge_deepspeed_weights` (the checkpoint folder or
its ``pytorch_model`` tag folder; DeepSpeed's ``zero_to_fp32`` reader, fp32 weights).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["main", "merge_command", "merge_command_parser"]


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser (Accelerate's arguments), or its subparser."""
    description = (
        "Merge a sharded FSDP2 (DCP) or DeepSpeed ZeRO checkpoint into full safetensors weights"
    )
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "merge-weights", description=description, help=description
        )
    else:
        parser = argparse.ArgumentParser("accel merge-weights", description=description)
    parser.add_argument(
        "checkpoint_directory",
        type=str,
        help="the checkpoint, or its pytorch_model_fsdp_<i> (FSDP2) or pytorch_model (DeepSpeed)",
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
    from accel.engines.deepspeed_merge import is_deepspeed_checkpoint, merge_deepspeed_weights
    from accel.engines.fsdp2_merge import merge_fsdp_weights

    merge = (
        merge_deepspeed_weights
        if is_deepspeed_checkpoint(args.checkpoint_directory)
        else merge_fsdp_weights
    )
    try:
        written = merge(
            args.checkpoint_directory,
            args.output_path,
            safe_serialization=not args.unsafe_serialization,
            remove_checkpoint_dir=args.remove_checkpoint_dir,
        )
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"accel {error}", file=sys.stderr)
        return 2
    print(f"merged into {args.output_path}: {', '.join(written)}")
    return 0


def main() -> int:
    """``accel merge-weights`` from ``sys.argv``; return the exit code (2 for a bad folder)."""
    return merge_command(merge_command_parser().parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
