"""``accel launch`` as functions (Accelerate's ``accelerate.commands.launch``).

``launch_command_parser()`` is the ``accel launch`` parser, with Accelerate's defaults and
``args.nondefault`` (the flags the user typed). ``launch_command(args)`` runs the launch and,
as Accelerate's does, raises instead of returning an exit code: ``ValueError`` for flags or a
config file it refuses, ``FileNotFoundError`` for a missing config file, and
``subprocess.CalledProcessError`` when the script fails. ``_validate_launch_command(args)``
fills ``args`` the way Accelerate's does (the config file's values, then the defaults), with
accel's precedence for the launch settings: flag > ``ACCEL_*`` environment > config file >
default.

The ``accel launch`` command keeps its one-line errors and exit code 2: it catches these in
:mod:`accel_launch.cli`, not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
from typing import Any

from accel_launch.arguments import typed_arguments
from accel_launch.cli import launch_parser
from accel_launch.config import ClusterConfig
from accel_launch.launch import (
    LaunchError,
    check_launch_flags,
    detected_devices,
    launch_config_file,
    run_launch,
    script_command,
)
from accel_launch.settings import LAUNCH_KEYS, resolve_launch_settings
from accel_state.enums import DistributedType

__all__ = ["launch_command", "launch_command_parser", "main"]

#: The ``distributed_type`` values that Accelerate launches with ``--multi_gpu``.
_MULTI_DEVICE = frozenset(
    {
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
    }
)
#: Config sections whose keys Accelerate copies onto ``args``, with the prefix each key gets.
_SECTION_PREFIXES = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}
#: Config keys Accelerate never copies onto ``args`` as they are.
_NOT_COPIED = frozenset({"compute_environment", "mixed_precision", "distributed_type"})
#: The paradigm switches; when one is given, the config's ``distributed_type`` decides none.
_PARADIGMS = ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp", "use_megatron_lm")


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``accel launch`` parser, or its subparser added to ``subparsers``.

    Parsed namespaces carry Accelerate's defaults (``fsdp_sync_module_states="true"``, ...)
    and ``nondefault``, the set of destinations the user typed.
    """
    return launch_parser(subparsers)


def _check_like_accelerate(args: argparse.Namespace) -> None:
    """The refusals Accelerate's ``_validate_launch_command`` makes before reading anything."""
    typed = typed_arguments(args)
    check_launch_flags(typed)
    if getattr(typed, "use_parallelism_config", False):
        version = getattr(typed, "fsdp_version", None)
        if not getattr(typed, "use_fsdp", False) or str(version).strip() == "1":
            raise LaunchError(
                f"use_parallelism_config=True with use_fsdp={getattr(typed, 'use_fsdp', False)!r}"
                f" and fsdp_version={version!r}: you cannot use `--use_parallelism_config` "
                "without `--use_fsdp` and `--fsdp_version=2` in launch_command(); add "
                "--use_fsdp (the `accel launch` command also starts a ParallelismConfig "
                "without FSDP2)"
            )


def launch_command(args: argparse.Namespace) -> None:
    """Run ``accel launch`` with ``args``, raising where Accelerate raises.

    ``args`` is not changed; the launch reads the config file itself, with accel's
    precedence (flag > ``ACCEL_*`` environment > config file > default).

    Raises:
        ValueError: flags that contradict each other (``--cpu --multi_gpu``, ``--multi_gpu``
            with one process, ``--use_parallelism_config`` without FSDP2), a config file
            with unknown keys or bad values, or anything else accel refuses to launch
            (:class:`accel_launch.launch.LaunchError`, a ``ValueError``). Nothing was started.
        FileNotFoundError: ``--config_file`` names a missing file.
        subprocess.CalledProcessError: the run failed; its ``cmd`` is the script's command
            line (``[python, script, *args]``) and its ``returncode`` the exit code.
    """
    _check_like_accelerate(args)
    code = run_launch(args)
    if code != 0:
        raise subprocess.CalledProcessError(code, script_command(args))


