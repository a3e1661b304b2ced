"""Launch settings: one precedence rule, and the source of every value.

``accel launch`` resolves each setting it needs with one rule, the same for all of them:

    command-line flag  >  environment variable  >  config file  >  default

Under ``srun`` the job step's variables count as environment variables: the number of nodes,
this node's index and the rendezvous address and port (and, when srun starts several tasks per
node, the number of processes: each task is one process).

:func:`resolve_launch_settings` returns every value together with where it came from
(``"flag"``, ``"env ACCEL_MIXED_PRECISION"``, ``"config /path/to/file.yaml"`` or
``"default"``), converts and checks it, and names the setting, the value and its source when
something is wrong. :func:`format_settings_table` renders the result for printing at launch, so
a forgotten config file or environment variable never decides a run silently.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from accel_state.enums import DynamoBackend, PrecisionType
from accel_state.environment import (
    ACCEL_CPU_AFFINITY,
    ACCEL_DEBUG_MODE,
    ACCEL_DYNAMO_BACKEND,
    ACCEL_DYNAMO_MODE,
    ACCEL_DYNAMO_USE_DYNAMIC,
    ACCEL_DYNAMO_USE_FULLGRAPH,
    ACCEL_DYNAMO_USE_REGIONAL_COMPILATION,
    ACCEL_GRADIENT_ACCUMULATION_STEPS,
    ACCEL_MIXED_PRECISION,
    ACCEL_USE_CPU,
    lookup_variable,
    str_to_bool,
)
from accel_state.topology import get_slurm_step

from .config import ClusterConfig

__all__ = [
    "DYNAMO_MODES",
    "ENV_VARS",
    "LAUNCH_KEYS",
    "RDZV_BACKENDS",
    "Setting",
    "format_settings_summary",
    "format_settings_table",
    "resolve_launch_settings",
]

#: OpenMP's thread count; the children inherit it, so it is the env source of
#: ``num_cpu_threads_per_process``. Not an accel variable: accel only reads it.
_OMP_NUM_THREADS = "OMP_NUM_THREADS"

#: Every setting the launcher resolves, in the order the table prints them.
LAUNCH_KEYS: tuple[str, ...] = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "use_cpu",
    "gradient_accumulation_steps",
    "dynamo_backend",
    "dynamo_mode",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
    "rdzv_backend",
    "max_restarts",
    "monitor_interval",
    "num_cpu_threads_per_process",
    "gpu_ids",
    "enable_cpu_affinity",
    "debug",
    "same_network",
)

#: The environment variable read for a setting, where one exists.
ENV_VARS: Mapping[str, str] = {
    "mixed_precision": ACCEL_MIXED_PRECISION,
    "use_cpu": ACCEL_USE_CPU,
    "gradient_accumulation_steps": ACCEL_GRADIENT_ACCUMULATION_STEPS,
    "dynamo_backend": ACCEL_DYNAMO_BACKEND,
    "dynamo_mode": ACCEL_DYNAMO_MODE,
    "dynamo_use_fullgraph": ACCEL_DYNAMO_USE_FULLGRAPH,
    "dynamo_use_dynamic": ACCEL_DYNAMO_USE_DYNAMIC,
    "dynamo_use_regional_compilation": ACCEL_DYNAMO_USE_REGIONAL_COMPILATION,
    "num_cpu_threads_per_process": _OMP_NUM_THREADS,
    "enable_cpu_affinity": ACCEL_CPU_AFFINITY,
    "debug": ACCEL_DEBUG_MODE,
}

#: ``torch.compile`` modes.
DYNAMO_MODES: tuple[str, ...] = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)

#: torchrun rendezvous backends.
RDZV_BACKENDS: tuple[str, ...] = ("static", "c10d", "etcd", "etcd-v2")

_DYNAMO_KEYS = (
    "dynamo_backend",
    "dynamo_mode",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)
_CONFIG_ATTRIBUTES = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "use_cpu",
    "rdzv_backend",
    "same_network",
    "debug",
    "gpu_ids",
    "enable_cpu_affinity",
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One resolved launch setting.

    Args:
        value: The value, converted to its type (``None`` where unset means "the launcher or
            the Accelerator decides").
        source: ``"flag"``, ``"env <NAME>"``, ``"config <path>"`` or ``"default"``.
    """

    value: Any
    source: str


def described(key: str, raw: Any, source: str) -> str:
    return f"{key}={raw!r} (from {source})"


