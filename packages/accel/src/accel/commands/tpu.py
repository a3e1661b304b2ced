"""``accel tpu-config``: run set-up commands on every VM of a TPU pod (Accelerate's command).

The command builds one ``gcloud compute tpus tpu-vm ssh <tpu_name> --zone <tpu_zone>
--command "<commands>" --worker all`` line, exactly as Accelerate does:

* the TPU's name and zone, the commands (``commands``) and the command file
  (``command_file``) come from the flags, else from the config file (``--config_file``, else
  the default one): the flags win, and ``--command`` outranks the config's command file;
* a command file's lines become the commands; several ``--command`` flags add up, each one's
  words becoming commands of their own (``--command echo hi`` runs ``echo`` then ``hi``);
* the commands run in ``/usr/share``, after ``pip install <accelerate>`` with
  ``--install_accelerate`` (``--accelerate_version``: ``latest`` is ``accelerate -U``,
  ``dev`` the GitHub repository, a version ``accelerate==<version>``), joined by ``; ``;
* ``--use_alpha`` runs ``gcloud alpha``.

With ``--debug`` the line is printed (``Running gcloud ...``) and nothing runs. Otherwise
``gcloud`` must be on ``PATH``: without it nothing runs and ``FileNotFoundError`` says so;
with it the line runs, and a failure raises ``subprocess.CalledProcessError`` (Accelerate
prints its success line whatever gcloud answered).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from accel_launch.config import find_config_file, load_config_from_file

__all__ = ["tpu_command_launcher", "tpu_command_parser"]

_DESCRIPTION = "Run commands across TPU VMs for initial setup before running `accel launch`."
_GIT_SOURCE = "git+https://github.com/huggingface/accelerate.git"
#: A PEP 440 public version (``1.15.0``, ``0.34.0rc1``, ``2.0.post1``, ``1.0.dev3``, ``2!1.0``).
_VERSION = re.compile(
    r"v?(\d+!)?\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9.]+)?", re.IGNORECASE
)


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``tpu-config`` parser (Accelerate's arguments and defaults), or its subparser."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "tpu-config", description=_DESCRIPTION, help=_DESCRIPTION
        )
    else:
        parser = argparse.ArgumentParser("accel tpu-config", description=_DESCRIPTION)
    config = parser.add_argument_group(
        "Config Arguments", "Settings that a config file (`accel config`) can hold too."
    )
    config.add_argument("--config_file", type=str, default=None, help="the config file to read")
    config.add_argument("--tpu_name", default=None, help="the TPU (default: the config's)")
    config.add_argument("--tpu_zone", default=None, help="its zone (default: the config's)")
    pod = parser.add_argument_group("TPU Arguments", "What runs on the TPU VMs.")
    pod.add_argument("--use_alpha", action="store_true", help="run `gcloud alpha ...`")
    pod.add_argument("--command_file", default=None, help="a file of commands, one a line")
    pod.add_argument(
        "--command", action="append", nargs="+", help="a command to run (repeat for more)"
    )
    pod.add_argument(
        "--install_accelerate", action="store_true", help="pip install accelerate first"
    )
    pod.add_argument(
        "--accelerate_version",
        default="latest",
        help="with --install_accelerate: 'latest' (default), 'dev' (GitHub) or a version",
    )
    pod.add_argument("--debug", action="store_true", help="print the gcloud command, run nothing")
    parser.set_defaults(func=tpu_command_launcher)
    return parser


def _fill_from_config(args: argparse.Namespace) -> None:
    """Take the TPU name, zone, commands and command file from the config file where unset."""
    path, _ = find_config_file(args.config_file)  # FileNotFoundError for a missing file
    if path is None:
        return
    config = load_config_from_file(path)
    if not args.command_file and config.command_file is not None and not args.command:
        args.command_file = config.command_file
    if not args.command and config.commands is not None:
        args.command = config.commands
    if not args.tpu_name:
        args.tpu_name = config.tpu_name
    if not args.tpu_zone:
        args.tpu_zone = config.tpu_zone


def _pip_target(version: str) -> str:
    """What ``pip install`` gets for ``--accelerate_version``."""
    if version == "dev":
        return _GIT_SOURCE
    if version == "latest":
        return "accelerate -U"
    if _VERSION.fullmatch(version.strip()) is None:
        raise ValueError(
            f"--accelerate_version={version!r} is not a version: pass 'latest', 'dev' or a "
            "version number such as 1.15.0"
        )
    return f"accelerate=={version}"


def _commands(args: argparse.Namespace) -> list[str]:
    """The commands to run, one string each (a command file's lines, or the flags' words)."""
    if not args.command_file and not args.command:
        raise ValueError(
            "You must specify either a command file or a command to run on the pod: pass "
            "--command CMD (repeatable) or --command_file FILE, or set `commands` or "
            "`command_file` in the config file"
        )
    if args.command_file:
        return Path(args.command_file).read_text(encoding="utf-8").splitlines()
    commands: list[str] = []
    for item in args.command:
        commands.extend(item if isinstance(item, list) else [item])
    return [str(command) for command in commands]


def tpu_command_launcher(args: argparse.Namespace) -> None:
    """Run (or with ``args.debug`` print) the ``gcloud`` line that sets up the TPU pod.

    ``args`` is updated as Accelerate updates it: ``args.command`` becomes the joined command
    string and ``args.accelerate_version`` what ``pip install`` gets.

    Raises:
        FileNotFoundError: the config file or the command file does not exist, or (without
            ``--debug``) ``gcloud`` is not on ``PATH``; nothing was run.
        ValueError: no command and no command file; the TPU name or zone is unknown; or
            ``--accelerate_version`` is not a version.
        subprocess.CalledProcessError: ``gcloud`` ran and failed.
    """
    _fill_from_config(args)
    args.accelerate_version = _pip_target(str(args.accelerate_version))
    commands = _commands(args)
    for name in ("tpu_name", "tpu_zone"):
        if not getattr(args, name):
            raise ValueError(
                f"{name}={getattr(args, name)!r}: the TPU's name and zone are needed; pass "
                f"--{name} or set {name} in the config file"
            )
    setup = ["cd /usr/share"]
    if args.install_accelerate:
        setup.append(f"pip install {args.accelerate_version}")
    args.command = "; ".join([*setup, *commands])
    line = ["gcloud", *(["alpha"] if args.use_alpha else [])]
    line += ["compute", "tpus", "tpu-vm", "ssh", args.tpu_name, "--zone", args.tpu_zone]
    line += ["--command", args.command, "--worker", "all"]
    if args.debug:
        print(f"Running {' '.join(line)}")
        return
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        raise FileNotFoundError(
            "gcloud is not on PATH, so the TPU pod cannot be reached and nothing was run: "
            "install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install), or "
            "pass --debug to print the command instead"
        )
    subprocess.run([gcloud, *line[1:]], check=True)
    print(f"accel tpu-config: the commands ran on every VM of {args.tpu_name}")