def _config_for(args: argparse.Namespace) -> tuple[ClusterConfig | None, str | None]:
    """The config file the launcher reads (``--cpu`` skips the default one), and its label."""
    config, path, _ = launch_config_file(args)
    return (config, f"config {path}") if config is not None else (None, None)


def _paradigm_from_config(args: argparse.Namespace, config: ClusterConfig) -> None:
    """Set the paradigm switches from ``distributed_type`` when none was given."""
    if any(getattr(args, name, False) for name in _PARADIGMS):
        return
    kind = config.distributed_type
    args.use_deepspeed = kind == DistributedType.DEEPSPEED
    args.multi_gpu = kind in _MULTI_DEVICE
    args.tpu = kind == DistributedType.XLA
    args.use_fsdp = kind == DistributedType.FSDP
    args.use_megatron_lm = kind == DistributedType.MEGATRON_LM
    args.tpu_use_cluster = config.tpu_use_cluster if args.tpu else False
    args.use_parallelism_config = config.parallelism_config != {}


def _copy_config(args: argparse.Namespace, config: ClusterConfig) -> None:
    """Copy the config's other values onto ``args`` where the user gave none, as Accelerate.

    A section's keys (``fsdp_config``, ``fp8_config``, ``dynamo_config``, ...) are copied
    when ``args.nondefault`` does not name them, ``fsdp_``/``fp8_``/``dynamo_`` added where
    missing; other keys when ``args`` has None. The launch settings are left to
    :func:`_validate_launch_command`'s resolution.
    """
    typed = getattr(args, "nondefault", None)
    for field in dataclasses.fields(config):
        if not field.init or field.name in _NOT_COPIED or field.name in LAUNCH_KEYS:
            continue
        value = getattr(config, field.name)
        if isinstance(value, dict):
            prefix = _SECTION_PREFIXES.get(field.name, "")
            for key, item in value.items():
                name = key if key.startswith(prefix) else prefix + key
                if typed is not None and name not in typed and name not in LAUNCH_KEYS:
                    setattr(args, name, item)
        elif getattr(args, field.name, None) is None:
            setattr(args, field.name, value)


def _validate_launch_command(
    args: argparse.Namespace,
) -> tuple[argparse.Namespace, ClusterConfig | None, bool]:
    """Check ``args`` and fill in what the config file and the defaults decide, as Accelerate.

    After Accelerate's refusals, the config file (``--config_file``, else the default file
    unless ``--cpu``) sets the paradigm switches from its ``distributed_type`` when none was
    given, and its other values where ``args`` has none (a section's keys where
    ``args.nondefault`` does not name them). Every launch setting the user did not type
    (``num_processes``, ``num_machines``, ``mixed_precision``, ``dynamo_backend``,
    ``gpu_ids``, ``debug``, ...) is then set to the value ``accel launch`` resolves for it
    (environment > config file > default).

    Returns:
        ``(args, the config file read or None, whether mixed_precision came from it)``.

    Raises:
        ValueError: contradicting flags (see :func:`launch_command`), a config file with
            unknown keys or bad values, or a bad setting (naming it, its value and source).
        FileNotFoundError: ``--config_file`` names a missing file.
    """
    _check_like_accelerate(args)
    config, source = _config_for(args)
    if config is not None:
        _paradigm_from_config(args, config)
        _copy_config(args, config)
    typed = typed_arguments(args)
    flags = {key: getattr(typed, key, None) for key in LAUNCH_KEYS}
    if getattr(args, "cpu", False):
        flags["use_cpu"] = True
    try:
        settings = resolve_launch_settings(flags, os.environ, config, source, detected_devices())
    except ValueError as error:
        raise LaunchError(f"accel launch: {error}") from error
    for key, setting in settings.items():
        if flags[key] is None:
            setattr(args, key, setting.value)
    if settings["use_cpu"].source == "default":  # Accelerate: the --cpu flag, else False
        args.use_cpu = bool(getattr(args, "cpu", False))
    from_config = settings["mixed_precision"].source.startswith("config")
    return args, config, from_config


def main() -> None:
    """``accel launch`` from ``sys.argv``."""
    launch_command(launch_command_parser().parse_args())


if __name__ == "__main__":
    main()
