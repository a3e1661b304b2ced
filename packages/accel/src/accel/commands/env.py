"""``accel env`` as functions (Accelerate's ``accelerate.commands.env``)."""

from __future__ import annotations

import argparse
from shutil import which
from typing import Any

from accel_launch.cli import environment_info

__all__ = ["env_command", "env_command_parser", "main"]


def env_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``accel env`` parser (``--config_file``), or its subparser added to ``subparsers``."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("env")
    else:
        parser = argparse.ArgumentParser("accel env")
    parser.add_argument("--config_file", default=None, help="the config file to report")
    parser.set_defaults(func=env_command)
    return parser


def env_command(args: argparse.Namespace) -> dict[str, Any]:
    """Print what ``accel env`` reports and return it as ``{label: value}``."""
    info = environment_info(getattr(args, "config_file", None), which=lambda name: which(name))
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"- {key}:")
            for name, item in value.items():
                print(f"\t- {name}: {item}")
        else:
            print(f"- {key}: {value}")
    return info


def main() -> int:
    """``accel env`` from ``sys.argv``."""
    env_command(env_command_parser().parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
