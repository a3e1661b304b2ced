"""``accel estimate-memory`` as functions (Accelerate's ``accelerate.commands.estimate``).

accel estimates local models only (safetensors headers, or a ``module:callable`` built on the
meta device); a Hub model name is refused with a message saying so, as there is no network
access to the Hub from accel's command.
"""

from __future__ import annotations

import argparse
from typing import Any

from accel_launch.estimate import DTYPES, estimate_rows, load_sizes
from accel_launch.estimate import estimate_command as _estimate

__all__ = [
    "add_timm_hub_prefix",
    "estimate_command",
    "estimate_command_parser",
    "gather_data",
    "main",
]


def add_timm_hub_prefix(model_name: str) -> str:
    """``timm/<name>`` becomes ``hf-hub:timm/<name>``; any other name is returned unchanged."""
    if model_name.startswith("timm/"):
        return f"hf-hub:{model_name}"
    return model_name


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``estimate-memory`` parser (Accelerate's arguments), or its subparser."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("estimate-memory")
    else:
        parser = argparse.ArgumentParser("accel estimate-memory")
    parser.add_argument("model_name", help="a local safetensors model or module:callable")
    parser.add_argument("--library_name", default=None, help="accepted; local models only")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--trust_remote_code", action="store_true", default=False)
    parser.set_defaults(func=estimate_command)
    return parser


def gather_data(args: argparse.Namespace) -> list[list[Any]]:
    """Rows ``[dtype, largest layer, total size, training size]`` for ``args.model_name``.

    Raises:
        FileNotFoundError, ValueError: the model is neither a local path nor an importable
            ``module:callable`` (Hub names are not fetched).
    """
    sizes = load_sizes(args.model_name)
    return [list(row) for row in estimate_rows(sizes, args.dtypes)]


def estimate_command(args: argparse.Namespace) -> list[list[Any]]:
    """Print the ``accel estimate-memory`` table for ``args.model_name``; return its rows."""
    print(_estimate(args.model_name, args.dtypes))
    return gather_data(args)


def main() -> None:
    """``accel estimate-memory`` from ``sys.argv``."""
    estimate_command(estimate_command_parser().parse_args())


if __name__ == "__main__":
    main()
