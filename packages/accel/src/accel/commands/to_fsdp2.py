"""``accel to-fsdp2``: convert an FSDP1 launch config file to FSDP2 (Accelerate's command).

FSDP1-only keys are dropped with a warning each (``fsdp_backward_prefetch``,
``fsdp_forward_prefetch``, ``fsdp_sync_module_states``, ``fsdp_use_orig_params``),
``fsdp_sharding_strategy`` becomes ``fsdp_reshard_after_forward`` (``FULL_SHARD`` /
``HYBRID_SHARD``: true, ``SHARD_GRAD_OP`` / ``HYBRID_SHARD_ZERO2``: false; ``NO_SHARD`` is
refused: that is DDP), and ``fsdp_version`` becomes 2. The file is read with
``yaml.safe_load`` and written atomically, to ``--output_file`` or, with ``--overwrite``, in
place.

As Accelerate's, :func:`to_fsdp2_command` raises for a bad request (``FileNotFoundError``,
``ValueError``, ``FileExistsError``) and returns None; ``accel to-fsdp2`` prints the reason
on one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from accel_state.engine_vocabulary import RESHARD_OF_STRATEGY

__all__ = ["convert_config_to_fsdp2", "load_config", "to_fsdp2_command", "to_fsdp2_command_parser"]

logger = logging.getLogger("accel.commands.to_fsdp2")

_REMOVED = (
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
)


def _reshard(key: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    name = str(value).strip().upper()
    if name == "NO_SHARD":
        raise ValueError(
            f"{key}: NO_SHARD shards nothing and has no FSDP2 equivalent; use DDP "
            "(distributed_type: MULTI_GPU) instead"
        )
    if name not in RESHARD_OF_STRATEGY:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(RESHARD_OF_STRATEGY)}")
    return RESHARD_OF_STRATEGY[name]


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """The config with its ``fsdp_config`` section converted to FSDP2 (a new mapping).

    A config without ``fsdp_config`` is returned as is (logged at INFO), one already at
    ``fsdp_version: 2`` too, with a warning (its keys are taken to be FSDP2's already).
    ``config`` itself is not changed.

    Raises:
        ValueError: a sharding strategy with no FSDP2 equivalent (``NO_SHARD``).
    """
    section = config.get("fsdp_config") or {}
    if not section:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return dict(config)
    if str(section.get("fsdp_version", 1)).strip() == "2":
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        logger.warning(
            "to-fsdp2: the file is written unchanged; if its fsdp_config still has FSDP1 keys, "
            "set fsdp_version: 1 there and convert it again"
        )
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


def load_config(config_file: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``config_file`` (``yaml.safe_load``) as the mapping ``to-fsdp2`` converts.

    Raises:
        ValueError: the file is empty, is not valid YAML, or does not hold a mapping.
    """
    import yaml

    try:
        config = yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"--config_file {os.fspath(config_file)!r} is not YAML: {error}") from None
    if not config:
        raise ValueError(
            f"Config file is empty: --config_file {os.fspath(config_file)!r} holds no settings; "
            "pass the FSDP1 config to convert"
        )
    if not isinstance(config, dict):
        raise ValueError(
            f"--config_file {os.fspath(config_file)!r} holds a {type(config).__name__}, not a "
            "mapping of settings: pass a launch config file"
        )
    return config


def _target(args: argparse.Namespace) -> Path:
    """Where ``to-fsdp2`` writes, after checking the request as Accelerate does."""
    source = Path(args.config_file)
    if not source.is_file():
        raise FileNotFoundError(
            f"Config file {os.fspath(source)} not found (--config_file): pass an existing "
            "launch config file"
        )
    if args.output_file is None:
        if not args.overwrite:
            raise ValueError(
                "If --overwrite is not set, --output_file must be provided: pass "
                "--output_file NEW, or --overwrite to convert the file in place"
            )
        return source
    target = Path(args.output_file)
    if not args.overwrite and target.exists():
        raise FileExistsError(
            f"Output file {os.fspath(target)} already exists and --overwrite is not set: pass "
            "another --output_file, or --overwrite to replace it"
        )
    return target


def to_fsdp2_command(args: argparse.Namespace) -> None:
    """Convert ``args.config_file`` to FSDP2 and write it (Accelerate's ``to_fsdp2_command``).

    Writes ``args.output_file``, or with ``args.overwrite`` and no output file the input
    file itself, atomically. Nothing is written when it raises.

    Raises:
        FileNotFoundError: the config file does not exist.
        ValueError: neither ``--output_file`` nor ``--overwrite`` was given; the file is
            empty or not a mapping; or its sharding strategy has no FSDP2 equivalent
            (``NO_SHARD``).
        FileExistsError: ``--output_file`` exists and ``--overwrite`` was not given.
    """
    import yaml

    from accel_state.files import atomic_write

    target = _target(args)
    converted = convert_config_to_fsdp2(load_config(args.config_file))
    atomic_write(target, yaml.safe_dump(converted, sort_keys=False))
    print(f"wrote the FSDP2 config to {os.fspath(target)}")
