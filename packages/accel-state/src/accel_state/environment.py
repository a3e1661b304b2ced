"""The launcher <-> state environment contract and helpers for environment variables.

Every ``ACCEL_*`` variable that accel reads or writes is named here, once. ``accel launch``
writes these names into the environment of the processes it starts; :mod:`accel_state`
and the other packages read them through the constants below and :func:`read_variable`. Where
Accelerate uses the prefix ``ACCELERATE_``, accel uses ``ACCEL_``, and reads Accelerate's spelling
too (``ACCEL_*`` and ``ACCELERATE_*`` both set to different values is an error naming both); the
FSDP plugin's variables keep the ``FSDP_`` names Accelerate gives them.

The module also holds the small parsers (``str_to_bool``, ``parse_flag_from_env``, ...) and
context managers (``patch_environment``, ``clear_environment``) that Accelerate exposes in
``accelerate.utils``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "accelerate_name",
    "accelerate_variables",
    "lookup_variable",
    "read_variable",
    "warn_accelerate_variables",
    "ACCEL_BYPASS_DEVICE_MAP",
    "ACCEL_CONFIG_DS_FIELDS",
    "ACCEL_CPU_AFFINITY",
    "ACCEL_DEBUG_MODE",
    "ACCEL_DEEPSPEED_CONFIG_FILE",
    "ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES",
    "ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "ACCEL_DEEPSPEED_ZERO3_INIT",
    "ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "ACCEL_DEEPSPEED_ZERO_STAGE",
    "ACCEL_DISABLE_PROGRESS_BAR",
    "ACCEL_DISABLE_RICH",
    "ACCEL_DYNAMO_BACKEND",
    "ACCEL_DOWNCAST_BF16",
    "ACCEL_DYNAMO_MODE",
    "ACCEL_DYNAMO_USE_DYNAMIC",
    "ACCEL_DYNAMO_USE_FULLGRAPH",
    "ACCEL_DYNAMO_USE_REGIONAL_COMPILATION",
    "ACCEL_GRADIENT_ACCUMULATION_STEPS",
    "ACCEL_GRADIENT_CLIPPING",
    "ACCEL_HOME",
    "ACCEL_INIT_INCLUDE_BUFFERS",
    "ACCEL_LOG_LEVEL",
    "ACCEL_MIXED_PRECISION",
    "ACCEL_OFFLOAD_COPY_THREADS",
    "ACCEL_OFFLOAD_PREFETCH_DEPTH",
    "ACCEL_OFFLOAD_STAGING",
    "ACCEL_PROCESS_GROUP_TIMEOUT",
    "ACCEL_TORCH_DEVICE",
    "ACCEL_USE_CPU",
    "ACCEL_USE_DEEPSPEED",
    "ACCEL_USE_FSDP",
    "ACCEL_USE_MEGATRON_LM",
    "ACCEL_USE_PARALLELISM_CONFIG",
    "CONTRACT",
    "FORK_LAUNCHED",
    "FSDP_ACTIVATION_CHECKPOINTING",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "FSDP_FORWARD_PREFETCH",
    "FSDP_IGNORED_MODULES",
    "FSDP_MIN_NUM_PARAMS",
    "FSDP_OFFLOAD_PARAMS",
    "FSDP_RESHARD_AFTER_FORWARD",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_STATE_DICT_TYPE",
    "FSDP_SYNC_MODULE_STATES",
    "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "FSDP_USE_ORIG_PARAMS",
    "FSDP_VERSION",
    "PARALLELISM_CONFIG_CP_BACKEND",
    "PARALLELISM_CONFIG_CP_COMM_STRATEGY",
    "PARALLELISM_CONFIG_CP_SIZE",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION",
    "PARALLELISM_CONFIG_SP_BACKEND",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE",
    "PARALLELISM_CONFIG_SP_SIZE",
    "PARALLELISM_CONFIG_TP_SIZE",
    "clear_environment",
    "convert_dict_to_env_variables",
    "environment_hidden",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accel_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

ACCEL_USE_CPU = "ACCEL_USE_CPU"
ACCEL_MIXED_PRECISION = "ACCEL_MIXED_PRECISION"
ACCEL_GRADIENT_ACCUMULATION_STEPS = "ACCEL_GRADIENT_ACCUMULATION_STEPS"
ACCEL_DEBUG_MODE = "ACCEL_DEBUG_MODE"
ACCEL_TORCH_DEVICE = "ACCEL_TORCH_DEVICE"
ACCEL_DOWNCAST_BF16 = "ACCEL_DOWNCAST_BF16"
ACCEL_PROCESS_GROUP_TIMEOUT = "ACCEL_PROCESS_GROUP_TIMEOUT"
ACCEL_LOG_LEVEL = "ACCEL_LOG_LEVEL"
ACCEL_INIT_INCLUDE_BUFFERS = "ACCEL_INIT_INCLUDE_BUFFERS"
ACCEL_BYPASS_DEVICE_MAP = "ACCEL_BYPASS_DEVICE_MAP"
ACCEL_CPU_AFFINITY = "ACCEL_CPU_AFFINITY"
ACCEL_DISABLE_RICH = "ACCEL_DISABLE_RICH"
ACCEL_USE_DEEPSPEED = "ACCEL_USE_DEEPSPEED"
ACCEL_USE_FSDP = "ACCEL_USE_FSDP"
ACCEL_USE_MEGATRON_LM = "ACCEL_USE_MEGATRON_LM"
ACCEL_USE_PARALLELISM_CONFIG = "ACCEL_USE_PARALLELISM_CONFIG"
ACCEL_HOME = "ACCEL_HOME"
ACCEL_DISABLE_PROGRESS_BAR = "ACCEL_DISABLE_PROGRESS_BAR"
ACCEL_OFFLOAD_PREFETCH_DEPTH = "ACCEL_OFFLOAD_PREFETCH_DEPTH"
ACCEL_OFFLOAD_STAGING = "ACCEL_OFFLOAD_STAGING"
ACCEL_OFFLOAD_COPY_THREADS = "ACCEL_OFFLOAD_COPY_THREADS"
ACCEL_DYNAMO_BACKEND = "ACCEL_DYNAMO_BACKEND"
ACCEL_DYNAMO_MODE = "ACCEL_DYNAMO_MODE"
ACCEL_DYNAMO_USE_FULLGRAPH = "ACCEL_DYNAMO_USE_FULLGRAPH"
ACCEL_DYNAMO_USE_DYNAMIC = "ACCEL_DYNAMO_USE_DYNAMIC"
ACCEL_DYNAMO_USE_REGIONAL_COMPILATION = "ACCEL_DYNAMO_USE_REGIONAL_COMPILATION"
FORK_LAUNCHED = "FORK_LAUNCHED"
# DeepSpeed plugin (Accelerate's ACCELERATE_DEEPSPEED_* and friends).
ACCEL_DEEPSPEED_CONFIG_FILE = "ACCEL_DEEPSPEED_CONFIG_FILE"
ACCEL_DEEPSPEED_ZERO_STAGE = "ACCEL_DEEPSPEED_ZERO_STAGE"
ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE = "ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"
ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE = "ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE"
ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH = "ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"
ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH = "ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"
ACCEL_DEEPSPEED_ZERO3_INIT = "ACCEL_DEEPSPEED_ZERO3_INIT"
ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL = "ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"
ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES = "ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES"
ACCEL_GRADIENT_CLIPPING = "ACCEL_GRADIENT_CLIPPING"
ACCEL_CONFIG_DS_FIELDS = "ACCEL_CONFIG_DS_FIELDS"
# FSDP plugin: Accelerate's names, which carry no ACCELERATE_ prefix.
FSDP_VERSION = "FSDP_VERSION"
FSDP_OFFLOAD_PARAMS = "FSDP_OFFLOAD_PARAMS"
FSDP_MIN_NUM_PARAMS = "FSDP_MIN_NUM_PARAMS"
FSDP_SHARDING_STRATEGY = "FSDP_SHARDING_STRATEGY"
FSDP_RESHARD_AFTER_FORWARD = "FSDP_RESHARD_AFTER_FORWARD"
FSDP_AUTO_WRAP_POLICY = "FSDP_AUTO_WRAP_POLICY"
FSDP_TRANSFORMER_CLS_TO_WRAP = "FSDP_TRANSFORMER_CLS_TO_WRAP"
FSDP_BACKWARD_PREFETCH = "FSDP_BACKWARD_PREFETCH"
FSDP_STATE_DICT_TYPE = "FSDP_STATE_DICT_TYPE"
FSDP_FORWARD_PREFETCH = "FSDP_FORWARD_PREFETCH"
FSDP_USE_ORIG_PARAMS = "FSDP_USE_ORIG_PARAMS"
FSDP_CPU_RAM_EFFICIENT_LOADING = "FSDP_CPU_RAM_EFFICIENT_LOADING"
FSDP_IGNORED_MODULES = "FSDP_IGNORED_MODULES"
FSDP_SYNC_MODULE_STATES = "FSDP_SYNC_MODULE_STATES"
FSDP_ACTIVATION_CHECKPOINTING = "FSDP_ACTIVATION_CHECKPOINTING"
FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD = "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"
# ParallelismConfig: Accelerate's names, which carry no ACCELERATE_ prefix.
PARALLELISM_CONFIG_DP_REPLICATE_SIZE = "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"
PARALLELISM_CONFIG_DP_SHARD_SIZE = "PARALLELISM_CONFIG_DP_SHARD_SIZE"
PARALLELISM_CONFIG_TP_SIZE = "PARALLELISM_CONFIG_TP_SIZE"
PARALLELISM_CONFIG_CP_SIZE = "PARALLELISM_CONFIG_CP_SIZE"
PARALLELISM_CONFIG_CP_BACKEND = "PARALLELISM_CONFIG_CP_BACKEND"
PARALLELISM_CONFIG_CP_COMM_STRATEGY = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"
PARALLELISM_CONFIG_SP_SIZE = "PARALLELISM_CONFIG_SP_SIZE"
PARALLELISM_CONFIG_SP_BACKEND = "PARALLELISM_CONFIG_SP_BACKEND"
PARALLELISM_CONFIG_SP_SEQ_LENGTH = "PARALLELISM_CONFIG_SP_SEQ_LENGTH"
PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE = "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE"
PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION = "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"

#: Every variable of the contract with what it means; ``docs/environment.md`` mirrors it and a
#: test keeps the two in step.
CONTRACT: dict[str, str] = {
    ACCEL_USE_CPU: "Force the CPU even when an accelerator is present (flag).",
    ACCEL_MIXED_PRECISION: "Default mixed precision: no, fp16, bf16 or fp8.",
    ACCEL_GRADIENT_ACCUMULATION_STEPS: "Default number of gradient accumulation steps (int).",
    ACCEL_DEBUG_MODE: "Check that all ranks enter the same collective with matching shapes (flag).",
    ACCEL_TORCH_DEVICE: "Override the device chosen for this process (e.g. 'cpu', 'cuda:1').",
    ACCEL_DOWNCAST_BF16: "XLA with bf16: XLA_DOWNCAST_BF16 instead of XLA_USE_BF16 (flag).",
    ACCEL_PROCESS_GROUP_TIMEOUT: "Seconds a collective may wait for the other ranks (float).",
    ACCEL_LOG_LEVEL: "Level of loggers made by accel_state.get_logger (e.g. INFO).",
    ACCEL_INIT_INCLUDE_BUFFERS: "Default include_buffers of init_empty_weights (flag).",
    ACCEL_BYPASS_DEVICE_MAP: "Allow distributed training of a model with a device map (flag).",
    ACCEL_CPU_AFFINITY: "Pin each process to the CPUs of its accelerator's NUMA node (flag).",
    ACCEL_DISABLE_RICH: "Do not use rich for tracebacks and progress output (flag).",
    ACCEL_USE_DEEPSPEED: "Train with the DeepSpeed engine (flag; plugin from ACCEL_DEEPSPEED_*).",
    ACCEL_USE_FSDP: "Train with the FSDP2 engine (flag; plugin from the FSDP_* variables).",
    ACCEL_USE_MEGATRON_LM: "Ask for Megatron-LM (flag); refused.",
    ACCEL_USE_PARALLELISM_CONFIG: "Lay the processes on a mesh (flag; PARALLELISM_CONFIG_* sizes).",
    ACCEL_DYNAMO_BACKEND: "torch.compile backend, or 'no'.",
    ACCEL_DYNAMO_MODE: "torch.compile mode.",
    ACCEL_DYNAMO_USE_FULLGRAPH: "torch.compile fullgraph (flag).",
    ACCEL_DYNAMO_USE_DYNAMIC: "torch.compile dynamic shapes (flag).",
    ACCEL_DYNAMO_USE_REGIONAL_COMPILATION: "Compile repeated blocks once (flag).",
    FORK_LAUNCHED: "Set by fork-based launchers: destroying the process group is left to them.",
    ACCEL_HOME: "Folder of accel's default config file (default: $XDG_CONFIG_HOME/accel).",
    ACCEL_DISABLE_PROGRESS_BAR: (
        "Hide the progress bars of long loads and saves (checkpoint loading, load_pretrained, "
        "save_model, merge-weights) on a terminal (flag)."
    ),
    ACCEL_OFFLOAD_PREFETCH_DEPTH: "Default prefetch_depth of accel-bigmodel's offload (int >= 0).",
    ACCEL_OFFLOAD_STAGING: (
        "How offloaded CPU weights reach a GPU: auto (page-lock them in place, else a pinned "
        "ring), register (the same, warning when the driver refuses) or ring."
    ),
    ACCEL_OFFLOAD_COPY_THREADS: (
        "Threads filling accel-bigmodel's pinned staging ring (int >= 1; default min(4, CPUs))."
    ),
    ACCEL_DEEPSPEED_CONFIG_FILE: "Path of a DeepSpeed JSON config for the DeepSpeed plugin.",
    ACCEL_DEEPSPEED_ZERO_STAGE: "DeepSpeed ZeRO stage: 0, 1, 2 or 3.",
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE: "Where ZeRO keeps optimizer states: none, cpu, nvme.",
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE: "Where ZeRO-3 puts parameters: none, cpu or nvme.",
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH: "Folder for optimizer states offloaded to NVMe.",
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH: "Folder for parameters offloaded to NVMe.",
    ACCEL_DEEPSPEED_ZERO3_INIT: "Build the model under deepspeed.zero.Init with ZeRO-3 (flag).",
    ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL: "Gather and save 16-bit weights with ZeRO-3 (flag).",
    ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES: "Comma-separated MoE layer classes ZeRO-3 keeps whole.",
    ACCEL_GRADIENT_CLIPPING: "Gradient clipping norm for the DeepSpeed plugin (float).",
    ACCEL_CONFIG_DS_FIELDS: "Comma-separated DeepSpeed settings that came from the config file.",
    FSDP_VERSION: "FSDP version: 2 (default); 1 is refused (accel to-fsdp2 converts).",
    FSDP_OFFLOAD_PARAMS: "Offload parameters and gradients to the CPU (flag).",
    FSDP_MIN_NUM_PARAMS: "Minimum parameters of a module wrapped by SIZE_BASED_WRAP (int).",
    FSDP_SHARDING_STRATEGY: "FSDP1 sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, ...).",
    FSDP_RESHARD_AFTER_FORWARD: "Reshard after forward: true/false (FSDP2) or a strategy (FSDP1).",
    FSDP_AUTO_WRAP_POLICY: "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.",
    FSDP_TRANSFORMER_CLS_TO_WRAP: "Comma-separated classes TRANSFORMER_BASED_WRAP wraps.",
    FSDP_BACKWARD_PREFETCH: "FSDP1 backward prefetch: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH.",
    FSDP_STATE_DICT_TYPE: "FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT.",
    FSDP_FORWARD_PREFETCH: "FSDP1 forward prefetch (flag).",
    FSDP_USE_ORIG_PARAMS: "FSDP1 use_orig_params (flag).",
    FSDP_CPU_RAM_EFFICIENT_LOADING: "Only rank 0 loads the checkpoint, others start empty (flag).",
    FSDP_SYNC_MODULE_STATES: "Broadcast module states from rank 0 when wrapping (flag).",
    FSDP_IGNORED_MODULES: "Regular expression of module names FSDP leaves unsharded.",
    FSDP_ACTIVATION_CHECKPOINTING: "Recompute activations in backward, not keep them (flag).",
    FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD: "Offload checkpointed activations to the CPU (flag).",
    PARALLELISM_CONFIG_DP_REPLICATE_SIZE: "Data-parallel replicas of a ParallelismConfig (int).",
    PARALLELISM_CONFIG_DP_SHARD_SIZE: "Data-parallel shards of a ParallelismConfig (int >= 1).",
    PARALLELISM_CONFIG_TP_SIZE: "Tensor-parallel size of a ParallelismConfig (int >= 1).",
    PARALLELISM_CONFIG_CP_SIZE: "Context-parallel size of a ParallelismConfig (int >= 1).",
    PARALLELISM_CONFIG_CP_BACKEND: "Context-parallel backend of a ParallelismConfig: torch.",
    PARALLELISM_CONFIG_CP_COMM_STRATEGY: "Context-parallel communication: allgather or alltoall.",
    PARALLELISM_CONFIG_SP_SIZE: "Sequence-parallel size of a ParallelismConfig (int >= 1).",
    PARALLELISM_CONFIG_SP_BACKEND: "Sequence-parallel backend of a ParallelismConfig: deepspeed.",
    PARALLELISM_CONFIG_SP_SEQ_LENGTH: "Sequence length of sequence parallelism (int, or None).",
    PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE: (
        "Sequence lengths change between batches (flag, default true)."
    ),
    PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION: (
        "Attention kernel of sequence parallelism (sdpa, flash_attention_2, ...)."
    ),
}

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


#: Accelerate's prefix. ``ACCELERATE_<X>`` is read as ``ACCEL_<X>`` wherever ``ACCEL_<X>`` is a
#: variable of :data:`CONTRACT` (``accelerate launch``, transformers and cluster scripts set them).
_ACCELERATE_PREFIX = "ACCELERATE_"
_ACCEL_PREFIX = "ACCEL_"
_warned_accelerate_variables: set[str] = set()


def accelerate_name(name: str) -> str | None:
    """Accelerate's spelling of an ``ACCEL_*`` variable (``ACCEL_X`` -> ``ACCELERATE_X``).

    Returns None for names without the ``ACCEL_`` prefix (``FSDP_*``, ``PARALLELISM_CONFIG_*``
    carry Accelerate's own names already).
    """
    if not name.startswith(_ACCEL_PREFIX):
        return None
    return _ACCELERATE_PREFIX + name.removeprefix(_ACCEL_PREFIX)


def _same_setting(first: str, second: str) -> bool:
    """Whether two spellings of one variable mean the same (``true`` and ``1`` do)."""
    a, b = first.strip(), second.strip()
    if a.lower() == b.lower():
        return True
    try:
        return str_to_bool(a) == str_to_bool(b)
    except ValueError:
        return False


#: True inside :func:`environment_hidden`, in that thread (or asyncio task) only.
_HIDDEN: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "accel_environment_hidden", default=False
)
_NOTHING: Mapping[str, str] = {}


@contextlib.contextmanager
def environment_hidden() -> Iterator[None]:
    """Make accel's readers see no environment variable inside the block, in this thread only.

    :func:`lookup_variable` and every reader built on it (:func:`read_variable`,
    :func:`parse_flag_from_env`, ...) then read an empty mapping when given no ``environ``.
    Unlike :func:`clear_environment`, ``os.environ`` itself is not touched, so other threads
    and child processes keep seeing the real environment; a value read from ``os.environ``
    directly is not hidden. Kwargs handlers build their environment-free defaults this way.
    """
    token = _HIDDEN.set(True)
    try:
        yield
    finally:
        _HIDDEN.reset(token)


def _visible(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """The mapping a reader given ``environ`` reads: ``os.environ`` unless one was given."""
    if environ is not None:
        return environ
    return _NOTHING if _HIDDEN.get() else os.environ


def lookup_variable(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """Which spelling of ``name`` is set, and its value: ``(variable, value)`` or None.

    ``name`` is an ``ACCEL_*`` variable of :data:`CONTRACT`, read also in Accelerate's
    ``ACCELERATE_*`` spelling (any other name is read as it is). Unset, or set to the empty
    string, counts as not set; both spellings set to the same setting give ``name``'s.

    Raises:
        ValueError: both spellings are set to different settings; the message names both.
    """
    environ = _visible(environ)
    ours = environ.get(name)
    ours = ours if ours is not None and ours.strip() else None
    theirs_name = accelerate_name(name) if name in CONTRACT else None
    theirs = environ.get(theirs_name) if theirs_name is not None else None
    if theirs_name is None or theirs is None or not theirs.strip():
        return None if ours is None else (name, ours)
    if ours is None:
        return theirs_name, theirs
    if not _same_setting(ours, theirs):
        raise ValueError(
            f"{name}={ours!r} and {theirs_name}={theirs!r} are both set and disagree: "
            f"{theirs_name} is Accelerate's name for {name}, and accel reads both. Unset one of "
            "them or give them the same value"
        )
    return name, ours


def read_variable(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of an ``ACCEL_*`` variable, or of Accelerate's ``ACCELERATE_*`` spelling of it.

    The one place where accel reads a variable of its contract: a job script or a library
    written for Accelerate (transformers' ``TrainingArguments`` sets
    ``ACCELERATE_MIXED_PRECISION``) is honoured as if it had used accel's name. See
    :func:`lookup_variable`; None when neither spelling is set.

    Raises:
        ValueError: both spellings are set to different settings; the message names both.
    """
    found = lookup_variable(name, environ)
    return None if found is None else found[1]


def accelerate_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``ACCELERATE_*`` variables of ``environ``, each with the ``ACCEL_*`` name it is read as.

    ``None`` marks a variable accel has no setting for (``ACCELERATE_TPU_NAME``, ...).
    """
    environ = _visible(environ)
    found: dict[str, str | None] = {}
    for key in sorted(environ):
        if not key.startswith(_ACCELERATE_PREFIX):
            continue
        ours = _ACCEL_PREFIX + key.removeprefix(_ACCELERATE_PREFIX)
        found[key] = ours if ours in CONTRACT else None
    return found


def warn_accelerate_variables(environ: Mapping[str, str] | None = None) -> None:
    """Warn once per process about ``ACCELERATE_*`` variables that mean nothing to accel.

    The others are read as their ``ACCEL_*`` names (:func:`read_variable`). One
    ``UserWarning`` names every unknown variable not warned about yet, so that a job script
    moved from Accelerate never runs with a setting silently dropped.
    """
    import warnings

    pending = [
        key
        for key, ours in accelerate_variables(environ).items()
        if ours is None and key not in _warned_accelerate_variables
    ]
    if not pending:
        return
    _warned_accelerate_variables.update(pending)
    warnings.warn(
        f"accel has no setting for these variables of Accelerate's, so they change nothing: "
        f"{', '.join(pending)}",
        UserWarning,
        stacklevel=3,
    )


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Convert a truthy/falsy string to 1/0 (or True/False when ``to_bool``).

    Args:
        value: One of ``y, yes, t, true, on, 1`` or ``n, no, f, false, off, 0`` (any case).
        to_bool: Return a ``bool`` instead of an ``int``.

    Raises:
        ValueError: ``value`` is none of the accepted spellings.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(
        f"invalid truth value {value!r}: use one of {', '.join(_TRUE)} for true "
        f"or {', '.join(_FALSE)} for false"
    )


def get_int_from_env(env_keys: list[str] | tuple[str, ...], default: int) -> int:
    """Return the first non-negative integer found among ``env_keys``, else ``default``.

    ``ACCEL_*`` names are also read in their ``ACCELERATE_*`` spelling (:func:`read_variable`).

    Raises:
        ValueError: a variable is set but is not an integer; both spellings disagree.
    """
    for key in env_keys:
        raw = read_variable(key)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {key}={raw!r} is not an integer: set it to a whole number "
                "or unset it"
            ) from None
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Read a boolean flag from the environment (unset means ``default``).

    ``ACCEL_*`` names are also read in Accelerate's ``ACCELERATE_*`` spelling
    (:func:`read_variable`).

    Raises:
        ValueError: the variable holds something that is not a truth value, or both spellings
            are set and disagree.
    """
    raw = read_variable(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        return bool(str_to_bool(raw, to_bool=True))
    except ValueError as err:
        raise ValueError(f"environment variable {key}: {err}") from None


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Return the value of ``key`` (or its ``ACCELERATE_*`` spelling), else ``default``."""
    value = read_variable(key)
    return str(default) if value is None else value


def convert_dict_to_env_variables(current_env: Mapping[str, Any]) -> list[str]:
    """Render a mapping as ``KEY=value`` lines, skipping entries that would break a shell.

    An entry whose key or value is empty or contains ``;``, ``<``, ``>``, a space or a newline
    is left out with a warning logged on ``accel.utils.environment`` (the module users import
    it from, as Accelerate logs on ``accelerate.utils.environment``).
    """
    import logging

    lines: list[str] = []
    for key, value in current_env.items():
        text = str(value)
        if not key or not text or any(char in key + text for char in _SHELL_BREAKERS):
            logging.getLogger("accel.utils.environment").warning(
                "Skipping %s=%s: empty, or contains one of ';', '<', '>', a space or a newline",
                key,
                text,
            )
            continue
        lines.append(f"{key}={text}\n")
    return lines


_SHELL_BREAKERS = (";", "\n", "<", ">", " ")


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them exactly.

    Keys are upper-cased; values are converted with ``str``. Variables that did not exist
    before are removed afterwards, existing ones get their old value back.
    """
    saved: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        if name not in saved:
            saved[name] = os.environ.get(name)
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` for the duration of a block and restore it afterwards.

    The same ``os.environ`` object is kept, so references to it stay valid.
    """
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def purge_accel_environment(obj: Any) -> Any:
    """Remove ``ACCEL_*`` variables that ``obj`` adds to the environment while it runs.

    ``obj`` may be a function (its calls are wrapped) or a class (each test it runs is
    wrapped, inherited and subclass tests included); variables created during the call are
    deleted and changed ones restored afterwards.
    """
    return _purging(obj, ("ACCEL_",))


def purge_accelerate_environment(obj: Any) -> Any:
    """Accelerate's name for :func:`purge_accel_environment`, covering both prefixes.

    ``ACCEL_*`` and ``ACCELERATE_*`` variables alike: a migrated test suite may set either.
    """
    return _purging(obj, ("ACCEL_", "ACCELERATE_"))


@contextlib.contextmanager
def _restored(prefixes: tuple[str, ...]) -> Iterator[None]:
    before = {key: value for key, value in os.environ.items() if key.startswith(prefixes)}
    try:
        yield
    finally:
        for key in [key for key in os.environ if key.startswith(prefixes)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def _purging(obj: Any, prefixes: tuple[str, ...]) -> Any:
    import functools
    import inspect
    import unittest

    def wrap(func: Any) -> Any:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with _restored(prefixes):
                return func(*args, **kwargs)

        return inner

    if not inspect.isclass(obj):
        return wrap(obj)
    if issubclass(obj, unittest.TestCase):
        # run() covers setUp, the test and tearDown, and subclasses inherit it.
        obj.run = wrap(obj.run)  # type: ignore[method-assign]
        return obj

    def wrap_tests(cls: type) -> None:
        for name, member in list(vars(cls).items()):
            if name.startswith("test") and callable(member):
                setattr(cls, name, wrap(member))

    wrap_tests(obj)
    previous = obj.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(obj, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        wrap_tests(cls)

    obj.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
    return obj
