"""``accel launch``: resolve the settings, then run the script on torchrun (or directly).

One process on one machine runs the script as a child process. Anything more is delegated
to ``torch.distributed.run`` (torchrun) in this process: accel writes no rendezvous of its
own. An XLA run (``--tpu``) starts :mod:`accel_launch.xla_spawn` as the child process
instead. What accel adds is the resolution (flags > environment > config file > defaults,
printed with the source of each value), checks that fail before any process starts, and one
last line naming the rank that failed, how, and where its log is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel_state.accelerate_alias import accelerate_spellings, alias_status
from accel_state.engine_requests import (
    EngineRequest,
    EngineUnavailableError,
    accelerate_switch,
    refuse_unavailable_engines,
)
from accel_state.environment import (
    ACCEL_CPU_AFFINITY,
    ACCEL_DEBUG_MODE,
    ACCEL_DOWNCAST_BF16,
    ACCEL_DYNAMO_BACKEND,
    ACCEL_DYNAMO_MODE,
    ACCEL_DYNAMO_USE_DYNAMIC,
    ACCEL_DYNAMO_USE_FULLGRAPH,
    ACCEL_DYNAMO_USE_REGIONAL_COMPILATION,
    ACCEL_GRADIENT_ACCUMULATION_STEPS,
    ACCEL_MIXED_PRECISION,
    ACCEL_USE_CPU,
    ACCEL_USE_PARALLELISM_CONFIG,
)
from accel_state.topology import SlurmStep, get_free_port, get_slurm_step

from .arguments import typed_arguments
from .config import HOW_EXPLICIT, ClusterConfig, find_config_file, load_config_from_file
from .engines import (
    DEEPSPEED_KEYS,
    FSDP_KEYS,
    MEGATRON_LM_FLAGS,
    PARALLELISM_FLAGS,
    engine_environment,
    engine_switch_names,
    launch_engine_requests,
    parallelism_environment,
    resolve_engine_settings,
)
from .relay import OutputRelay
from .settings import (
    LAUNCH_KEYS,
    Setting,
    format_settings_summary,
    format_settings_table,
    resolve_launch_settings,
)

__all__ = [
    "LaunchError",
    "check_launch_flags",
    "detected_devices",
    "launch_command",
    "launch_config_file",
    "plan_launch",
    "process_environment",
    "run_launch",
    "script_command",
]

#: The environment switches that ask for a ParallelismConfig (accel's and Accelerate's names).
_LAYOUT_SWITCHES = frozenset(
    {ACCEL_USE_PARALLELISM_CONFIG, accelerate_switch(ACCEL_USE_PARALLELISM_CONFIG)}
)


#: DeepSpeed's own multi-machine launcher options (accepted by the parser to be refused).
DEEPSPEED_LAUNCHER_FLAGS = (
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
    "deepspeed_multinode_launcher",
)


_TPU = (
    "TPU pod launching (gcloud on every VM), which accel does not build: run "
    "`accel launch --tpu` on each TPU VM"
)
_TORCHAO_ONLY = "accel drives FP8 through torchao only"
_TE = (
    f"a Transformer Engine FP8 setting, and {_TORCHAO_ONLY} "
    "(mixed_precision fp8 with AORecipeKwargs)"
)
_MPIRUN = (
    "accel does not start processes with mpirun: run `accel launch` on each machine with "
    "--num_machines, --machine_rank, --main_process_ip and --main_process_port (or under srun)"
)
#: Flags of ``accelerate launch`` whose feature accel lacks, with the reason for refusing.
REFUSED_FLAGS: dict[str, str] = {
    "tpu_cluster": f"it asks for {_TPU}",
    "no_tpu_cluster": f"it applies to {_TPU}",
    "tpu_use_sudo": f"it applies to {_TPU}",
    "vm": f"it applies to {_TPU}",
    "env": f"it sets variables on TPU pod VMs, for {_TPU}",
    "aws_access_key_id": "it is for Amazon SageMaker launching, which accel does not implement",
    "aws_secret_access_key": "it is for Amazon SageMaker launching, which accel does not implement",
    "mpirun_hostfile": _MPIRUN,
    "fp8_use_autocast_during_eval": f"it is {_TE}",
    "fp8_margin": f"it is {_TE}",
    "fp8_interval": f"it is {_TE}",
    "fp8_format": f"it is {_TE}",
    "fp8_amax_history_len": f"it is {_TE}",
    "fp8_amax_compute_algo": f"it is {_TE}",
    "fp8_override_linear_precision": f"it is {_TE}",
    "fp8_opt_level": "it is an MS-AMP setting, and accel drives FP8 through torchao only",
    "fp8_pad_inner_dim": (
        "accel takes torchao's settings in the script: "
        "AORecipeKwargs(config=Float8LinearConfig(pad_inner_dim=...))"
    ),
    "fp8_enable_fsdp_float8_all_gather": (
        "it asks for float8 all-gathers under FSDP2, which accel does not build: its FSDP2 "
        "engine does not convert the model to torchao's float8 linears (mixed_precision fp8 "
        "computes in bf16 there)"
    ),
}


class LaunchError(ValueError, RuntimeError):
    """A launch that cannot start: the message says what to change.

    A ``ValueError``, as Accelerate's ``launch_command`` raises for flags and config files it
    refuses; also a ``RuntimeError``, which it was in earlier releases of accel.
    """


def detected_devices() -> int:
    """How many CUDA (else XPU) devices this machine has: the processes a launch defaults to."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.device_count())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return int(xpu.device_count())
    return 0


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_launch_flags(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or that accel does not implement.

    Checks ``args`` as typed (see :func:`accel_launch.arguments.typed_arguments`): at most one
    of ``--cpu``, ``--multi_gpu``, ``--tpu``, ``--use_deepspeed``, ``--use_fsdp``,
    ``--use_megatron_lm``; ``--multi_gpu`` with at least 2 processes; none of the flags of
    features accel lacks (:data:`REFUSED_FLAGS`, ``--fp8_backend`` other than ``ao``,
    DeepSpeed's own launcher options).

    Raises:
        LaunchError: the first problem found, naming the flags and the fix.
    """
    chosen = [
        flag
        for flag in ("cpu", "multi_gpu", "tpu", "use_deepspeed", "use_fsdp", "use_megatron_lm")
        if getattr(args, flag, False)
    ]
    if len(chosen) > 1:
        raise LaunchError(
            "accel launch: choose at most one of "
            + ", ".join(f"--{flag}" for flag in chosen)
            + " (they select different ways of running the processes)"
        )
    processes = getattr(args, "num_processes", None)
    if getattr(args, "multi_gpu", False) and processes is not None and int(processes) < 2:
        raise LaunchError(
            f"accel launch --multi_gpu --num_processes {processes}: you need to use at least 2 "
            "processes to use `--multi_gpu` (one per GPU); pass --num_processes 2 or more, or "
            "drop --multi_gpu to run one process"
        )
    refused = [
        f"--{flag}: {reason}"
        for flag, reason in REFUSED_FLAGS.items()
        if getattr(args, flag, None) not in (None, False)
    ]
    backend = getattr(args, "fp8_backend", None)
    if backend not in (None, "ao"):
        refused.append(f"--fp8_backend {backend}: {_TORCHAO_ONLY} (--fp8_backend ao, the default)")
    if refused:
        raise LaunchError(
            "accel launch: refused before starting anything:\n  "
            + "\n  ".join(refused)
            + "\ndrop these flags"
        )
    for flag in DEEPSPEED_LAUNCHER_FLAGS:
        if getattr(args, flag, None) is not None:
            raise LaunchError(
                f"accel launch --{flag}={getattr(args, flag)!r}: accel starts DeepSpeed runs "
                "with torchrun, one `accel launch` per machine, not with DeepSpeed's own "
                "launchers: drop it and pass --num_machines, --machine_rank, "
                "--main_process_ip and --main_process_port on each machine"
            )


def launch_config_file(
    args: argparse.Namespace,
) -> tuple[ClusterConfig | None, Path | None, str]:
    """The config file a launch reads: ``(config or None, its path, how it was found)``.

    ``--config_file``, else the default file; with ``--cpu`` only a file given with
    ``--config_file`` is read (as Accelerate does).

    Raises:
        FileNotFoundError: ``--config_file`` names a missing file or a directory.
        PermissionError: the file cannot be read by this user.
        ValueError: the file cannot be read as a config.
    """
    path, how = find_config_file(getattr(args, "config_file", None))
    if path is None or (getattr(args, "cpu", False) and how != HOW_EXPLICIT):
        return None, path, how
    return load_config_from_file(path), path, how


def _check_config_file(args: argparse.Namespace, config: ClusterConfig, path: Path) -> None:
    """Refuse what a config file asks for that the matching flag would be refused for."""
    refused = []
    hostfile = config.mpirun_config.get("mpirun_hostfile")
    if hostfile:
        refused.append(f"mpirun_config.mpirun_hostfile={hostfile!r}: {_MPIRUN}")
    backend = config.fp8_config.get("backend")
    if getattr(args, "fp8_backend", None) is None and backend not in (None, False, ""):
        if str(backend).strip().upper() not in ("AO", "NO"):
            refused.append(
                f"fp8_config.backend={backend!r}: {_TORCHAO_ONLY} (backend: AO, or leave the "
                "key out)"
            )
    if refused:
        raise LaunchError(
            f"accel launch: refused before starting anything, by the config file {path}:\n  "
            + "\n  ".join(refused)
            + "\nremove these keys from the file (the matching flags are refused too)"
        )


def _refuse_missing_engines(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    config: ClusterConfig | None,
    config_path: str | None,
) -> list[EngineRequest]:
    """Stop before anything starts when the launch asks for an engine this release lacks."""
    flags = {
        name: getattr(args, name, None)
        for name in ("use_fsdp", "use_deepspeed", "use_megatron_lm", "use_parallelism_config")
    }
    flags.update(
        {name: getattr(args, name, None) for name in (*PARALLELISM_FLAGS, *MEGATRON_LM_FLAGS)}
    )
    flags.update({name: getattr(args, name, False) for name in ("tpu", "cpu", "multi_gpu")})
    try:
        requests = launch_engine_requests(flags, environ, config, config_path)
        refuse_unavailable_engines(requests)
    except (EngineUnavailableError, ValueError) as error:
        raise LaunchError(f"accel launch: {error}") from error
    return requests


def _xla_checks(args: argparse.Namespace, requests: list[EngineRequest]) -> bool:
    """Whether the launch is an XLA one (``--tpu``, ``distributed_type: XLA``); refuse misuse."""
    xla = [request for request in requests if request.engine == "xla"]
    if not xla:
        for flag in ("downcast_bf16", "main_training_function"):
            if getattr(args, flag, None):
                raise LaunchError(
                    f"accel launch --{flag}: it applies to XLA runs only (--tpu); drop it or "
                    "add --tpu"
                )
        return False
    others = [request for request in requests if request.engine != "xla"]
    if others:
        raise LaunchError(
            f"accel launch: {xla[0].source} asks for XLA, where accel trains replicated data "
            f"parallel only, and {others[0].source} asks for {others[0].engine} too; "
            f"{others[0].undo}"
        )
    if args.no_python:
        raise LaunchError(
            "accel launch --tpu --no_python: the XLA launcher imports a Python script and calls "
            "its training function; drop --no_python"
        )
    return True


def _xla_command(args: argparse.Namespace, config: ClusterConfig | None) -> list[str]:
    """``python -m accel_launch.xla_spawn ...`` (see :mod:`accel_launch.xla_spawn`)."""
    command = [sys.executable, "-m", "accel_launch.xla_spawn"]
    if getattr(args, "num_processes", None) == 1:
        command += ["--nprocs", "1"]
    if args.module:
        command.append("--module")
    function = getattr(args, "main_training_function", None) or (
        config.main_training_function if config is not None else "main"
    )
    return [*command, function, args.training_script, *args.training_script_args]


def _script_checks(args: argparse.Namespace) -> None:
    if args.module or args.no_python:
        return
    if not Path(args.training_script).is_file():
        raise LaunchError(
            f"accel launch: the training script {args.training_script!r} does not exist "
            "(use -m for a module, --no_python for an executable)"
        )


def process_environment(settings: Mapping[str, Setting]) -> dict[str, str]:
    """The ``ACCEL_*`` contract the Accelerator in the script reads, from resolved settings."""
    env = {
        ACCEL_MIXED_PRECISION: str(settings["mixed_precision"].value),
        ACCEL_USE_CPU: "true" if settings["use_cpu"].value else "false",
    }
    steps = settings["gradient_accumulation_steps"].value
    if steps is not None:
        env[ACCEL_GRADIENT_ACCUMULATION_STEPS] = str(steps)
    backend = settings["dynamo_backend"].value
    if backend is not None and str(backend).lower() != "no":
        env[ACCEL_DYNAMO_BACKEND] = str(backend).upper()
        env[ACCEL_DYNAMO_MODE] = str(settings["dynamo_mode"].value or "default")
        env[ACCEL_DYNAMO_USE_FULLGRAPH] = str(bool(settings["dynamo_use_fullgraph"].value))
        env[ACCEL_DYNAMO_USE_DYNAMIC] = str(bool(settings["dynamo_use_dynamic"].value))
        env[ACCEL_DYNAMO_USE_REGIONAL_COMPILATION] = str(
            bool(settings["dynamo_use_regional_compilation"].value)
        )
    if settings["debug"].value:
        env[ACCEL_DEBUG_MODE] = "true"
    if settings["enable_cpu_affinity"].value:
        env[ACCEL_CPU_AFFINITY] = "true"
    if settings["gpu_ids"].value != "all":
        env["CUDA_VISIBLE_DEVICES"] = str(settings["gpu_ids"].value)
    threads = settings["num_cpu_threads_per_process"].value
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """Resolve everything a launch needs without starting anything (``--dry_run`` prints it).

    Returns a dict with ``settings`` (name -> Setting), ``config_note``, ``srun_note`` (set
    when this launcher is one task of an ``srun`` step that starts several tasks per node:
    each task then runs the script directly as one process), ``env`` (the variables the
    processes get), and ``command`` (``["torchrun-args", ...]``, or the direct command line,
    the XLA launcher's included).

    Raises:
        LaunchError: conflicting flags, a missing script, a busy port, bad values, or an
            engine this release does not implement or the installed torch cannot run (from a
            flag, the environment or the config file).
    """
    args = typed_arguments(args)
    check_launch_flags(args)
    _script_checks(args)
    config, path, how = launch_config_file(args)
    source = f"config {path}" if config is not None else None
    if config is not None and path is not None:
        _check_config_file(args, config, path)
    requests = _refuse_missing_engines(
        args, environ, config, str(path) if config is not None else None
    )
    on_xla = _xla_checks(args, requests)
    flags = {key: getattr(args, key, None) for key in LAUNCH_KEYS}
    if args.cpu:
        flags["use_cpu"] = True
    try:
        settings = resolve_launch_settings(flags, environ, config, source, detected_devices())
        engine = resolve_engine_settings(_engine_flags(args), environ, config, source)
        step = get_slurm_step(environ)
    except ValueError as error:
        raise LaunchError(f"accel launch: {error}") from error
    note = ""
    if config is not None and how != HOW_EXPLICIT:
        note = f"using the config file {path} ({how}); pass --config_file to choose another"
    processes = int(settings["num_processes"].value)
    machines = int(settings["num_machines"].value)  # a divisor: resolve_launch_settings checks
    env = {**process_environment(settings), **engine_environment(engine, config)}
    if engine["engine"].value == "none":
        # A paradigm flag (--cpu, --multi_gpu) outranks an engine switch set in this shell:
        # the processes must not read the switch and ask for the engine themselves.
        # A ParallelismConfig switch is a layout, not an engine: without a paradigm flag it
        # still asks (the processes read it), as launch_engine_requests counts it.
        paradigm = bool(args.cpu or getattr(args, "multi_gpu", False))
        env.update(
            {
                name: "false"
                for name in engine_switch_names()
                if name in environ and (paradigm or name not in _LAYOUT_SWITCHES)
            }
        )
    else:
        settings = {**settings, **engine}
    # Combines with any engine (FSDP2 shards over its mesh): after the switches above.
    parallel_flags = {name: getattr(args, name, None) for name in PARALLELISM_FLAGS}
    parallel_flags.update(
        {name: getattr(args, name, None) for name in ("use_parallelism_config", "cpu", "multi_gpu")}
    )
    try:
        env.update(parallelism_environment(parallel_flags, config))
    except ValueError as error:
        raise LaunchError(f"accel launch: {error}") from error
    env.update(_accelerate_spellings(env, environ))
    plan: dict[str, Any] = {"settings": settings, "config_note": note, "srun_note": "", "env": env}
    if on_xla:
        env[ACCEL_USE_CPU] = "false"  # the processes run on the XLA device
        if getattr(args, "downcast_bf16", None) or (config is not None and config.downcast_bf16):
            env[ACCEL_DOWNCAST_BF16] = "true"
        return {**plan, "command": _xla_command(args, config)}
    if step is not None and step.tasks_are_processes:
        _check_srun_step(step, settings)
        env["MASTER_ADDR"] = str(settings["main_process_ip"].value)
        env["MASTER_PORT"] = str(settings["main_process_port"].value)
        plan["srun_note"] = (
            f"srun task {step.task_rank} of {step.num_tasks} (SLURM_PROCID): running the script "
            "directly as that process; srun starts the others"
        )
        return {**plan, "command": script_command(args)}
    if processes == 1 and machines == 1:
        return {**plan, "command": script_command(args)}
    if args.tee is None and "PYTHONUNBUFFERED" not in environ:
        env["PYTHONUNBUFFERED"] = "1"  # relayed output shows up as it is printed
    return {**plan, "command": _torchrun_args(args, settings, processes // machines, machines)}


def _accelerate_spellings(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Accelerate's names for the ``ACCEL_*`` variables the processes get, where they matter.

    Where ``accelerate`` is accel's alias, transformers in the processes reads Accelerate's names
    (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_USE_FSDP``, ...): all
    are given. Elsewhere only those this shell already sets are overwritten, so that the two
    spellings never disagree in the processes (accel reads both).
    """
    spellings = accelerate_spellings(env)
    if alias_status().active:
        return spellings
    return {name: value for name, value in spellings.items() if name in environ}


def _engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine and its settings as the command line gives them (None: not given)."""
    flags: dict[str, Any] = {
        key.name: getattr(args, key.name, None) for key in (*DEEPSPEED_KEYS, *FSDP_KEYS)
    }
    if getattr(args, "use_deepspeed", False):
        flags["engine"] = "deepspeed"
    elif getattr(args, "use_fsdp", False):
        flags["engine"] = "fsdp"
    elif args.cpu or getattr(args, "multi_gpu", False):
        flags["engine"] = "none"  # a paradigm flag was given: no engine from env or config
    return flags


def _check_srun_step(step: SlurmStep, settings: Mapping[str, Setting]) -> None:
    """Several srun tasks per node are the processes themselves: the counts must agree."""
    for key, expected, what, variable in (
        ("num_processes", step.num_tasks, "tasks", step.sources["num_tasks"]),
        ("num_machines", step.num_nodes, "nodes", step.sources["num_nodes"]),
    ):
        item = settings[key]
        if item.value != expected:
            raise LaunchError(
                f"accel launch: {key}={item.value} (from {item.source}) disagrees with this srun "
                f"step, which has {expected} {what} ({variable}): "
                "each srun task is one process when srun starts several per node; drop "
                f"--{key}, or start one task per node (srun --ntasks-per-node 1) and let "
                "accel launch start the processes of each node"
            )


def script_command(args: argparse.Namespace) -> list[str]:
    """The command line that runs ``args.training_script`` as one process.

    ``python script args...``, ``python -m module args...`` (``--module``) or ``script args...``
    (``--no_python``); ``python`` is this interpreter.
    """
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    if args.module:
        return [sys.executable, "-m", args.training_script, *args.training_script_args]
    return [sys.executable, args.training_script, *args.training_script_args]


def _torchrun_args(
    args: argparse.Namespace, settings: Mapping[str, Setting], per_node: int, machines: int
) -> list[str]:
    port = settings["main_process_port"].value
    address = settings["main_process_ip"].value
    backend = str(settings["rdzv_backend"].value or "static")
    if machines == 1:
        address = address or "127.0.0.1"
        if port is None or int(port) == 0:
            port = get_free_port()  # one machine: nobody else needs to know the port
        elif not _port_is_free(int(port)):
            raise LaunchError(
                f"accel launch: main_process_port={port} ({settings['main_process_port'].source}) "
                "is already in use on this machine; pass another port, or omit it to let accel "
                "pick a free one"
            )
    elif address is None or port is None:
        raise LaunchError(
            "accel launch: a multi-machine run needs --main_process_ip and --main_process_port "
            "(the address every machine can reach, and a free port on it)"
        )
    command = [
        "--nnodes",
        str(machines),
        "--nproc_per_node",
        str(per_node),
        "--max_restarts",
        str(settings["max_restarts"].value or 0),
        "--monitor_interval",
        str(settings["monitor_interval"].value or 0.1),
    ]
    if backend == "static":
        command += [
            "--rdzv_backend",
            "static",
            "--node_rank",
            str(settings["machine_rank"].value or 0),
            "--master_addr",
            str(address),
            "--master_port",
            str(port),
        ]
    else:
        command += [
            "--rdzv_backend",
            backend,
            "--rdzv_endpoint",
            f"{address}:{port}",
            "--rdzv_id",
            str(args.rdzv_id or "accel"),
        ]
        if machines > 1:
            command += ["--node_rank", str(settings["machine_rank"].value or 0)]
    if args.rdzv_conf:
        command += ["--rdzv_conf", args.rdzv_conf]
    if getattr(args, "role", None):
        command += ["--role", args.role]
    log_dir = args.log_dir or os.path.join(
        tempfile.gettempdir(), "accel-launch", uuid.uuid4().hex[:12]
    )
    command += ["--log_dir", log_dir]
    # Asked for: torchrun's own copy to the terminal, each line prefixed with its rank.
    # Otherwise the ranks write to their log files only and OutputRelay copies them unchanged.
    command += ["--tee", str(args.tee)] if args.tee is not None else ["--redirects", "3"]
    if args.module:
        command.append("--module")
    if args.no_python:
        command.append("--no_python")
    command += [args.training_script, *args.training_script_args]
    return command


def _describe_failure(error: BaseException, log_dir: str | None) -> str:
    """One line: which rank failed first, how, and where its output was logged."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return f"accel launch: the run failed: {error}"
    # The agent stops the surviving ranks with SIGTERM; they are reported as failures too.
    causes = {
        rank: failure
        for rank, failure in failures.items()
        if getattr(failure, "exitcode", None) != -signal.SIGTERM
    } or failures
    rank = min(causes, key=lambda r: (getattr(causes[r], "timestamp", 0), r))
    failure = causes[rank]
    code = int(getattr(failure, "exitcode", 1) or 1)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    where = ""
    if log_dir is not None:
        local = getattr(failure, "local_rank", rank)
        folders = sorted(
            Path(log_dir).glob(f"*/attempt_*/{local}"), key=lambda p: p.stat().st_mtime
        )
        where = f"; its log: {folders[-1]}" if folders else f"; logs under {log_dir}"
    others = len(causes) - 1
    extra = f" ({others} other rank(s) failed too)" if others > 0 else ""
    return f"accel launch: rank {rank} {how}{extra}; every other rank was stopped{where}"


def launch_command(args: argparse.Namespace) -> int:
    """Run ``accel launch``; return the exit code (2, with the reason, when it is refused)."""
    try:
        return run_launch(args)
    except (ValueError, OSError) as error:  # LaunchError is a ValueError; an unreadable file
        print(str(error), file=sys.stderr)
        return 2


def run_launch(args: argparse.Namespace) -> int:
    """Plan the launch of ``args`` and run it (or print it with ``--dry_run``).

    Returns:
        The run's exit code: the script's (one process), 1 when a rank failed, ``128 + n``
        after signal ``n``, 130 after Ctrl-C; 0 for a dry run.

    Raises:
        LaunchError: the launch is refused (see :func:`plan_launch`); nothing was started.
        FileNotFoundError: ``--config_file`` names a missing file or a directory.
        PermissionError: the config file cannot be read by this user.
        ValueError: the config file cannot be read (not YAML or JSON, unknown keys, bad
            values).
    """
    plan = plan_launch(args, os.environ)
    table = format_settings_table(plan["settings"])
    if not args.quiet:
        if getattr(args, "show_settings", False) or getattr(args, "dry_run", False):
            print(table, file=sys.stderr)
        else:
            print(format_settings_summary(plan["settings"]), file=sys.stderr)
        if plan["config_note"]:
            print(f"accel launch: {plan['config_note']}", file=sys.stderr)
        if plan.get("srun_note"):
            print(f"accel launch: {plan['srun_note']}", file=sys.stderr)
    if getattr(args, "dry_run", False):
        print(" ".join(plan["command"]))
        return 0
    env = {**os.environ, **plan["env"]}
    if plan["command"] and plan["command"][0] != "--nnodes":
        return _run_direct(plan["command"], env)
    return _run_torchrun(plan["command"], plan["env"], None if args.quiet else table)


def _run_direct(command: list[str], env: dict[str, str]) -> int:
    child = subprocess.Popen(command, env=env)
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        return child.wait()


def _run_torchrun(
    torchrun_args: list[str], env: Mapping[str, str], table: str | None = None
) -> int:
    """Run torchrun in this process; on a failed rank print ``table`` and the failure line."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    log_dir = torchrun_args[torchrun_args.index("--log_dir") + 1]
    relay = OutputRelay(log_dir) if "--redirects" in torchrun_args else contextlib.nullcontext()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with relay:
            torchrun.run(torchrun.get_args_parser().parse_args(torchrun_args))
    except ChildFailedError as error:
        if table is not None:
            print(table, file=sys.stderr)
        print(_describe_failure(error, log_dir), file=sys.stderr)
        return 1
    except SignalException as error:
        print(
            f"accel launch: received {signal.Signals(error.sigval).name}; every rank was stopped",
            file=sys.stderr,
        )
        return 128 + int(error.sigval)
    except KeyboardInterrupt:
        print("accel launch: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0
