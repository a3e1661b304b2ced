"""Accelerate's launcher helpers (``accelerate.utils.launch``) over accel's launch rules.

Libraries that build their own launchers call ``prepare_simple_launcher_cmd_env(args)`` and
``prepare_multi_gpu_env(args)`` with an ``argparse.Namespace`` shaped like ``accelerate
launch``'s. Here they resolve the same settings ``accel launch`` resolves (flag > environment
> default; a missing attribute counts as not given) and return Accelerate's results: the
command and the environment of a single process, or the environment of a torchrun launch
(with ``args.master_addr``, ``args.master_port``, ``args.nproc_per_node``, ``args.nnodes`` and
``args.node_rank`` filled in, as Accelerate fills them). ``use_fsdp`` / ``use_deepspeed`` and
their settings become ``ACCEL_USE_FSDP`` / ``ACCEL_USE_DEEPSPEED`` and the engine's variables,
as with ``accel launch``; an engine this release lacks (``use_megatron_lm``, ...) is refused as
``accel launch`` refuses it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from accel_state.engine_requests import (
    EngineRequest,
    EngineUnavailableError,
    refuse_unavailable_engines,
)
from accel_state.environment import ACCEL_DEBUG_MODE
from accel_state.imports import is_torch_xla_available
from accel_state.topology import get_free_port

from .arguments import typed_arguments
from .engines import (
    DEEPSPEED_KEYS,
    FSDP_KEYS,
    PARALLELISM_FLAGS,
    engine_environment,
    launch_engine_requests,
    resolve_engine_settings,
)
from .launch import LaunchError, process_environment
from .settings import LAUNCH_KEYS, Setting, resolve_launch_settings

__all__ = [
    "env_var_path_add",
    "prepare_extend_env_parallelism_config",
    "prepare_multi_gpu_env",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
    "setup_fp8_env",
]

#: Intel OpenMP settings Accelerate gives a single CPU process (GNU OpenMP ignores them).
_INTEL_OPENMP = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


def env_var_path_add(env_var_name: str, path_to_add: str) -> str:
    """``env_var_name``'s ``:``-separated paths from the environment, with ``path_to_add`` last."""
    paths = [path for path in os.environ.get(env_var_name, "").split(":") if path]
    paths.append(str(path_to_add))
    return ":".join(paths)


def _settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Setting]:
    args = typed_arguments(args)  # Accelerate's parser defaults count as not given
    flags = {key: getattr(args, key, None) for key in LAUNCH_KEYS}
    if getattr(args, "cpu", False):
        flags["use_cpu"] = True
    engine_flags: dict[str, Any] = {
        name: getattr(args, name, None)
        for name in ("use_fsdp", "use_deepspeed", "use_megatron_lm", "use_parallelism_config")
    }
    engine_flags.update({name: getattr(args, name, None) for name in PARALLELISM_FLAGS})
    engine_flags.update({name: getattr(args, name, False) for name in ("tpu", "cpu", "multi_gpu")})
    try:
        refuse_unavailable_engines(launch_engine_requests(engine_flags, environ, None, None))
        return resolve_launch_settings(flags, environ, None, None, 0)
    except (EngineUnavailableError, ValueError) as error:
        raise LaunchError(f"accel launch: {error}") from error


def _engine_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The engine variables ``args`` asks for, as accel launch exports them.

    ``use_fsdp`` / ``use_deepspeed`` with their settings become the switch and the settings'
    variables.
    An engine's settings count only with its switch (Accelerate's parser gives them defaults
    on every namespace, and Accelerate reads them only then).
    """
    args = typed_arguments(args)
    flags: dict[str, Any] = {key.name: None for key in (*DEEPSPEED_KEYS, *FSDP_KEYS)}
    if getattr(args, "use_deepspeed", False):
        flags.update({key.name: getattr(args, key.name, None) for key in DEEPSPEED_KEYS})
        flags["engine"] = "deepspeed"
    elif getattr(args, "use_fsdp", False):
        flags.update({key.name: getattr(args, key.name, None) for key in FSDP_KEYS})
        flags["engine"] = "fsdp"
    elif getattr(args, "cpu", False) or getattr(args, "multi_gpu", False):
        flags["engine"] = "none"
    try:
        engine = resolve_engine_settings(flags, environ, None, None)
    except ValueError as error:
        raise LaunchError(f"accel launch: {error}") from error
    return dict(engine_environment(engine, None))


def _visible_devices(args: argparse.Namespace, env: dict[str, str]) -> None:
    gpu_ids = getattr(args, "gpu_ids", None)
    if gpu_ids not in (None, "", "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and the environment of a one-process launch of ``args.training_script``.

    Raises:
        LaunchError: a bad value, or an engine this release lacks.
    """
    settings = _settings(args, os.environ)
    script = str(getattr(args, "training_script", ""))
    script_args = [str(item) for item in getattr(args, "training_script_args", None) or []]
    if getattr(args, "no_python", False):
        command = [script, *script_args]
    elif getattr(args, "module", False):
        command = [sys.executable, "-m", script, *script_args]
    else:
        command = [sys.executable, script, *script_args]
    env = {**os.environ, **process_environment(settings), **_engine_env(args, os.environ)}
    _visible_devices(args, env)
    if int(settings["num_machines"].value) > 1:
        env["MASTER_ADDR"] = str(settings["main_process_ip"].value or "127.0.0.1")
        env["MASTER_PORT"] = str(settings["main_process_port"].value or 29500)
    if settings["use_cpu"].value and settings["use_cpu"].source != "default":
        # Asked for (--cpu, ACCEL_USE_CPU, the config), as Accelerate sets them for --cpu.
        for name, value in _INTEL_OPENMP.items():
            env.setdefault(name, value)
    return command, env