def to_int(key: str, raw: Any, source: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise ValueError(f"{described(key, raw, source)} is not an integer")


def to_float(key: str, raw: Any, source: str) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            pass
    raise ValueError(f"{described(key, raw, source)} is not a number")


def to_bool(key: str, raw: Any, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        try:
            return bool(str_to_bool(raw, to_bool=True))
        except ValueError:
            pass
    raise ValueError(
        f"{described(key, raw, source)} is not a boolean: use true/false, yes/no, on/off or 1/0"
    )


def to_str(key: str, raw: Any, source: str) -> str:
    text = str(raw).strip()
    if not text:
        raise ValueError(f"{described(key, raw, source)} is empty")
    return text


def choice(choices: tuple[str, ...], case: Callable[[str], str]) -> Callable[[str, Any, str], str]:
    def convert(key: str, raw: Any, source: str) -> str:
        text = case(str(raw).strip())
        if text not in choices:
            raise ValueError(f"{described(key, raw, source)} is not one of {', '.join(choices)}")
        return text

    return convert


def _gpu_ids(key: str, raw: Any, source: str) -> str:
    """``"all"`` or a comma-separated list of distinct GPU indices, normalised (``"0,2"``)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    text = str(raw).strip()
    if text.lower() == "all":
        return "all"
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts) or len(set(parts)) != len(parts):
        raise ValueError(
            f"{described(key, raw, source)} is not 'all' or a comma-separated list of distinct GPU "
            "indices such as '0,1'"
        )
    return ",".join(str(int(part)) for part in parts)


def _mixed_precision(key: str, raw: Any, source: str) -> str:
    if raw is False:  # an unquoted YAML ``no``
        return "no"
    return choice(tuple(PrecisionType.list()), str.lower)(key, raw, source)


def _dynamo_backend(key: str, raw: Any, source: str) -> str:
    if raw is False:  # an unquoted YAML ``NO``
        return "no"
    choices = tuple(value.lower() for value in DynamoBackend.list())
    return choice(choices, str.lower)(key, raw, source)


_CONVERTERS: dict[str, Callable[[str, Any, str], Any]] = {
    "num_processes": to_int,
    "num_machines": to_int,
    "machine_rank": to_int,
    "main_process_ip": to_str,
    "main_process_port": to_int,
    "mixed_precision": _mixed_precision,
    "use_cpu": to_bool,
    "gradient_accumulation_steps": to_int,
    "dynamo_backend": _dynamo_backend,
    "dynamo_mode": choice(DYNAMO_MODES, str.lower),
    "dynamo_use_fullgraph": to_bool,
    "dynamo_use_dynamic": to_bool,
    "dynamo_use_regional_compilation": to_bool,
    "rdzv_backend": choice(RDZV_BACKENDS, str.lower),
    "max_restarts": to_int,
    "monitor_interval": to_float,
    "num_cpu_threads_per_process": to_int,
    "gpu_ids": _gpu_ids,
    "enable_cpu_affinity": to_bool,
    "debug": to_bool,
    "same_network": to_bool,
}


def _config_label(config_source: str | None) -> str:
    if not config_source:
        return "config"
    if config_source == "config" or config_source.startswith("config "):
        return config_source
    return f"config {config_source}"


def _config_values(config: ClusterConfig) -> dict[str, Any]:
    """The launch settings a config file sets on purpose (not its filled-in defaults)."""
    given = config.given_keys()
    values: dict[str, Any] = {}
    for key in _CONFIG_ATTRIBUTES:
        value = getattr(config, key)
        if key in given and value is not None:
            values[key] = value
    if values.get("num_processes") == -1:  # Accelerate's spelling of "not set"
        del values["num_processes"]
    if "dynamo_config" in given:
        for key in _DYNAMO_KEYS:
            if config.dynamo_config.get(key) is not None:
                values[key] = config.dynamo_config[key]
    if "deepspeed_config" in given:
        steps = config.deepspeed_config.get("gradient_accumulation_steps")
        if steps is not None and steps != "auto":  # "auto" is left to DeepSpeed
            values["gradient_accumulation_steps"] = steps
    return values


def _slurm_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Launch settings an ``srun`` job step fixes, with the variable each one came from."""
    step = get_slurm_step(environ)
    if step is None:
        return {}

    def label(field: str) -> str | None:
        source = step.sources[field]
        if source == "default":
            return None
        return "srun: one node" if source == "one node" else f"env {source}"

    wanted = {
        "num_machines": ("num_nodes", step.num_nodes),
        "machine_rank": ("node_rank", step.node_rank),
        "main_process_ip": ("master_addr", step.master_addr),
        "main_process_port": ("master_port", step.master_port),
    }
    if step.tasks_are_processes:
        wanted["num_processes"] = ("num_tasks", step.num_tasks)
    values: dict[str, tuple[Any, str]] = {}
    for key, (field, value) in wanted.items():
        source = label(field)
        if source is not None:
            values[key] = (value, source)
    return values


def _physical_cores() -> int:
    return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def resolve_launch_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config: ClusterConfig | None,
    config_source: str | None,
    detected_devices: int,
) -> dict[str, Setting]:
    """Resolve every launch setting: flag > environment > config file > default.

    Defaults: ``use_cpu`` is true when no accelerator was detected; ``num_processes`` is one
    per detected accelerator on every machine (1 on the CPU); ``num_machines`` 1,
    ``machine_rank`` 0, ``mixed_precision`` ``"no"``, ``dynamo_backend`` ``"no"``,
    ``dynamo_mode`` ``"default"``, ``rdzv_backend`` ``"static"``, ``max_restarts`` 0,
    ``monitor_interval`` 0.1, ``gpu_ids`` ``"all"`` (a list of GPUs also sets the default
    ``num_processes`` to one per listed GPU), the boolean switches false. ``main_process_ip``,
    ``main_process_port`` and ``gradient_accumulation_steps`` stay None (the launcher picks an
    address and a free port; the Accelerator keeps its own accumulation default).
    ``num_cpu_threads_per_process`` comes from ``OMP_NUM_THREADS`` when set; on the CPU it
    defaults to the physical cores divided among the processes of one machine, else None.

    Under ``srun`` (``SLURM_STEP_NUM_TASKS`` set), the step fixes ``num_machines``,
    ``machine_rank``, ``main_process_ip`` and ``main_process_port`` (and ``num_processes``
    when srun starts several tasks per node) at the environment's level of precedence.

    Args:
        flags: Command-line values by setting name; None (or a missing key) means "not given".
        environ: The environment to read (usually ``os.environ``); empty values are unset.
        config: The loaded config file, or None.
        config_source: Where the config came from, usually its path (shown as
            ``"config <path>"``; a value already starting with ``"config "`` is kept as is).
        detected_devices: Accelerators found on this machine (0 on a CPU-only machine).

    Returns:
        A :class:`Setting` for every name in :data:`LAUNCH_KEYS`, in that order.

    Raises:
        ValueError: ``flags`` names an unknown setting, or a value cannot be converted or is
            out of range; the message names the setting, the value and its source.
    """
    unknown = sorted(set(flags) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"unknown launch settings {unknown}: known ones are {list(LAUNCH_KEYS)}")
    from_config = _config_values(config) if config is not None else {}
    label = _config_label(config_source)
    from_slurm = _slurm_values(environ)

    def pick(key: str) -> Setting | None:
        flag = flags.get(key)
        if flag is not None:
            return Setting(_CONVERTERS[key](key, flag, "flag"), "flag")
        found = lookup_variable(ENV_VARS[key], environ) if key in ENV_VARS else None
        if found is not None:
            name, raw = found
            source = f"env {name}"
            return Setting(_CONVERTERS[key](key, raw, source), source)
        if key in from_slurm:
            value, source = from_slurm[key]
            return Setting(_CONVERTERS[key](key, value, source), source)
        if key in from_config:
            return Setting(_CONVERTERS[key](key, from_config[key], label), label)
        return None

    def resolve(key: str, default: Any) -> Setting:
        found = pick(key)
        return found if found is not None else Setting(default, "default")

    out: dict[str, Setting] = {}
    out["use_cpu"] = resolve("use_cpu", detected_devices <= 0)
    out["num_machines"] = resolve("num_machines", 1)
    out["gpu_ids"] = resolve("gpu_ids", "all")
    out["enable_cpu_affinity"] = resolve("enable_cpu_affinity", False)
    machines = out["num_machines"].value
    chosen = out["gpu_ids"].value
    gpus = detected_devices if chosen == "all" else len(chosen.split(","))
    per_machine = 1 if out["use_cpu"].value else max(gpus, 1)
    out["num_processes"] = resolve("num_processes", per_machine * max(machines, 1))
    out["machine_rank"] = resolve("machine_rank", 0)
    out["main_process_ip"] = resolve("main_process_ip", None)
    out["main_process_port"] = resolve("main_process_port", None)
    out["mixed_precision"] = resolve("mixed_precision", PrecisionType.NO.value)
    out["gradient_accumulation_steps"] = resolve("gradient_accumulation_steps", None)
    out["dynamo_backend"] = resolve("dynamo_backend", "no")
    out["dynamo_mode"] = resolve("dynamo_mode", "default")
    out["dynamo_use_fullgraph"] = resolve("dynamo_use_fullgraph", False)
    out["dynamo_use_dynamic"] = resolve("dynamo_use_dynamic", False)
    out["dynamo_use_regional_compilation"] = resolve("dynamo_use_regional_compilation", False)
    out["rdzv_backend"] = resolve("rdzv_backend", "static")
    out["max_restarts"] = resolve("max_restarts", 0)
    out["monitor_interval"] = resolve("monitor_interval", 0.1)
    out["debug"] = resolve("debug", False)
    out["same_network"] = resolve("same_network", False)
    _validate(out)
    threads = pick("num_cpu_threads_per_process")
    if threads is None:
        default_threads = None
        if out["use_cpu"].value:
            local = out["num_processes"].value // out["num_machines"].value
            default_threads = max(1, _physical_cores() // max(local, 1))
        threads = Setting(default_threads, "default")
    elif threads.value < 1:
        raise ValueError(
            f"{described('num_cpu_threads_per_process', threads.value, threads.source)} "
            "must be >= 1"
        )
    out["num_cpu_threads_per_process"] = threads
    return {key: out[key] for key in LAUNCH_KEYS}


def _validate(settings: Mapping[str, Setting]) -> None:
    """Check ranges and the relations between settings."""

    def where(key: str) -> str:
        return described(key, settings[key].value, settings[key].source)

    for key in ("num_processes", "num_machines"):
        if settings[key].value < 1:
            raise ValueError(f"{where(key)} must be >= 1")
    steps = settings["gradient_accumulation_steps"].value
    if steps is not None and steps < 1:
        raise ValueError(f"{where('gradient_accumulation_steps')} must be >= 1")
    if settings["max_restarts"].value < 0:
        raise ValueError(f"{where('max_restarts')} must be >= 0")
    if settings["monitor_interval"].value <= 0:
        raise ValueError(f"{where('monitor_interval')} must be > 0 (seconds)")
    machines = settings["num_machines"].value
    rank = settings["machine_rank"].value
    if not 0 <= rank < machines:
        raise ValueError(
            f"{where('machine_rank')} must be between 0 and num_machines - 1, with "
            f"{where('num_machines')}"
        )
    chosen = settings["gpu_ids"].value
    if chosen != "all" and not settings["use_cpu"].value:
        per_machine = settings["num_processes"].value // machines
        if per_machine > len(chosen.split(",")):
            raise ValueError(
                f"{where('num_processes')} starts {per_machine} process(es) per machine, more "
                f"than the GPUs of {where('gpu_ids')}: one process per GPU"
            )
    if settings["num_processes"].value % machines:
        raise ValueError(
            f"{where('num_processes')} must be a multiple of {where('num_machines')}: it counts "
            "the processes of all machines together"
        )
    port = settings["main_process_port"].value
    if port is not None:
        if not 0 <= port <= 65535:
            raise ValueError(
                f"{where('main_process_port')} must be between 1 and 65535 "
                "(0, or no value, lets the launcher pick a free port)"
            )
        if port == 0 and machines > 1:
            raise ValueError(
                f"{where('main_process_port')} asks for any free port, which the other "
                f"machines cannot know with {where('num_machines')}: pass a fixed port"
            )


def format_settings_summary(settings: Mapping[str, Setting]) -> str:
    """One line saying what starts: processes, machines, device, precision and accumulation.

    What ``accel launch`` prints unless asked for the whole table (``--show_settings``); the
    table is printed anyway when a rank fails.
    """
    processes = settings["num_processes"].value
    machines = settings["num_machines"].value
    where = "cpu" if settings["use_cpu"].value else "one GPU per process"
    parts = [
        f"{processes} process{'es' if processes != 1 else ''} on {machines} "
        f"machine{'s' if machines != 1 else ''} ({where})",
        f"mixed precision {settings['mixed_precision'].value}",
    ]
    steps = settings["gradient_accumulation_steps"].value
    if steps is not None:
        parts.append(f"{steps} accumulation steps")
    backend = settings["dynamo_backend"].value
    if backend not in (None, "no"):
        parts.append(f"torch.compile {backend}")
    given = sum(1 for item in settings.values() if item.source != "default")
    return (
        f"accel launch: {', '.join(parts)}; {given} setting(s) not at their default "
        "(--show_settings prints each with its source)"
    )


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_settings_table(settings: Mapping[str, Setting]) -> str:
    """Render resolved settings as an aligned ``setting | value | source`` table.

    Unset values (None) print as ``-``, booleans as ``true``/``false``. The text has no
    trailing newline.

    Args:
        settings: Setting name to :class:`Setting`, as :func:`resolve_launch_settings` returns.
    """
    rows = [("setting", "value", "source")]
    rows += [(key, _show(item.value), item.source) for key, item in settings.items()]
    key_width = max(len(row[0]) for row in rows)
    value_width = max(len(row[1]) for row in rows)
    lines = [
        f"{key:<{key_width}} | {value:<{value_width}} | {source}" for key, value, source in rows
    ]
    source_width = max(len(row[2]) for row in rows)
    lines.insert(1, f"{'-' * key_width}-+-{'-' * value_width}-+-{'-' * source_width}")
    return "\n".join(lines)
