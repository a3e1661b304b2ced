"""The ``accel`` command: ``launch``, ``config``, ``env``, ``test``, ``estimate-memory``.

Every option accepts both spellings, ``--num_processes`` and ``--num-processes``; help shows
the underscore form, as Accelerate's does.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from argparse import SUPPRESS
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .__about__ import __version__
from .arguments import ACCELERATE_LAUNCH_DEFAULTS, record_typed_flags
from .config import (
    find_config_file,
    load_config_from_file,
    update_config_file,
    write_basic_config,
    write_config_from_answers,
)
from .launch import launch_command

__all__ = [
    "ask_on_terminal",
    "build_parser",
    "environment_info",
    "launch_parser",
    "main",
    "selftest",
]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that also accepts ``--some-flag`` for ``--some_flag``."""

    def _normalise(self, args: Sequence[str]) -> list[str]:
        known = {option for action in self._actions for option in action.option_strings}
        takes_value = {
            option
            for action in self._actions
            if action.nargs != 0
            for option in action.option_strings
        }
        out: list[str] = []
        expect_value = False
        items = list(args)
        for index, token in enumerate(items):
            if expect_value:
                out.append(token)
                expect_value = False
                continue
            if not token.startswith("--"):
                if token.startswith("-") or not self._positional_stops():
                    out.append(token)
                    continue
                out.extend(items[index:])  # the script and its own arguments: untouched
                return out
            name, equals, value = token.partition("=")
            spelled = "--" + name[2:].replace("-", "_")
            if spelled in known:
                name = spelled
            out.append(name + equals + value)
            expect_value = not equals and name in takes_value
        return out

    def _positional_stops(self) -> bool:
        return any(action.dest == "training_script" for action in self._actions)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse after turning ``--a-b`` into ``--a_b`` for known options."""
        tokens = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._normalise(tokens), namespace)


def _add_launch(sub: Any) -> None:
    parser = sub.add_parser(
        "launch",
        help="run a training script on one or several processes",
        description="Run a training script on one device, several processes (torchrun) or "
        "several machines. Settings: flags > ACCEL_* environment > config file > defaults. "
        "Options take dashes too: --num-processes is --num_processes.",
    )
    record_typed_flags(parser)  # args.nondefault, as Accelerate's parser keeps it
    _add_general_flags(parser)
    _add_hardware_flags(parser)
    _add_resources_flags(parser)
    _add_paradigm_flags(parser)
    _add_distributed_flags(parser)
    _add_engine_flags(parser)
    _add_refused_flags(parser)
    parser.add_argument("training_script", help="the script (or module with -m) to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    # Accelerate's defaults, for code that reads them; the launcher counts only typed values.
    parser.set_defaults(func=launch_command, **ACCELERATE_LAUNCH_DEFAULTS)


def _add_general_flags(parser: argparse.ArgumentParser) -> None:
    """``accel launch`` options of the launcher itself: config, output, how to start the script."""
    general = parser.add_argument_group("general")
    general.add_argument("--config_file", default=None, help="config file to read")
    general.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no summary, settings table or notes from the launcher; a refusal, a failed "
        "rank and a signal are still reported",
    )
    general.add_argument(
        "--show_settings",
        action="store_true",
        help="print every setting with its source (flag, environment, config file, default); "
        "printed anyway when a rank fails",
    )
    general.add_argument("-m", "--module", action="store_true", help="run a module (python -m)")
    general.add_argument("--no_python", action="store_true", help="run an executable")
    general.add_argument("--debug", action="store_true", default=None, help="debug collectives")
    general.add_argument("--dry_run", action="store_true", help="print the command, run nothing")


def _add_hardware_flags(parser: argparse.ArgumentParser) -> None:
    """``accel launch`` device choice: CPU, GPUs, XLA/TPU."""
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with GPUs")
    hardware.add_argument("--multi_gpu", action="store_true", help="one process per GPU (DDP)")
    hardware.add_argument(
        "--tpu",
        action="store_true",
        help="XLA/TPU: import the script and start its training function on every XLA device "
        "through torch_xla (xmp.spawn)",
    )
    hardware.add_argument(
        "--main_training_function",
        default=None,
        help="with --tpu: the script's function each XLA process calls (default: main)",
    )
    hardware.add_argument(
        "--downcast_bf16",
        action="store_true",
        default=None,
        help="with --tpu and bf16: XLA_DOWNCAST_BF16 (float64 becomes float32) instead of "
        "XLA_USE_BF16",
    )


def _add_resources_flags(parser: argparse.ArgumentParser) -> None:
    """``accel launch`` resources: processes, precision, compilation, which GPUs."""
    resources = parser.add_argument_group("resources")
    resources.add_argument("--mixed_precision", choices=["no", "fp16", "bf16", "fp8"])
    resources.add_argument("--num_processes", type=int, help="processes on all machines")
    resources.add_argument("--num_machines", type=int)
    resources.add_argument("--num_cpu_threads_per_process", type=int)
    resources.add_argument("--gradient_accumulation_steps", type=int)
    resources.add_argument("--dynamo_backend")
    resources.add_argument("--dynamo_mode")
    resources.add_argument("--dynamo_use_fullgraph", action="store_true", default=None)
    resources.add_argument("--dynamo_use_dynamic", action="store_true", default=None)
    resources.add_argument(
        "--dynamo_use_regional_compilation",
        action="store_true",
        default=None,
        help="compile repeated blocks once (torch.compile)",
    )
    resources.add_argument(
        "--gpu_ids", default=None, help="GPUs of this machine to use: 'all' or e.g. '0,2'"
    )
    resources.add_argument(
        "--enable_cpu_affinity",
        action="store_true",
        default=None,
        help="pin each process to the CPUs of its GPU's NUMA node",
    )
    resources.add_argument(
        "--fp8_backend", choices=["ao", "te", "msamp"], default=None, help="ao (torchao) only"
    )


def _add_paradigm_flags(parser: argparse.ArgumentParser) -> None:
    """``accel launch`` engine switches (Megatron-LM is the one refused)."""
    paradigm = parser.add_argument_group(
        "paradigm",
        "FSDP2 (torch 2.6+), DeepSpeed and ParallelismConfig run; Megatron-LM is refused "
        "before any process starts",
    )
    paradigm.add_argument("--use_deepspeed", action="store_true", help="DeepSpeed ZeRO")
    paradigm.add_argument("--use_fsdp", action="store_true", help="FSDP2 (fully_shard)")
    paradigm.add_argument(
        "--use_parallelism_config", action="store_true", help="HSDP, tensor/context parallel"
    )
    paradigm.add_argument("--use_megatron_lm", action="store_true", help="Megatron-LM (refused)")


def _add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """``accel launch`` machines, rendezvous and torchrun's own options."""
    distributed = parser.add_argument_group("distributed")
    distributed.add_argument("--machine_rank", type=int)
    distributed.add_argument("--main_process_ip")
    distributed.add_argument("--main_process_port", type=int)
    distributed.add_argument("--same_network", action="store_true", default=None)
    distributed.add_argument("--rdzv_backend", choices=["static", "c10d", "etcd", "etcd-v2"])
    distributed.add_argument("--rdzv_conf", default=None)
    distributed.add_argument("--rdzv_id", default=None)
    distributed.add_argument("--max_restarts", type=int)
    distributed.add_argument("--monitor_interval", type=float)
    distributed.add_argument(
        "-t",
        "--tee",
        default=None,
        help="torchrun --tee: copy the ranks' output with a rank prefix on each line (by "
        "default the output is shown as the script wrote it, and kept per rank in --log_dir)",
    )
    distributed.add_argument("--log_dir", default=None, help="per-rank logs (default: a temp dir)")
    distributed.add_argument("--role", default=None, help="torchrun --role (the workers' name)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from .engines import DEEPSPEED_KEYS, FSDP_KEYS, PARALLELISM_FLAGS
    from .launch import DEEPSPEED_LAUNCHER_FLAGS

    deepspeed = parser.add_argument_group(
        "DeepSpeed", "with --use_deepspeed; handed to the script as ACCEL_DEEPSPEED_* variables"
    )
    for key in DEEPSPEED_KEYS:
        deepspeed.add_argument(f"--{key.name}", default=None, help=key.help)
    for name in DEEPSPEED_LAUNCHER_FLAGS:
        deepspeed.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    fsdp = parser.add_argument_group(
        "FSDP", "with --use_fsdp; handed to the script as FSDP_* variables"
    )
    for key in FSDP_KEYS:
        fsdp.add_argument(f"--{key.name}", default=None, help=key.help)
    parallelism = parser.add_argument_group(
        "ParallelismConfig",
        "each of these asks for a ParallelismConfig; an sp size above 1 is refused",
    )
    for name in PARALLELISM_FLAGS:
        parallelism.add_argument(f"--{name}", default=None)


def _add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """``accelerate launch`` flags of features accel lacks: parsed, then refused at launch."""
    from .engines import MEGATRON_LM_FLAGS
    from .launch import REFUSED_FLAGS

    switches = {"tpu_cluster", "no_tpu_cluster", "tpu_use_sudo"}
    switches.add("fp8_use_autocast_during_eval")
    listed = {"vm", "env"}  # Accelerate's repeatable options
    refused = parser.add_argument_group(
        "not in this release",
        "Accelerate's flags for TPU pods, SageMaker, mpirun, Megatron-LM and FP8 settings "
        "(FP8 runs through torchao, set up in the script): refused before any process starts",
    )
    for name in REFUSED_FLAGS:
        if name in switches:
            refused.add_argument(f"--{name}", action="store_true", default=None, help=SUPPRESS)
        elif name in listed:
            refused.add_argument(f"--{name}", action="append", default=None, help=SUPPRESS)
        else:
            refused.add_argument(f"--{name}", default=None, help=SUPPRESS)
    for name in MEGATRON_LM_FLAGS:
        refused.add_argument(f"--{name}", default=None, help=SUPPRESS)


def _config_default(args: argparse.Namespace) -> int:
    written = write_basic_config(args.mixed_precision, args.config_file)
    if written is False:
        return 0  # it said the file exists and was kept: nothing to do is not a failure
    print(f"accel config: wrote {written}")
    return 0


def _config_update(args: argparse.Namespace) -> int:
    try:
        path, target, how = update_config_file(args.config_file)
    except (OSError, ValueError) as error:
        print(f"accel config update: {error}", file=sys.stderr)
        return 2
    print(f"accel config update: read {path} ({how}), wrote {target}")
    return 0


def ask_on_terminal(question: str, default: str) -> str:
    """Ask ``question`` on the terminal, showing ``default`` (``accel config``'s ``ask``)."""
    return input(f"{question} [{default}]: ")


def _config_questionnaire(args: argparse.Namespace) -> int:
    try:
        target = write_config_from_answers(ask_on_terminal, args.config_file)
    except (ValueError, EOFError) as error:
        message = str(error) or "the questionnaire ended before its last answer"
        print(f"{message}; nothing was written", file=sys.stderr)
        return 2
    print(f"accel config: wrote {target}")
    return 0


def _add_config(sub: Any) -> None:
    parser = sub.add_parser("config", help="write or update the config file")
    parser.add_argument("--config_file", default=None)
    parser.set_defaults(func=_config_questionnaire)
    actions = parser.add_subparsers(dest="config_action")
    default = actions.add_parser("default", help="write a config for this machine")
    default.add_argument("--config_file", default=None)
    default.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16", "fp8"])
    default.set_defaults(func=_config_default)
    update = actions.add_parser("update", help="rewrite a config file with today's keys")
    update.add_argument("--config_file", default=None)
    update.set_defaults(func=_config_update)


def environment_info(
    config_file: str | None = None, which: Callable[[str], str | None] = shutil.which
) -> dict[str, Any]:
    """What ``accel env`` reports, as Accelerate's ``env_command`` returns it (plus accel's).

    Args:
        config_file: The ``--config_file`` value, or None for the default file.
        which: How to find the ``accel`` executable (``shutil.which``).

    Returns:
        Ordered ``{label: value}``; the config in effect is a dict under
        ``"`accel` default config"`` (or ``"Not found"``).
    """
    import psutil
    import torch

    import accel_state
    from accel_state import imports
    from accel_state.accelerate_alias import alias_status

    accelerator = "N/A"
    for name, probe in (
        ("CUDA", imports.is_cuda_available),
        ("XPU", imports.is_xpu_available),
        ("MLU", imports.is_mlu_available),
        ("SDAA", imports.is_sdaa_available),
        ("MUSA", imports.is_musa_available),
        ("NPU", imports.is_npu_available),
        ("NEURON", imports.is_neuron_available),
        ("MPS", imports.is_mps_available),
    ):
        if probe():
            accelerator = name
            break
    path, how = find_config_file(config_file)
    info: dict[str, Any] = {
        "`accel` version": imports.get_package_version("accel") or "not installed",
        "accel-launch version": __version__,
        "accel-state version": accel_state.__version__,
        "Platform": platform.platform(),
        "`accel` bash location": which("accel") or "Not found",
        "Python version": platform.python_version(),
        "Numpy version": imports.get_package_version("numpy") or "not installed",
        "PyTorch version": torch.__version__,
        "PyTorch accelerator": accelerator,
        "CPU cores": f"{psutil.cpu_count(logical=False)} physical, {os.cpu_count()} logical",
        "System RAM": f"{psutil.virtual_memory().total / 2**30:.2f} GB",
    }
    if accelerator == "CUDA":
        info["GPU type"] = torch.cuda.get_device_name()
    info["`accelerate` alias"] = alias_status().describe()
    info["Config file"] = f"{path if path is not None else 'none'} ({how})"
    info["`accel` default config"] = "Not found"
    if path is not None:
        try:
            info["`accel` default config"] = load_config_from_file(path).to_dict()
        except (ValueError, OSError) as error:  # a report: say what is wrong, show the rest
            info["`accel` default config"] = f"not usable: {error}"
    return info


def _env(args: argparse.Namespace) -> int:
    info = environment_info(args.config_file)
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"- {key}:")
            lines.extend(f"\t- {name}: {item}" for name, item in value.items())
        else:
            lines.append(f"- {key}: {value}")
    print("\n".join(lines))
    return 0