def prepare_tpu(
    args: argparse.Namespace, current_env: dict[str, str], pod: bool = False
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Accelerate's TPU environment: torch_xla's bf16 variables and the debug switch.

    ``mixed_precision="bf16"`` on a TPU sets ``XLA_USE_BF16=1`` (``XLA_DOWNCAST_BF16=1``
    with ``args.downcast_bf16``); ``args.debug`` sets ``ACCEL_DEBUG_MODE=true``.

    Raises:
        LaunchError: ``pod=True`` (TPU pod launching is not built: run ``accel launch --tpu``
            on each TPU VM).
    """
    if pod:
        raise LaunchError(
            "prepare_tpu(pod=True): accel does not launch TPU pods (gcloud on every VM); run "
            "`accel launch --tpu` on each TPU VM"
        )
    if getattr(args, "mixed_precision", None) == "bf16" and is_torch_xla_available(
        check_is_tpu=True
    ):
        name = "XLA_DOWNCAST_BF16" if getattr(args, "downcast_bf16", False) else "XLA_USE_BF16"
        current_env[name] = "1"
    if getattr(args, "debug", False):
        current_env[ACCEL_DEBUG_MODE] = "true"
    return args, current_env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of a torchrun launch; fills in ``args``'s rendezvous attributes.

    On one machine, ``main_process_port`` None or 0 means a free port, chosen here.

    Raises:
        LaunchError: a bad value, or an engine this release lacks.
    """
    settings = _settings(args, os.environ)
    machines = int(settings["num_machines"].value)
    processes = int(settings["num_processes"].value)
    port = settings["main_process_port"].value
    if not port:
        port = get_free_port() if machines == 1 else 29500
    args.master_addr = str(settings["main_process_ip"].value or "127.0.0.1")
    args.master_port = str(port)
    args.nproc_per_node = str(processes // max(1, machines))
    args.nnodes = str(machines)
    args.node_rank = int(settings["machine_rank"].value or 0)
    env = {**os.environ, **process_environment(settings), **_engine_env(args, os.environ)}
    _visible_devices(args, env)
    return env


def setup_fp8_env(args: argparse.Namespace, current_env: dict[str, str]) -> dict[str, str]:
    """Accelerate's FP8 launch settings (``--fp8_*``): accel reads none, so any is refused.

    Raises:
        ValueError: ``args`` carries an ``fp8_*`` setting (FP8 is configured in the script
            with ``AORecipeKwargs``).
    """
    typed = vars(typed_arguments(args))
    given = sorted(name for name, value in typed.items() if name.startswith("fp8_") and value)
    if given:
        raise ValueError(
            f"{', '.join('--' + name for name in given)}: accel takes no FP8 launch settings; "
            "use mixed_precision='fp8' with AORecipeKwargs(...) in the script (torchao)"
        )
    return current_env


def prepare_extend_env_parallelism_config(
    args: argparse.Namespace, current_env: dict[str, str]
) -> dict[str, str]:
    """Accelerate's ParallelismConfig launch variables: none are added here.

    The engine check passes (the registry marks ParallelismConfig available), and
    ``current_env`` comes back unchanged: no ``PARALLELISM_CONFIG_*`` variable is added from
    ``args`` (``accel launch --parallelism_config_*`` is what exports them).

    Raises:
        EngineUnavailableError: only if the registry marked that engine unavailable (it does
            not in this release).
    """
    request = EngineRequest(
        "parallelism_config",
        "prepare_extend_env_parallelism_config()",
        "do not call prepare_extend_env_parallelism_config",
    )
    refuse_unavailable_engines([request])
    return current_env
