"""``accel alias {install,remove,status}``: make ``import accelerate`` give accel here.

The command form of :func:`accel.install_as_accelerate`, for scripts one does not edit and for
Accelerate's own commands (``accelerate launch ...``); see :mod:`accel.alias_shim` for what it
writes and why.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["alias_command", "alias_command_parser"]


def alias_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``alias`` parser, or its subparser added to ``subparsers``."""
    description = (
        "Make `import accelerate` (transformers, peft, trl) and the `accelerate` command use "
        "accel in this environment"
    )
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "alias", description=description, help=description
        )
    else:
        parser = argparse.ArgumentParser("accel alias", description=description)
    parser.add_argument(
        "action",
        nargs="?",
        default="status",
        choices=["install", "remove", "status"],
        help="install or remove the alias, or say whether it is there (default)",
    )
    parser.add_argument(
        "--site",
        default=None,
        help="the site-packages folder to write into (default: this interpreter's; the "
        "commands then go to <site>/bin)",
    )
    parser.set_defaults(func=alias_command)
    return parser


def alias_command(args: argparse.Namespace) -> int:
    """Run ``accel alias``; return the exit status (2, with the reason, when refused)."""
    from accel.alias import AliasError
    from accel.alias_shim import install_alias, remove_alias, shim_paths
    from accel_state.accelerate_alias import alias_status

    if args.action == "status":
        print(f"accel alias: {alias_status().describe()}")
        return 0
    if args.action == "remove":
        removed = remove_alias(args.site)
        where = shim_paths(args.site).site
        if not removed:
            print(f"accel alias: no alias in {where}; nothing to remove")
        else:
            print(f"accel alias: removed {len(removed)} files from {where}")
        return 0
    try:
        paths = install_alias(args.site)
    except (AliasError, OSError) as error:
        print(f"accel alias: {error}", file=sys.stderr)
        return 2
    print(
        f"accel alias: `import accelerate` now gives accel in {paths.site} (transformers, peft "
        f"and trl use it), and `accelerate ...` commands in {paths.scripts} run `accel ...`. "
        "Undo with `accel alias remove`."
    )
    return 0
