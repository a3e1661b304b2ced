"""Launch config files: the ``ClusterConfig`` schema, where the files live, and how they load.

A config file is the YAML (or JSON) mapping that ``accelerate config`` writes; accel reads the
same keys, so a file written by any Accelerate release since 0.11 loads unchanged. Old
spellings are converted on load (``fp16: true`` becomes ``mixed_precision: fp16``, a top-level
``dynamo_backend`` moves into ``dynamo_config``), keys accel does not know are refused with
their names, and files are parsed safely (YAML through ``yaml.SafeLoader``, ``.json`` files
through :mod:`json`).

Everything a file can hold is checked where it is read (:func:`load_config_from_file`), before
any value is used: a file that cannot be read or decoded, that is not YAML or JSON, that gives
a key two different values, whose aliases expand beyond a launch config's size, or whose values
have the wrong type is refused with one message naming the file, the key and value, and the
fix.

accel's own default file is ``$ACCEL_HOME/default_config.yaml`` (or
``$XDG_CONFIG_HOME/accel/default_config.yaml``). Accelerate's default file under
``$HF_HOME/accelerate`` is read only when no accel file exists, and :func:`find_config_file`
always says which file it picked and why, so that no file is used silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from accel_state.enums import ComputeEnvironment, DistributedType, PrecisionType
from accel_state.environment import ACCEL_HOME
from accel_state.files import atomic_write

from .config_text import read_config_mapping, shown
from .config_values import as_bool, as_choice, as_int, as_lines, as_section, as_text

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "BaseConfig",
    "HOW_DEFAULT",
    "HOW_EXPLICIT",
    "HOW_LEGACY",
    "HOW_NONE",
    "ClusterConfig",
    "config_from_answers",
    "default_config_path",
    "detect_local_accelerator",
    "find_config_file",
    "legacy_accelerate_config_path",
    "load_config_from_file",
    "update_config_file",
    "write_basic_config",
    "write_config_from_answers",
]

# Variables owned by other tools; accel only reads them to find files.
_HF_HOME = "HF_HOME"
_XDG_CONFIG_HOME = "XDG_CONFIG_HOME"
_XDG_CACHE_HOME = "XDG_CACHE_HOME"

#: File name of the default config, for accel and for Accelerate alike.
DEFAULT_CONFIG_NAME = "default_config.yaml"

#: The ``how`` answers of :func:`find_config_file`.
HOW_EXPLICIT = "--config_file"
HOW_DEFAULT = "accel default"
HOW_LEGACY = "legacy Accelerate default (read only because no accel config exists)"
HOW_NONE = "none"

#: Keys that older Accelerate releases wrote and that no longer mean anything: dropped on load,
#: with a warning when they held a value.
_RETIRED_KEYS: dict[str, str] = {
    "ipex_config": "Intel Extension for PyTorch settings; accel does not use IPEX",
    "tp_config": "tensor-parallel settings of old releases; use parallelism_config instead",
}

_DICT_FIELDS = (
    "fp8_config",
    "deepspeed_config",
    "fsdp_config",
    "parallelism_config",
    "megatron_lm_config",
    "mpirun_config",
    "dynamo_config",
)
_BOOL_FIELDS = (
    "use_cpu",
    "debug",
    "same_network",
    "enable_cpu_affinity",
    "downcast_bf16",
    "tpu_use_cluster",
    "tpu_use_sudo",
)
_OPTIONAL_STR_FIELDS = ("gpu_ids", "main_process_ip", "tpu_name", "tpu_zone", "command_file")
_OPTIONAL_LIST_FIELDS = ("commands", "tpu_vm", "tpu_env")


@dataclasses.dataclass
class BaseConfig:
    """The keys every launch config has (Accelerate's ``BaseConfig``).

    :class:`ClusterConfig` holds a whole local-machine config; this is the common part that
    Accelerate's code builds on its own (for example to print or compare configs).

    Raises:
        ValueError: an unknown compute environment, distributed type or mixed precision.
    """

    compute_environment: ComputeEnvironment | str
    distributed_type: DistributedType | str
    mixed_precision: str
    use_cpu: bool
    debug: bool

    def __post_init__(self) -> None:
        self.compute_environment = as_choice(
            ComputeEnvironment, "compute_environment", self.compute_environment
        )
        self.distributed_type = as_choice(
            DistributedType, "distributed_type", self.distributed_type
        )
        precision = str(self.mixed_precision).lower()
        if not isinstance(self.mixed_precision, str) or precision not in PrecisionType:
            raise ValueError(
                f"mixed_precision={shown(self.mixed_precision)} is not one of "
                f"{', '.join(PrecisionType.list())}"
            )
        self.mixed_precision = precision
        self.use_cpu = as_bool("use_cpu", self.use_cpu)
        self.debug = as_bool("debug", self.debug)

    def to_dict(self) -> dict[str, Any]:
        """The keys as a config file holds them (enums as strings)."""
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_yaml_file(self, path: str | os.PathLike[str]) -> Path:
        """Write the keys atomically as YAML (JSON when the name ends in ``.json``)."""
        target = Path(path)
        data = self.to_dict()
        if target.suffix == ".json":
            _atomic_write(target, json.dumps(data, indent=2, sort_keys=True) + "\n")
        else:
            _atomic_write(target, yaml.safe_dump(data, sort_keys=True))
        return target

    def to_json_file(self, path: str | os.PathLike[str]) -> Path:
        """Write the keys atomically as JSON."""
        target = Path(path)
        _atomic_write(target, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return target


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    """The contents of a launch config file (the keys and defaults of Accelerate 1.15's).

    Fields are keyword-only. Strings are accepted where an enum is expected, and YAML spellings
    such as ``'no'`` for a boolean are converted, so ``ClusterConfig(**yaml_mapping)`` works.

    Args:
        compute_environment: Where the run happens; only ``LOCAL_MACHINE`` can be launched.
        distributed_type: How the processes are organised (``NO``, ``MULTI_GPU``, ...).
        mixed_precision: ``no``, ``fp16``, ``bf16`` or ``fp8``.
        use_cpu: Run on the CPU even when an accelerator is present.
        debug: Check that every rank enters the same collectives.
        num_processes: Processes on all machines together; ``-1`` means not set.
        machine_rank: Rank of this machine, from 0.
        num_machines: Number of machines.
        gpu_ids: Devices to use, ``"all"`` or a comma-separated list such as ``"0,1"``.
        main_process_ip: Address of machine 0 (several machines).
        main_process_port: Port on machine 0 (several machines).
        rdzv_backend: torchrun rendezvous backend (``static``, ``c10d``, ...).
        same_network: All machines are on one network.
        main_training_function: Function the notebook and TPU launchers call.
        enable_cpu_affinity: Pin each process to the CPUs near its accelerator.
        downcast_bf16: Use bf16 for float32 tensors on TPU; ``'no'`` reads as false.
        fp8_config: FP8 recipe settings.
        deepspeed_config: DeepSpeed plugin settings.
        fsdp_config: FSDP plugin settings (``fsdp_*`` keys).
        parallelism_config: Tensor/context/sequence parallel settings.
        megatron_lm_config: Megatron-LM settings.
        mpirun_config: ``mpirun`` settings (``mpirun_hostfile``, ``mpirun_ccl``).
        dynamo_config: ``torch.compile`` settings (``dynamo_backend``, ``dynamo_mode``, ...).
        tpu_name: TPU pod name.
        tpu_zone: TPU pod zone.
        tpu_use_cluster: Run on every host of a TPU pod.
        tpu_use_sudo: Run TPU pod commands with sudo.
        command_file: File of commands for TPU pods.
        commands: Commands for TPU pods.
        tpu_vm: TPU VM names.
        tpu_env: Environment lines for TPU pods.

    Raises:
        ValueError: a value has the wrong type or is not one of the allowed choices.
    """

    compute_environment: ComputeEnvironment = ComputeEnvironment.LOCAL_MACHINE
    distributed_type: DistributedType
    mixed_precision: str = "no"
    use_cpu: bool = False
    debug: bool = False
    num_processes: int = -1
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    same_network: bool = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    downcast_bf16: bool = False
    fp8_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    deepspeed_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    fsdp_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    parallelism_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    megatron_lm_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    mpirun_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    dynamo_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None
    # Keys the source mapping set (None: built in code, every field counts as set).
    _given_keys: frozenset[str] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.compute_environment = as_choice(
            ComputeEnvironment, "compute_environment", self.compute_environment
        )
        self.distributed_type = as_choice(
            DistributedType, "distributed_type", self.distributed_type
        )
        # An unquoted YAML ``no`` reads as False.
        raw: Any = self.mixed_precision
        precision = "no" if raw is None or raw is False else str(raw).lower()
        if not (raw is None or isinstance(raw, (str, bool))) or precision not in PrecisionType:
            raise ValueError(
                f"mixed_precision={shown(self.mixed_precision)} is not one of "
                f"{', '.join(PrecisionType.list())}"
            )
        self.mixed_precision = precision
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            setattr(self, name, False if value is None else as_bool(name, value))
        self.num_processes = as_int("num_processes", self.num_processes)
        self.machine_rank = as_int("machine_rank", self.machine_rank)
        self.num_machines = as_int("num_machines", self.num_machines)
        if self.main_process_port is not None:
            self.main_process_port = as_int("main_process_port", self.main_process_port)
        if self.rdzv_backend is None:
            self.rdzv_backend = "static"
        if self.main_training_function is None:
            self.main_training_function = "main"
        for name in (*_OPTIONAL_STR_FIELDS, "rdzv_backend", "main_training_function"):
            setattr(self, name, as_text(name, getattr(self, name)))
        for name in _DICT_FIELDS:
            setattr(self, name, as_section(name, getattr(self, name)))
        for name in _OPTIONAL_LIST_FIELDS:
            setattr(self, name, as_lines(name, getattr(self, name)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> ClusterConfig:
        """Build a config from a mapping, after converting the spellings of old releases.

        Args:
            data: The mapping, as read from a config file.
            source: Where ``data`` came from; error messages name it.

        Raises:
            ValueError: ``distributed_type`` is missing, a key is unknown, a value is invalid,
                or the mapping describes an Amazon SageMaker job.
        """
        processed, given = _process_legacy(dict(data), source)
        try:
            config = cls(**processed)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None
        config._given_keys = given
        return config

    def given_keys(self) -> frozenset[str]:
        """The keys that the file (or mapping) set, as opposed to defaults filled in on load.

        Keys derived from old spellings count as set (``fp16: true`` sets ``mixed_precision``,
        ``distributed_type: NO`` sets ``num_processes`` to 1). A config built in code reports
        every key except ``num_processes`` when it is -1 (not set).
        """
        if self._given_keys is not None:
            return self._given_keys
        names = {field.name for field in dataclasses.fields(self) if field.init}
        if self.num_processes == -1:
            names.discard("num_processes")
        return frozenset(names)

    @classmethod
    def from_yaml_file(cls, yaml_file: str | os.PathLike[str]) -> ClusterConfig:
        """Load a YAML config file (same as :func:`load_config_from_file`)."""
        return load_config_from_file(yaml_file)

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike[str]) -> ClusterConfig:
        """Load a JSON config file (same as :func:`load_config_from_file`)."""
        return load_config_from_file(json_file)

    def to_dict(self) -> dict[str, Any]:
        """Return the mapping a config file holds: enums as strings, no None, no empty dicts."""
        result: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if not field.init:
                continue
            value = _plain(getattr(self, field.name))
            if value is None or (isinstance(value, dict) and not value):
                continue
            result[field.name] = value
        return result

    def to_yaml_file(self, path: str | os.PathLike[str]) -> Path:
        """Write the config atomically: YAML, or JSON when the name ends in ``.json``.

        The text goes to a temporary sibling that is then renamed over ``path``, so a crash
        never leaves half a file. Missing parent directories are created.

        Returns:
            The path written.
        """
        target = Path(path).expanduser()
        if target.suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        else:
            text = yaml.safe_dump(self.to_dict(), sort_keys=True, default_flow_style=False)
        _atomic_write(target, text)
        return target

    def to_json_file(self, path: str | os.PathLike[str]) -> Path:
        """Write the config as JSON, atomically (whatever the suffix)."""
        target = Path(path).expanduser()
        _atomic_write(target, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return target


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _atomic_write(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, text)


def _move_dynamo_backend(data: dict[str, Any]) -> None:
    """Move an old top-level ``dynamo_backend`` into ``dynamo_config``."""
    backend = data.pop("dynamo_backend")
    section = data.get("dynamo_config") or {}
    if not isinstance(section, Mapping):
        return  # not a section: ClusterConfig refuses it, naming it
    dynamo = dict(section)
    if backend not in (None, False) and str(backend).upper() != "NO":
        dynamo.setdefault("dynamo_backend", backend)
    data["dynamo_config"] = dynamo


def _process_legacy(data: dict[str, Any], source: str) -> tuple[dict[str, Any], frozenset[str]]:
    """Fill in the defaults old files lack and convert old spellings; refuse unknown keys.

    Returns the converted mapping and the keys it sets on purpose (not filled-in defaults).
    """
    filled: set[str] = set()
    if "compute_environment" not in data:
        filled.add("compute_environment")
    if data.get("mixed_precision") is None and "fp16" not in data:
        filled.add("mixed_precision")
    compute = data.setdefault("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value)
    if compute == ComputeEnvironment.AMAZON_SAGEMAKER:
        raise ValueError(
            f"{source}: compute_environment is AMAZON_SAGEMAKER, and accel does not launch on "
            "Amazon SageMaker: write a LOCAL_MACHINE config (`accel config default`) or launch "
            "this one with Accelerate"
        )
    if data.get("distributed_type") is False:  # an unquoted YAML ``NO`` reads as False
        data["distributed_type"] = DistributedType.NO.value
    if data.get("distributed_type") is None:
        raise ValueError(
            f"{source}: the required key distributed_type is missing; add for example "
            "`distributed_type: 'NO'` (one process) or `distributed_type: MULTI_GPU`"
        )
    if "num_processes" not in data and data["distributed_type"] == DistributedType.NO:
        data["num_processes"] = 1
    legacy_fp16 = data.pop("fp16", None)
    try:  # checked even where mixed_precision wins: a value that means nothing is refused
        use_fp16 = legacy_fp16 is not None and as_bool("fp16", legacy_fp16)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if data.get("mixed_precision") is None:
        data["mixed_precision"] = "fp16" if use_fp16 else "no"
    if "dynamo_backend" in data:
        _move_dynamo_backend(data)
    for key, meaning in _RETIRED_KEYS.items():
        if key in data:
            value = data.pop(key)
            if value:
                warnings.warn(
                    f"{source}: ignoring {key}={shown(value)} ({meaning}); "
                    "`accel config update` rewrites the file without it",
                    UserWarning,
                    stacklevel=3,
                )
    known = {field.name for field in dataclasses.fields(ClusterConfig) if field.init}
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise ValueError(
            f"The config file at {source} had unknown keys ({unknown}): check their spelling "
            "or remove them; accel reads the keys of Accelerate's ClusterConfig, and "
            "`accel config default` writes a fresh file"
        )
    return data, frozenset(key for key in data if key not in filled and data[key] is not None)


def _no_default_file() -> FileNotFoundError:
    return FileNotFoundError(
        f"no config file was given and there is no default one ({default_config_path()}, or "
        f"Accelerate's {legacy_accelerate_config_path()}): pass a path, or write the default "
        "file with `accel config default`"
    )


def load_config_from_file(path: str | os.PathLike[str] | None) -> ClusterConfig:
    """Read a launch config file (YAML through ``yaml.safe_load``; JSON is YAML too).

    Files written by Accelerate 0.11 and later load: missing ``compute_environment`` means
    ``LOCAL_MACHINE``, ``distributed_type: NO`` without ``num_processes`` means 1, ``fp16:
    true`` means ``mixed_precision: fp16``, a top-level ``dynamo_backend`` moves into
    ``dynamo_config``, and keys of retired features (``ipex_config``) are dropped.

    Args:
        path: The file to read; None reads the default file (:func:`find_config_file`:
            accel's, else Accelerate's), as Accelerate's function does.

    Every check happens here, before any value is used; each message names the file, the key
    and the value where there is one, and the fix.

    Raises:
        FileNotFoundError: ``path`` does not exist or is a directory, or it is None and no
            default file does.
        PermissionError: the file cannot be read by this user.
        OSError: reading the file failed otherwise.
        ValueError: the file is larger than 1 MiB, is not UTF-8, is not YAML (or JSON, for a
            ``.json`` name), is not a mapping, gives a key two values, holds more than 10,000
            values or nests them more than 32 deep (YAML aliases included), lacks
            ``distributed_type``, has unknown keys or invalid values, or describes an Amazon
            SageMaker job.
    """
    if path is None:
        found, _ = find_config_file(None)
        if found is None:
            raise _no_default_file()
        path = found
    file = Path(path).expanduser()
    if not file.is_file():
        raise _not_a_file(file, f"the config file {str(file)!r}")
    return ClusterConfig.from_dict(read_config_mapping(file), source=str(file))


def _not_a_file(path: Path, named: str) -> FileNotFoundError:
    if path.is_dir():
        return FileNotFoundError(
            f"{named} is a directory, not a config file: pass the file itself (such as "
            f"{path / DEFAULT_CONFIG_NAME}), or write one with "
            "`accel config default --config_file PATH`"
        )
    return FileNotFoundError(
        f"{named} does not exist: pass an existing file, or write one with "
        "`accel config default --config_file PATH`"
    )


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _dir_from(environ: Mapping[str, str], name: str, fallback: Path) -> Path:
    value = environ.get(name, "")
    return Path(value).expanduser() if value else fallback


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where accel's default config file lives (whether or not it exists).

    ``$ACCEL_HOME/default_config.yaml`` when ``ACCEL_HOME`` is set, else
    ``$XDG_CONFIG_HOME/accel/default_config.yaml`` (``XDG_CONFIG_HOME`` defaults to
    ``~/.config``).

    Args:
        environ: Environment to read (``os.environ`` when None).
    """
    env = _environ(environ)
    home = env.get(ACCEL_HOME, "")
    if home:
        return Path(home).expanduser() / DEFAULT_CONFIG_NAME
    config_home = _dir_from(env, _XDG_CONFIG_HOME, Path("~/.config").expanduser())
    return config_home / "accel" / DEFAULT_CONFIG_NAME


def legacy_accelerate_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where Accelerate keeps its default config file.

    ``$HF_HOME/accelerate/default_config.yaml``, ``HF_HOME`` defaulting to
    ``$XDG_CACHE_HOME/huggingface`` (``XDG_CACHE_HOME`` defaults to ``~/.cache``). When only a
    ``default_config.json`` exists there (very old releases), that file is returned.

    Args:
        environ: Environment to read (``os.environ`` when None).
    """
    env = _environ(environ)
    cache_home = _dir_from(env, _XDG_CACHE_HOME, Path("~/.cache").expanduser())
    hf_home = _dir_from(env, _HF_HOME, cache_home / "huggingface")
    yaml_path = hf_home / "accelerate" / DEFAULT_CONFIG_NAME
    json_path = yaml_path.with_suffix(".json")
    if not yaml_path.is_file() and json_path.is_file():
        return json_path
    return yaml_path


def find_config_file(
    explicit: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
) -> tuple[Path | None, str]:
    """Pick the config file a command reads, and say why.

    Order: the explicit path, accel's default file, then Accelerate's default file (only when
    accel has none). The second element is one of :data:`HOW_EXPLICIT` (``"--config_file"``),
    :data:`HOW_DEFAULT`, :data:`HOW_LEGACY` or :data:`HOW_NONE`; print it so that the user
    knows which file is in effect.

    Args:
        explicit: The ``--config_file`` value, or None.
        environ: Environment to read (``os.environ`` when None).

    Raises:
        FileNotFoundError: ``explicit`` is given but does not exist.
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise _not_a_file(path, f"--config_file {str(explicit)!r}")
        return path, HOW_EXPLICIT
    accel_default = default_config_path(environ)
    if accel_default.is_file():
        return accel_default, HOW_DEFAULT
    legacy = legacy_accelerate_config_path(environ)
    if legacy.is_file():
        return legacy, HOW_LEGACY
    return None, HOW_NONE


def detect_local_accelerator() -> tuple[str, int]:
    """Return this machine's accelerator type and how many there are.

    Checks CUDA, then XPU, then NPU, then MPS (counted as one device); a machine with none
    gives ``("cpu", 0)``.
    """
    from accel_state.devices import device_count
    from accel_state.imports import (
        is_cuda_available,
        is_mps_available,
        is_npu_available,
        is_xpu_available,
    )

    for kind, available in (
        ("cuda", is_cuda_available),
        ("xpu", is_xpu_available),
        ("npu", is_npu_available),
    ):
        if available():
            return kind, device_count(kind)
    if is_mps_available():
        return "mps", 1
    return "cpu", 0


_MULTI_TYPES = {
    "cuda": DistributedType.MULTI_GPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
}


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write a config file for this machine: one process per detected accelerator.

    The file is YAML (JSON when ``save_location`` ends in ``.json``). It has one process per
    CUDA/XPU/NPU device (``MULTI_*`` when there are several, else ``NO``); on MPS or a
    CPU-only machine one process, and ``use_cpu: true`` on the CPU.

    Args:
        mixed_precision: ``no``, ``fp16``, ``bf16`` or ``fp8``.
        save_location: Where to write; accel's :func:`default_config_path` when None.

    Returns:
        The path written, or False when a file is already there (it is left untouched and a
        message is printed).

    Raises:
        ValueError: ``mixed_precision`` is not one of the choices.
    """
    precision = str(mixed_precision).lower()
    if precision not in PrecisionType:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not one of {', '.join(PrecisionType.list())}"
        )
    target = default_config_path() if save_location is None else Path(save_location).expanduser()
    if target.exists():
        print(
            f"accel config: {target} already exists and was left unchanged; delete it or run "
            "`accel config` to change it"
        )
        return False
    kind, count = detect_local_accelerator()
    if kind in _MULTI_TYPES and count >= 1:
        processes = count
        distributed = _MULTI_TYPES[kind] if count > 1 else DistributedType.NO
    else:
        processes = 1
        distributed = DistributedType.NO
    config = ClusterConfig(
        compute_environment=ComputeEnvironment.LOCAL_MACHINE,
        distributed_type=distributed,
        mixed_precision=precision,
        num_processes=processes,
        use_cpu=kind == "cpu",
        debug=False,
        enable_cpu_affinity=False,
    )
    return config.to_yaml_file(target)


def update_config_file(
    config_file: str | os.PathLike[str] | None = None,
) -> tuple[Path, Path, str]:
    """Rewrite a config file with today's keys and spellings (``accel config update``).

    Args:
        config_file: The file to update in place; None reads the default file
            (:func:`find_config_file`) and writes accel's default file.

    Returns:
        ``(the file read, the file written, how the file read was found)``.

    Raises:
        FileNotFoundError: ``config_file`` does not exist, or it is None and no default
            file does.
        ValueError: the file cannot be read as a config (see :func:`load_config_from_file`).
    """
    path, how = find_config_file(config_file)
    if path is None:
        raise _no_default_file()
    config = load_config_from_file(path)
    target = Path(config_file).expanduser() if config_file is not None else default_config_path()
    return path, config.to_yaml_file(target), how


def config_from_answers(ask: Callable[[str, str], str]) -> ClusterConfig:
    """Ask the ``accel config`` questions through ``ask``; return the config they describe.

    Args:
        ask: ``ask(question, default) -> answer`` (an empty answer takes the default).

    Raises:
        ValueError: an answer is not one of the choices, or the answers describe a launch
            accel would refuse (the message says which).
        EOFError: the answers ended before the last question.
    """
    from .engines import resolve_engine_settings
    from .questionnaire import ask_config

    config = ClusterConfig.from_dict(ask_config(ask), source="accel config")
    resolve_engine_settings({}, {}, config, "accel config")  # contradictions, bad values
    return config


def write_config_from_answers(
    ask: Callable[[str, str], str], config_file: str | os.PathLike[str] | None = None
) -> Path:
    """Ask the ``accel config`` questions through ``ask`` and write the answers.

    Args:
        ask: ``ask(question, default) -> answer`` (an empty answer takes the default).
        config_file: Where to write (YAML, or JSON for a ``.json`` name); accel's default
            file when None.

    Returns:
        The path written. Nothing is written when an answer is refused.

    Raises:
        ValueError: an answer is not one of the choices, or the answers describe a launch
            accel would refuse (the message says which).
        EOFError: the answers ended before the last question.
    """
    target = default_config_path() if config_file is None else Path(config_file).expanduser()
    return config_from_answers(ask).to_yaml_file(target)