def selftest(config_file: str | None = None) -> int:
    """Run ``accel test``'s 2-process self-check; return its exit code."""
    from .launch import launch_command as run

    script = Path(__file__).with_name("selftest.py")
    argv = ["launch", "--cpu", "--num_processes", "2", "--quiet"]
    if config_file:
        argv = ["launch", "--config_file", config_file, "--quiet"]
    namespace = build_parser().parse_args([*argv, str(script)])
    code = run(namespace)
    if code == 0:
        print("Test is a success! You are ready for your distributed training!")
    else:
        print(f"accel test: the 2-process self-check failed (exit code {code}); see above")
    return code


def _test(args: argparse.Namespace) -> int:
    return selftest(args.config_file)


def launch_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``accel launch`` parser on its own, or added to ``subparsers``."""
    if subparsers is None:
        subparsers = _Parser(prog="accel").add_subparsers(parser_class=_Parser)
    _add_launch(subparsers)
    parser: argparse.ArgumentParser = subparsers.choices["launch"]
    return parser


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate_command

    try:
        print(estimate_command(args.model, args.dtypes))
    except (FileNotFoundError, ValueError) as error:
        print(f"accel estimate-memory: {error}", file=sys.stderr)
        return 2
    return 0


def _add_estimate(sub: Any) -> None:
    from .estimate import DTYPES

    parser = sub.add_parser(
        "estimate-memory",
        help="memory a local model needs per dtype (no model hub)",
        description="Estimate the memory to load and train a model, per dtype, without "
        "loading it: from the headers of local safetensors files, or from a module:callable "
        "built on the meta device.",
    )
    parser.add_argument(
        "model",
        help="a .safetensors file, a *.safetensors.index.json, a folder holding them, or "
        "module:callable building the model (called without arguments on the meta device)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=list(DTYPES),
        help="the dtypes to show (default: all)",
    )
    parser.set_defaults(func=_estimate)


class _PrintVersion(argparse.Action):
    """``--version``: one unwrapped line on stdout, then exit 0."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version_line())
        parser.exit(0)


