"""``accel launch`` as functions (Accelerate's ``accelerate.commands.launch``).

``launch_command_parser()`` is the ``accel launch`` parser; ``launch_command(args)`` runs it
and raises ``subprocess.CalledProcessError`` when the run fails (Accelerate raises too);
``_validate_launch_command(args)`` resolves the settings the way ``accel launch`` does (flag >
environment > config file > default) and writes them back onto ``args``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

from accel_launch.cli import launch_parser
from accel_launch.config import ClusterConfig, find_config_file, load_config_from_file
from accel_launch.launch import LaunchError
from accel_launch.launch import launch_command as _launch
from accel_launch.settings import LAUNCH_KEYS, resolve_launch_settings

__all__ = ["launch_command", "launch_command_parser", "main"]


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``accel launch`` parser, or its subparser added to ``subparsers``."""
    return launch_parser(subparsers)


def launch_command(args: argparse.Namespace) -> None:
    """Run ``accel launch`` with ``args``.

    Raises:
        subprocess.CalledProcessError: the launch was refused or a process failed (its exit
            code, with the script as the command).
    """
    code = _launch(args)
    if code != 0:
        raise subprocess.CalledProcessError(code, [args.training_script])


def _validate_launch_command(
    args: argparse.Namespace,
) -> tuple[argparse.Namespace, ClusterConfig | None, bool]:
    """Fill ``args`` with the settings the environment or the config file decide.

    Settings left at their defaults are not written back (``accel launch`` applies them
    itself), so a later ``prepare_*`` call still tells given values from defaults.

    Returns:
        ``(args, the config file read or None, whether mixed_precision came from it)``.

    Raises:
        LaunchError: a bad value, or values that contradict each other.
    """
    path, how = find_config_file(getattr(args, "config_file", None))
    config = None
    if path is not None and not (getattr(args, "cpu", False) and how != "--config_file"):
        config = load_config_from_file(path)
    flags = {key: getattr(args, key, None) for key in LAUNCH_KEYS}
    if getattr(args, "cpu", False):
        flags["use_cpu"] = True
    try:
        settings = resolve_launch_settings(
            flags, os.environ, config, str(path) if config is not None else None, 0
        )
    except ValueError as error:
        raise LaunchError(f"accel launch: {error}") from error
    for key, setting in settings.items():
        if setting.source != "default":  # what the flags, the environment or the file decided
            setattr(args, key, setting.value)
    from_config = settings["mixed_precision"].source.startswith("config")
    return args, config, from_config


def main() -> None:
    """``accel launch`` from ``sys.argv``."""
    launch_command(launch_command_parser().parse_args())
