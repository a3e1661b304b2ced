"""The ``accel`` command: ``launch``, ``config``, ``env``, ``test``, ``estimate-memory``.

Every option accepts both spellings, ``--num_processes`` and ``--num-processes``; help shows
the underscore form, as Accelerate's does.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .__about__ import __version__
from .config import (
    default_config_path,
    find_config_file,
    load_config_from_file,
    write_basic_config,
)
from .launch import launch_command

__all__ = ["build_parser", "main"]


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
        "several machines. Settings: flags > ACCEL_* environment > config file > defaults.",
    )
    general = parser.add_argument_group("general")
    general.add_argument("--config_file", default=None, help="config file to read")
    general.add_argument("-q", "--quiet", action="store_true", help="do not print settings")
    general.add_argument("-m", "--module", action="store_true", help="run a module (python -m)")
    general.add_argument("--no_python", action="store_true", help="run an executable")
    general.add_argument("--debug", action="store_true", default=None, help="debug collectives")
    general.add_argument("--dry_run", action="store_true", help="print the command, run nothing")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with GPUs")
    hardware.add_argument("--multi_gpu", action="store_true", help="one process per GPU (DDP)")
    hardware.add_argument(
        "--tpu", action="store_true", help="XLA/TPU: refused, not implemented in this release"
    )
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
    paradigm = parser.add_argument_group(
        "paradigm", "engines besides DDP: refused before any process starts in this release"
    )
    paradigm.add_argument("--use_deepspeed", action="store_true", help="DeepSpeed ZeRO")
    paradigm.add_argument("--use_fsdp", action="store_true", help="FSDP")
    paradigm.add_argument(
        "--use_parallelism_config", action="store_true", help="HSDP, tensor/context parallel"
    )
    paradigm.add_argument("--use_megatron_lm", action="store_true", help="Megatron-LM")
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
    distributed.add_argument("-t", "--tee", default=None, help="torchrun --tee (default 3)")
    distributed.add_argument("--log_dir", default=None, help="per-rank logs (default: a temp dir)")
    _add_engine_flags(parser)
    parser.add_argument("training_script", help="the script (or module with -m) to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=launch_command)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from .engines import DEEPSPEED_KEYS, FSDP_KEYS, PARALLELISM_FLAGS
    from .launch import _DEEPSPEED_LAUNCHER_FLAGS

    deepspeed = parser.add_argument_group(
        "DeepSpeed", "with --use_deepspeed; handed to the script as ACCEL_DEEPSPEED_* variables"
    )
    for key in DEEPSPEED_KEYS:
        deepspeed.add_argument(f"--{key.name}", default=None, help=key.help)
    for name in _DEEPSPEED_LAUNCHER_FLAGS:
        deepspeed.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    fsdp = parser.add_argument_group(
        "FSDP", "with --use_fsdp; handed to the script as FSDP_* variables"
    )
    for key in FSDP_KEYS:
        fsdp.add_argument(f"--{key.name}", default=None, help=key.help)
    parallelism = parser.add_argument_group(
        "ParallelismConfig", "each of these asks for a ParallelismConfig (refused)"
    )
    for name in PARALLELISM_FLAGS:
        parallelism.add_argument(f"--{name}", default=None)


def _config_default(args: argparse.Namespace) -> int:
    written = write_basic_config(args.mixed_precision, args.config_file)
    if written is False:
        return 1
    print(f"accel config: wrote {written}")
    return 0


def _config_update(args: argparse.Namespace) -> int:
    path, how = find_config_file(args.config_file)
    if path is None:
        print("accel config update: no config file found; run `accel config default`")
        return 1
    config = load_config_from_file(path)
    target = Path(args.config_file) if args.config_file else default_config_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    config.to_yaml_file(target)
    print(f"accel config update: read {path} ({how}), wrote {target}")
    return 0


def _config_questionnaire(args: argparse.Namespace) -> int:
    from .config import ClusterConfig
    from .engines import resolve_engine_settings
    from .questionnaire import ask_config

    target = Path(args.config_file) if args.config_file else default_config_path()

    def ask(question: str, default: str) -> str:
        return input(f"{question} [{default}]: ")

    try:
        data = ask_config(ask)
        config = ClusterConfig.from_dict(data, source="accel config")
        resolve_engine_settings({}, {}, config, "accel config")  # contradictions, bad values
    except (ValueError, EOFError) as error:
        message = str(error) or "the questionnaire ended before its last answer"
        print(f"{message}; nothing was written", file=sys.stderr)
        return 2
    target.parent.mkdir(parents=True, exist_ok=True)
    config.to_yaml_file(target)
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


def _env(args: argparse.Namespace) -> int:
    import psutil
    import torch

    import accel_state

    path, how = find_config_file(args.config_file)
    lines = [
        f"- accel-launch version: {__version__}",
        f"- accel-state version: {accel_state.__version__}",
        f"- Platform: {platform.platform()}",
        f"- Python version: {platform.python_version()}",
        f"- PyTorch version: {torch.__version__}",
        f"- CUDA available: {torch.cuda.is_available()} ({torch.cuda.device_count()} device(s))",
        f"- CPU cores: {psutil.cpu_count(logical=False)} physical, {os.cpu_count()} logical",
        f"- System RAM: {psutil.virtual_memory().total / 2**30:.2f} GiB",
        f"- Config file: {path if path is not None else 'none'} ({how})",
    ]
    if path is not None:
        for key, value in load_config_from_file(path).to_dict().items():
            lines.append(f"\t- {key}: {value}")
    print("\n".join(lines))
    return 0


def _test(args: argparse.Namespace) -> int:
    from .launch import launch_command as run

    script = Path(__file__).with_name("selftest.py")
    argv = ["launch", "--cpu", "--num_processes", "2", "--quiet"]
    if args.config_file:
        argv = ["launch", "--config_file", args.config_file, "--quiet"]
    namespace = build_parser().parse_args([*argv, str(script)])
    code = run(namespace)
    if code == 0:
        print("Test is a success! You are ready for your distributed training!")
    else:
        print(f"accel test: the 2-process self-check failed (exit code {code}); see above")
    return code


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


def build_parser() -> argparse.ArgumentParser:
    """The ``accel`` argument parser with its subcommands."""
    parser = _Parser(prog="accel", description="accel command line")
    parser.add_argument("--version", action="version", version=f"accel-launch {__version__}")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accel`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args))