def _version_line() -> str:
    """``accel <version> (<each installed accel distribution> <version>, ...)``."""
    from importlib import metadata

    parts = []
    for name in ("accel-state", "accel-data", "accel-amp", "accel-bigmodel", "accel-launch"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    try:
        head = f"accel {metadata.version('accel')}"
    except metadata.PackageNotFoundError:
        head = f"accel-launch {__version__} (the accel package is not installed)"
        return head if not parts else f"{head}; {', '.join(parts)}"
    return f"{head} ({', '.join(parts)})"


def build_parser() -> argparse.ArgumentParser:
    """The ``accel`` argument parser with its subcommands."""
    parser = _Parser(prog="accel", description="accel command line")
    parser.add_argument(
        "--version", action=_PrintVersion, nargs=0, help="print accel's version and exit"
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_launch(sub)
    _add_config(sub)
    env = sub.add_parser("env", help="print versions, devices and the config in effect")
    env.add_argument("--config_file", default=None)
    env.set_defaults(func=_env)
    test = sub.add_parser("test", help="run a 2-process self-check through the launcher")
    test.add_argument("--config_file", default=None)
    test.set_defaults(func=_test)
    _add_estimate(sub)
    _add_installed_commands(sub)
    return parser


#: Entry-point group through which installed packages (accel) add ``accel`` subcommands.
COMMANDS_GROUP = "accel.commands"


def _installed_commands() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {entry.name: entry for entry in entry_points(group=COMMANDS_GROUP)}


def _add_installed_commands(sub: Any) -> None:
    """List the subcommands of installed packages (``accel merge-weights`` ...) in the help.

    Each entry point names a parser factory ``factory(subparsers=None) -> ArgumentParser``
    whose parsed arguments carry ``func(args)``, which returns an exit code or None (0) and
    raises for a bad request as Accelerate's functions do. accel-launch cannot import accel,
    so :func:`main` finds the command through its entry point and imports it only when it
    runs, and turns the errors into one line and an exit code.
    """
    for name, entry in sorted(_installed_commands().items()):
        sub.add_parser(name, add_help=False, help=f"from {entry.value.split('.')[0]}")


def _run_installed(entry: Any, arguments: Sequence[str]) -> int:
    parser = entry.load()(None)
    parsed = parser.parse_args(list(arguments))
    try:
        code = parsed.func(parsed)
    except subprocess.CalledProcessError as error:  # the command it ran failed
        print(f"accel {entry.name}: {error}", file=sys.stderr)
        return int(error.returncode) or 1
    except (ValueError, OSError) as error:  # a bad request: missing or existing files, values
        print(f"accel {entry.name}: {error}", file=sys.stderr)
        return 2
    return 0 if code is None else int(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accel`` command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments:
        installed = _installed_commands().get(arguments[0])
        if installed is not None:
            return _run_installed(installed, arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args))
