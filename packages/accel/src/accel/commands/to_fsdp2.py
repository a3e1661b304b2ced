"""``accel to-fsdp2``: convert an FSDP1 launch config file to FSDP2 (Accelerate's command).

FSDP1-only keys are dropped with a warning each (``fsdp_backward_prefetch``,
``fsdp_forward_prefetch``, ``fsdp_sync_module_states``, ``fsdp_use_orig_params``),
``fsdp_sharding_strategy`` becomes ``fsdp_reshard_after_forward`` (``FULL_SHARD`` /
``HYBRID_SHARD``: true, ``SHARD_GRAD_OP`` / ``HYBRID_SHARD_ZERO2``: false; ``NO_SHARD`` is
refused: that is DDP), and ``fsdp_version`` becomes 2. The file is read with
``yaml.safe_load`` and written atomically, to ``--output_file`` or, with ``--overwrite``, in
place.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["convert_config_to_fsdp2", "to_fsdp2_command", "to_fsdp2_command_parser"]

logger = logging.getLogger("accel.commands.to_fsdp2")

_REMOVED = (
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
)
_RESHARD = {
    "FULL_SHARD": True,
    "HYBRID_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False,
    "_HYBRID_SHARD_ZERO2": False,
}


def _reshard(key: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    name = str(value).strip().upper()
    if name == "NO_SHARD":
        raise ValueError(
            f"{key}: NO_SHARD shards nothing and has no FSDP2 equivalent; use DDP "
            "(distributed_type: MULTI_GPU) instead"
        )
    if name not in _RESHARD:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(_RESHARD)}")
    return _RESHARD[name]


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """The config with its ``fsdp_config`` section converted to FSDP2 (a new mapping).

    A config without ``fsdp_config``, or already at ``fsdp_version: 2``, is returned as is.

    Raises:
        ValueError: a sharding strategy with no FSDP2 equivalent (``NO_SHARD``).
    """
    section = config.get("fsdp_config") or {}
    if not section or int(section.get("fsdp_version", 1)) == 2:
        return dict(config)
    converted: dict[str, Any] = {}
    for key, value in section.items():
        if key in _REMOVED:
            logger.warning(f"to-fsdp2: {key} has no meaning in FSDP2; dropped")
        elif key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            converted["fsdp_reshard_after_forward"] = _reshard(key, value)
        else:
            converted[key] = value
    converted["fsdp_version"] = 2
    return {**config, "fsdp_config": converted}


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``to-fsdp2`` parser (Accelerate's arguments), or its subparser."""
    description = "Convert an FSDP1 launch config file to FSDP2"
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "to-fsdp2", description=description, help=description
        )
    else:
        parser = argparse.ArgumentParser("accel to-fsdp2", description=description)
    parser.add_argument("--config_file", type=str, required=True, help="the FSDP1 config")
    parser.add_argument(
        "--overwrite", action="store_true", default=False, help="convert the file in place"
    )
    parser.add_argument("--output_file", type=str, default=None, help="where to write")
    parser.set_defaults(func=to_fsdp2_command)
    return parser


def to_fsdp2_command(args: argparse.Namespace) -> int:
    """Run ``to-fsdp2``; return the exit status (2 with a message for a bad request)."""
    import yaml

    from accel_state.files import atomic_write

    source = Path(args.config_file)
    target = source if args.overwrite else Path(args.output_file or "")
    problem = None
    if not source.is_file():
        problem = f"--config_file {os.fspath(source)!r} does not exist"
    elif not args.overwrite and args.output_file is None:
        problem = "pass --output_file NEW, or --overwrite to convert the file in place"
    elif not args.overwrite and target.exists():
        problem = f"--output_file {os.fspath(target)!r} exists; pass --overwrite to replace it"
    if problem is None:
        try:
            config = yaml.safe_load(source.read_text()) or {}
            if not isinstance(config, dict):
                raise ValueError(f"{os.fspath(source)} does not hold a mapping")
            converted = convert_config_to_fsdp2(config)
        except (ValueError, yaml.YAMLError) as error:
            problem = str(error)
    if problem is not None:
        print(f"accel to-fsdp2: {problem}", file=sys.stderr)
        return 2
    atomic_write(target, yaml.safe_dump(converted, sort_keys=False))
    print(f"wrote the FSDP2 config to {os.fspath(target)}")
    return 0
