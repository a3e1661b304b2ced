"""DeepSpeed and FSDP launch settings: resolved like the others, handed over as variables.

``accel launch --use_deepspeed`` and ``--use_fsdp`` start the processes as any multi-process run
(torchrun, one launcher per machine); what they add is the engine's settings, which the
Accelerator in the script reads from its environment (``ACCEL_USE_DEEPSPEED`` with
``ACCEL_DEEPSPEED_*``, ``ACCEL_USE_FSDP`` with ``FSDP_*``; the names live in
:mod:`accel_state.environment`). Each engine setting is resolved with the launcher's one rule:

    command-line flag  >  its environment variable  >  the config file  >  unset

where the config file's values are those of its ``deepspeed_config`` or ``fsdp_config``
mapping, under Accelerate's keys. An unset setting is not exported, so the plugin's own
default applies, and the printed table shows it as ``-``. Settings that contradict each other
are refused before any process starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from accel_state import engine_requests as registry
from accel_state.engine_requests import (
    PARALLELISM_NOT_BUILT,
    REGISTRY,
    EngineRequest,
    accelerate_switch,
    config_requests,
    environment_requests,
)
from accel_state.engine_vocabulary import (
    FSDP2_STATE_DICT_TYPES,
    FSDP_AUTO_WRAP_POLICIES,
    FSDP_BACKWARD_PREFETCHES,
    FSDP_SHARDING_STRATEGIES,
    FSDP_STATE_DICT_TYPES,
    OFFLOAD_DEVICES,
)
from accel_state.environment import (
    ACCEL_CONFIG_DS_FIELDS,
    ACCEL_DEEPSPEED_CONFIG_FILE,
    ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES,
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE,
    ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH,
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE,
    ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH,
    ACCEL_DEEPSPEED_ZERO3_INIT,
    ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL,
    ACCEL_DEEPSPEED_ZERO_STAGE,
    ACCEL_GRADIENT_CLIPPING,
    ACCEL_USE_PARALLELISM_CONFIG,
    FSDP_ACTIVATION_CHECKPOINTING,
    FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_CPU_RAM_EFFICIENT_LOADING,
    FSDP_FORWARD_PREFETCH,
    FSDP_MIN_NUM_PARAMS,
    FSDP_OFFLOAD_PARAMS,
    FSDP_RESHARD_AFTER_FORWARD,
    FSDP_SHARDING_STRATEGY,
    FSDP_STATE_DICT_TYPE,
    FSDP_SYNC_MODULE_STATES,
    FSDP_TRANSFORMER_CLS_TO_WRAP,
    FSDP_USE_ORIG_PARAMS,
    FSDP_VERSION,
    lookup_variable,
)

from .config import ClusterConfig
from .settings import Setting, choice, described, to_bool, to_float, to_int, to_str

__all__ = [
    "DEEPSPEED_KEYS",
    "ENGINES",
    "FSDP_AUTO_WRAP_POLICIES",
    "FSDP_BACKWARD_PREFETCHES",
    "FSDP_KEYS",
    "FSDP_SHARDING_STRATEGIES",
    "FSDP_STATE_DICT_TYPES",
    "OFFLOAD_DEVICES",
    "MEGATRON_LM_FLAGS",
    "PARALLELISM_FLAGS",
    "EngineKey",
    "engine_environment",
    "parallelism_environment",
    "engine_switch_names",
    "launch_engine_requests",
    "resolve_engine_settings",
]

#: The engines whose settings a launch resolves and exports (``none``: plain DDP, or one
#: process): the registry's rows with a config file section.
ENGINES: tuple[str, ...] = ("none", *sorted(spec.key for spec in REGISTRY if spec.settings))
#: ``accel launch --parallelism_config_<name>`` settings (Accelerate's flags).
PARALLELISM_FLAGS: tuple[str, ...] = (
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size",
    "parallelism_config_cp_size",
    "parallelism_config_cp_backend",
    "parallelism_config_cp_comm_strategy",
    "parallelism_config_sp_size",
    "parallelism_config_sp_backend",
    "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable",
    "parallelism_config_sp_attn_implementation",
)
#: ``accel launch --megatron_lm_<name>`` settings (Accelerate's flags): each asks for
#: Megatron-LM.
MEGATRON_LM_FLAGS: tuple[str, ...] = tuple(
    f"megatron_lm_{name}"
    for name in (
        "attention_backend",
        "attention_dropout",
        "attention_softmax_in_fp32",
        "calculate_per_token_loss",
        "context_parallel_size",
        "decoder_last_pipeline_num_layers",
        "eod_mask_loss",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "gradient_clipping",
        "hidden_dropout",
        "no_load_optim",
        "no_save_optim",
        "num_micro_batches",
        "optimizer_cpu_offload",
        "overlap_cpu_optimizer_d2h_h2d",
        "pp_degree",
        "recompute_activations",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "sequence_parallelism",
        "tp_degree",
        "use_custom_fsdp",
        "use_distributed_optimizer",
        "use_precision_aware_optimizer",
        "use_rotary_position_embeddings",
    )
)


def _zero_stage(key: str, raw: Any, source: str) -> int:
    stage = to_int(key, raw, source)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{described(key, raw, source)} is not one of 0, 1, 2, 3")
    return stage


def _positive_float(key: str, raw: Any, source: str) -> float:
    value = to_float(key, raw, source)
    if value <= 0:
        raise ValueError(f"{described(key, raw, source)} must be > 0 (a gradient norm)")
    return value


def _non_negative_int(key: str, raw: Any, source: str) -> int:
    value = to_int(key, raw, source)
    if value < 0:
        raise ValueError(f"{described(key, raw, source)} must be >= 0")
    return value


def _fsdp_version(key: str, raw: Any, source: str) -> int:
    version = to_int(key, raw, source)
    if version == 1:
        raise ValueError(
            f"{described(key, raw, source)}: accel implements FSDP2 (fully_shard) only, FSDP1 is "
            "deprecated in torch. Use 2; `accel to-fsdp2 --config_file CONFIG --output_file "
            "NEW` converts an FSDP1 config file"
        )
    if version != 2:
        raise ValueError(f"{described(key, raw, source)} is not 2 (FSDP2)")
    return version


def _reshard(key: str, raw: Any, source: str) -> bool | str:
    """A boolean (FSDP2) or an FSDP1 sharding strategy name."""
    if isinstance(raw, str) and raw.strip().upper() in FSDP_SHARDING_STRATEGIES:
        return raw.strip().upper()
    try:
        return to_bool(key, raw, source)
    except ValueError:
        raise ValueError(
            f"{described(key, raw, source)} is neither true/false (FSDP2) nor one of "
            f"{', '.join(FSDP_SHARDING_STRATEGIES)} (FSDP1)"
        ) from None


def _class_names(key: str, raw: Any, source: str) -> str:
    if isinstance(raw, (list, tuple)):
        raw = ",".join(str(item) for item in raw)
    return to_str(key, raw, source)


@dataclasses.dataclass(frozen=True)
class EngineKey:
    """One engine setting.

    Attributes:
        name: The setting's name: its flag (``--name``) and its key in the config file's
            ``deepspeed_config`` or ``fsdp_config``.
        variable: The environment variable it is read from and exported as.
        convert: ``(name, raw, source) -> value``; raises ValueError naming all three.
        help: One line for ``accel launch --help``.
    """

    name: str
    variable: str
    convert: Callable[[str, Any, str], Any]
    help: str


#: DeepSpeed settings (``gradient_accumulation_steps`` is a general launch setting).
DEEPSPEED_KEYS: tuple[EngineKey, ...] = (
    EngineKey(
        "deepspeed_config_file",
        ACCEL_DEEPSPEED_CONFIG_FILE,
        to_str,
        "a DeepSpeed JSON config (then set ZeRO and offload there, not with flags)",
    ),
    EngineKey("zero_stage", ACCEL_DEEPSPEED_ZERO_STAGE, _zero_stage, "ZeRO stage: 0, 1, 2 or 3"),
    EngineKey(
        "offload_optimizer_device",
        ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE,
        choice(OFFLOAD_DEVICES, str.lower),
        "where optimizer states go: none, cpu or nvme",
    ),
    EngineKey(
        "offload_param_device",
        ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE,
        choice(OFFLOAD_DEVICES, str.lower),
        "where parameters go (ZeRO-3): none, cpu or nvme",
    ),
    EngineKey(
        "offload_optimizer_nvme_path",
        ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH,
        to_str,
        "folder for optimizer states with --offload_optimizer_device nvme",
    ),
    EngineKey(
        "offload_param_nvme_path",
        ACCEL_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH,
        to_str,
        "folder for parameters with --offload_param_device nvme",
    ),
    EngineKey(
        "gradient_clipping", ACCEL_GRADIENT_CLIPPING, _positive_float, "gradient norm clipping"
    ),
    EngineKey(
        "zero3_init_flag",
        ACCEL_DEEPSPEED_ZERO3_INIT,
        to_bool,
        "true: build the model under deepspeed.zero.Init (ZeRO-3)",
    ),
    EngineKey(
        "zero3_save_16bit_model",
        ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL,
        to_bool,
        "true: gather 16-bit weights when saving (ZeRO-3)",
    ),
    EngineKey(
        "deepspeed_moe_layer_cls_names",
        ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES,
        _class_names,
        "comma-separated MoE layer classes ZeRO-3 keeps whole",
    ),
)

#: FSDP settings.
FSDP_KEYS: tuple[EngineKey, ...] = (
    EngineKey("fsdp_version", FSDP_VERSION, _fsdp_version, "2 (FSDP2; FSDP1 is refused)"),
    EngineKey(
        "fsdp_offload_params",
        FSDP_OFFLOAD_PARAMS,
        to_bool,
        "true/false: offload parameters and gradients to the CPU",
    ),
    EngineKey(
        "fsdp_min_num_params",
        FSDP_MIN_NUM_PARAMS,
        _non_negative_int,
        "smallest module SIZE_BASED_WRAP wraps (parameters)",
    ),
    EngineKey(
        "fsdp_sharding_strategy",
        FSDP_SHARDING_STRATEGY,
        choice(FSDP_SHARDING_STRATEGIES, str.upper),
        "FSDP1: " + ", ".join(FSDP_SHARDING_STRATEGIES),
    ),
    EngineKey(
        "fsdp_reshard_after_forward",
        FSDP_RESHARD_AFTER_FORWARD,
        _reshard,
        "FSDP2: true/false; FSDP1: a sharding strategy",
    ),
    EngineKey(
        "fsdp_auto_wrap_policy",
        FSDP_AUTO_WRAP_POLICY,
        choice(FSDP_AUTO_WRAP_POLICIES, str.upper),
        ", ".join(FSDP_AUTO_WRAP_POLICIES),
    ),
    EngineKey(
        "fsdp_transformer_layer_cls_to_wrap",
        FSDP_TRANSFORMER_CLS_TO_WRAP,
        _class_names,
        "comma-separated layer classes TRANSFORMER_BASED_WRAP wraps (e.g. LlamaDecoderLayer)",
    ),
    EngineKey(
        "fsdp_backward_prefetch",
        FSDP_BACKWARD_PREFETCH,
        choice(FSDP_BACKWARD_PREFETCHES, str.upper),
        "FSDP1: " + ", ".join(FSDP_BACKWARD_PREFETCHES),
    ),
    EngineKey(
        "fsdp_state_dict_type",
        FSDP_STATE_DICT_TYPE,
        choice(FSDP_STATE_DICT_TYPES, str.upper),
        ", ".join(FSDP_STATE_DICT_TYPES) + " (FSDP2: not LOCAL_STATE_DICT)",
    ),
    EngineKey("fsdp_forward_prefetch", FSDP_FORWARD_PREFETCH, to_bool, "FSDP1: true/false"),
    EngineKey("fsdp_use_orig_params", FSDP_USE_ORIG_PARAMS, to_bool, "FSDP1: true/false"),
    EngineKey(
        "fsdp_cpu_ram_efficient_loading",
        FSDP_CPU_RAM_EFFICIENT_LOADING,
        to_bool,
        "true: only rank 0 loads the checkpoint, the others receive its weights",
    ),
    EngineKey(
        "fsdp_sync_module_states",
        FSDP_SYNC_MODULE_STATES,
        to_bool,
        "true/false: broadcast module states from rank 0",
    ),
    EngineKey(
        "fsdp_activation_checkpointing",
        FSDP_ACTIVATION_CHECKPOINTING,
        to_bool,
        "true/false: recompute activations in backward",
    ),
    EngineKey(
        "fsdp_activation_checkpointing_offload",
        FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
        to_bool,
        "true/false: offload checkpointed activations to the CPU (FSDP2)",
    ),
)

_KEYS_BY_ENGINE: dict[str, tuple[EngineKey, ...]] = {
    "deepspeed": DEEPSPEED_KEYS,
    "fsdp": FSDP_KEYS,
}
#: The launch flag and switch of each engine with settings, from the registry (by key, so
#: that messages list them in a stable order).
_SWITCHES: dict[str, tuple[str, str]] = {
    spec.key: (spec.flag.removeprefix("--"), spec.switch)
    for spec in sorted(REGISTRY, key=lambda row: row.key)
    if spec.settings and spec.switch
}
#: ``--fsdp_min_num_params`` when ``SIZE_BASED_WRAP`` is asked for without it, as
#: ``accelerate launch`` has it: a module of that many parameters becomes an FSDP unit.
SIZE_BASED_WRAP_DEFAULT = 100_000_000
#: Path settings, for which Accelerate's ``"none"`` means unset.
_PATHS = frozenset(
    {"deepspeed_config_file", "offload_optimizer_nvme_path", "offload_param_nvme_path"}
)
#: Settings that a DeepSpeed JSON config decides; given next to one, they would be ignored.
_DECIDED_BY_DEEPSPEED_JSON = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_clipping",
    "zero3_save_16bit_model",
)


def launch_engine_requests(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config: ClusterConfig | None,
    config_path: str | None,
) -> list[EngineRequest]:
    """Every engine a launch asks for, with the launcher's precedence: flag > env > config.

    The engine flags (``--use_fsdp``, ``--use_deepspeed``, ``--use_megatron_lm`` or any
    ``--megatron_lm_*``, ``--use_parallelism_config`` or any ``--parallelism_config_*``,
    ``--tpu``) ask first; a
    paradigm flag without an engine (``--cpu``, ``--multi_gpu``) asks for none, whatever the
    environment and the config say; then the ``ACCEL_USE_*`` / ``ACCELERATE_USE_*``
    switches; then the config file's ``distributed_type`` (``FSDP``, ``DEEPSPEED``,
    ``MEGATRON_LM``, ``XLA``) and a non-empty ``parallelism_config`` section.

    Args:
        flags: Flag names (``use_fsdp``, ``tpu``, ``cpu``, ``parallelism_config_tp_size``, ...)
            to their command-line values (None or False: not given).
        environ: The launcher's environment.
        config: The loaded config file, or None.
        config_path: Where it came from, for messages.

    Raises:
        ValueError: an engine switch in ``environ`` holds no truth value.
    """
    requests = [
        EngineRequest(spec.key, spec.flag, f"drop {spec.flag}")
        for spec in registry.ENGINES.values()
        if flags.get(spec.flag.removeprefix("--"))
    ]
    for names, wanted, switch in (
        (PARALLELISM_FLAGS, "parallelism_config", "use_parallelism_config"),
        (MEGATRON_LM_FLAGS, "megatron_lm", "use_megatron_lm"),
    ):
        given = [name for name in names if flags.get(name) is not None]
        if given and not flags.get(switch):
            listed = ", ".join(f"--{name}" for name in given)
            requests.append(EngineRequest(wanted, listed, f"drop {listed}"))
    if requests or flags.get("cpu") or flags.get("multi_gpu"):
        return requests
    requests = environment_requests(environ)
    if requests or config is None:
        return requests
    return config_requests(
        config.distributed_type,
        bool(config.parallelism_config),
        config_path or "the config file",
    )


def engine_switch_names() -> list[str]:
    """Every environment switch that asks for an engine, accel's and Accelerate's names."""
    return [
        name
        for spec in registry.ENGINES.values()
        if spec.switch is not None
        for name in (spec.switch, accelerate_switch(spec.switch))
    ]


def _config_label(config_source: str | None) -> str:
    if not config_source:
        return "config"
    return config_source if config_source.startswith("config") else f"config {config_source}"


def _engine_from_environment(environ: Mapping[str, str]) -> Setting | None:
    chosen = []
    for engine, (_, variable) in _SWITCHES.items():
        found = lookup_variable(variable, environ)
        if found is not None and to_bool(found[0], found[1], f"env {found[0]}"):
            chosen.append((engine, found[0]))
    if len(chosen) > 1:
        names = " and ".join(f"{variable}=true" for _, variable in chosen)
        raise ValueError(f"{names} are both set: choose one engine (unset the other variable)")
    if chosen:
        engine, variable = chosen[0]
        return Setting(engine, f"env {variable}")
    return None


def _engine_from_config(config: ClusterConfig | None, label: str) -> Setting | None:
    if config is None or "distributed_type" not in config.given_keys():
        return None
    for spec in REGISTRY:
        if spec.settings and spec.distributed_type == config.distributed_type:
            return Setting(spec.key, label)
    return Setting("none", label)


def resolve_engine_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config: ClusterConfig | None,
    config_source: str | None,
) -> dict[str, Setting]:
    """Resolve the engine and its settings: flag > environment > config file > unset.

    The engine (``"none"``, ``"deepspeed"`` or ``"fsdp"``) comes from ``flags["engine"]`` (set
    from ``--use_deepspeed``/``--use_fsdp``, or ``"none"`` for ``--cpu``/``--multi_gpu``), else
    ``ACCEL_USE_DEEPSPEED``/``ACCEL_USE_FSDP``, else the config's ``distributed_type``
    (``DEEPSPEED``, ``FSDP``), else ``"none"``. Then each setting of that engine resolves on
    its own; unset ones are ``Setting(None, "default")``.

    Args:
        flags: ``engine`` and engine setting names to command-line values (None: not given).
        environ: The environment to read.
        config: The loaded config file, or None.
        config_source: Where the config came from (shown as ``config <path>``).

    Returns:
        ``engine`` first, then one :class:`Setting` per setting of the selected engine.

    Raises:
        ValueError: a value is invalid, a flag belongs to an engine that is not selected, both
            engine variables are set, or settings contradict each other; the message names
            the settings, their values and sources, and what to change.
    """
    label = _config_label(config_source)
    engine_flag = flags.get("engine")
    if engine_flag is not None and engine_flag not in ENGINES:
        raise ValueError(f"engine={engine_flag!r} is not one of {', '.join(ENGINES)}")
    engine = (
        (Setting(engine_flag, "flag") if engine_flag is not None else None)
        or _engine_from_environment(environ)
        or _engine_from_config(config, label)
        or Setting("none", "default")
    )
    stray = [
        key.name
        for name, keys in _KEYS_BY_ENGINE.items()
        if name != engine.value
        for key in keys
        if flags.get(key.name) is not None
    ]
    if stray:
        needed = {key.name: name for name, keys in _KEYS_BY_ENGINE.items() for key in keys}
        wanted = sorted({needed[name] for name in stray})
        raise ValueError(
            f"{', '.join('--' + name for name in stray)} "
            f"{'is a setting' if len(stray) == 1 else 'are settings'} of "
            f"{' and '.join(wanted)}, but the engine is {engine.value!r} (from {engine.source}): "
            + " or ".join(f"pass --{_SWITCHES[name][0]}" for name in wanted)
            + ", or drop "
            + ("it" if len(stray) == 1 else "them")
        )
    out = {"engine": engine}
    keys = _KEYS_BY_ENGINE.get(str(engine.value), ())
    section: Mapping[str, Any] = {}
    if config is not None and engine.value != "none":
        section = getattr(config, str(registry.ENGINES[str(engine.value)].settings))
    for key in keys:
        out[key.name] = _pick(key, flags, environ, section, label)
    if engine.value == "deepspeed":
        _check_deepspeed(out)
    elif engine.value == "fsdp":
        _check_fsdp(out)
        minimum = out.get("fsdp_min_num_params")
        if out["fsdp_auto_wrap_policy"].value == "SIZE_BASED_WRAP" and (
            minimum is None or minimum.value is None
        ):
            # Accelerate's launcher default: without it the plugin's 0 would wrap nothing.
            out["fsdp_min_num_params"] = Setting(SIZE_BASED_WRAP_DEFAULT, "default")
    return out


def _pick(
    key: EngineKey,
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    section: Mapping[str, Any],
    label: str,
) -> Setting:
    def given(value: Any) -> bool:
        if value is None or (isinstance(value, str) and not value.strip()):
            return False
        # Accelerate writes "none" for a path it does not use.
        return not (key.name in _PATHS and str(value).strip().lower() == "none")

    raw = flags.get(key.name)
    if given(raw):
        return Setting(key.convert(key.name, raw, "flag"), "flag")
    found = lookup_variable(key.variable, environ)
    name, text = found if found is not None else (key.variable, None)
    if given(text):
        source = f"env {name}"
        return Setting(key.convert(key.name, text, source), source)
    value = section.get(key.name)
    if given(value):
        return Setting(key.convert(key.name, value, label), label)
    return Setting(None, "default")


def _describe(settings: Mapping[str, Setting], name: str) -> str:
    item = settings[name]
    return described(name, item.value, item.source)


def _check_deepspeed(settings: Mapping[str, Setting]) -> None:
    json_file = settings["deepspeed_config_file"]
    if json_file.value is not None:
        if not Path(str(json_file.value)).expanduser().is_file():
            raise ValueError(
                f"{_describe(settings, 'deepspeed_config_file')} does not exist: pass the path "
                "of a DeepSpeed JSON config"
            )
        clashing = [name for name in _DECIDED_BY_DEEPSPEED_JSON if settings[name].value is not None]
        if clashing:
            given = "; ".join(_describe(settings, name) for name in clashing)
            raise ValueError(
                f"with {_describe(settings, 'deepspeed_config_file')} the DeepSpeed JSON decides "
                f"these settings, so {given} would be ignored: set them in the JSON file and "
                "drop them here"
            )
    stage = settings["zero_stage"].value
    for device, folder in (
        ("offload_optimizer_device", "offload_optimizer_nvme_path"),
        ("offload_param_device", "offload_param_nvme_path"),
    ):
        if settings[device].value == "nvme" and settings[folder].value is None:
            raise ValueError(
                f"{_describe(settings, device)} needs --{folder} (a folder on the NVMe drive)"
            )
    param = settings["offload_param_device"].value
    if param not in (None, "none") and stage is not None and stage != 3:
        raise ValueError(
            f"{_describe(settings, 'offload_param_device')} needs ZeRO stage 3, but "
            f"{_describe(settings, 'zero_stage')}: pass --zero_stage 3 or drop the offload"
        )
    for flag in ("zero3_init_flag", "zero3_save_16bit_model"):
        if settings[flag].value and stage is not None and stage != 3:
            raise ValueError(
                f"{_describe(settings, flag)} applies to ZeRO stage 3 only, but "
                f"{_describe(settings, 'zero_stage')}: pass --zero_stage 3 or drop it"
            )


def _check_fsdp(settings: Mapping[str, Setting]) -> None:
    version = settings["fsdp_version"].value
    loading = settings["fsdp_cpu_ram_efficient_loading"].value
    if loading and settings["fsdp_sync_module_states"].value is False:
        raise ValueError(
            f"{_describe(settings, 'fsdp_cpu_ram_efficient_loading')} needs the other ranks to "
            f"receive rank 0's weights, but {_describe(settings, 'fsdp_sync_module_states')}: "
            "set fsdp_sync_module_states to true"
        )
    if settings["fsdp_activation_checkpointing_offload"].value:
        if settings["fsdp_activation_checkpointing"].value is not True:
            raise ValueError(
                f"{_describe(settings, 'fsdp_activation_checkpointing_offload')} offloads "
                "checkpointed activations, so it needs fsdp_activation_checkpointing=true "
                f"(now {_describe(settings, 'fsdp_activation_checkpointing')})"
            )
        if version == 1:
            raise ValueError(
                f"{_describe(settings, 'fsdp_activation_checkpointing_offload')} needs FSDP2, "
                f"but {_describe(settings, 'fsdp_version')}: pass --fsdp_version 2"
            )
    reshard = settings["fsdp_reshard_after_forward"].value
    if version == 2 and isinstance(reshard, str):
        raise ValueError(
            f"{_describe(settings, 'fsdp_reshard_after_forward')} is an FSDP1 strategy, but "
            f"{_describe(settings, 'fsdp_version')}: FSDP2 takes true or false"
        )
    if version == 2 and settings["fsdp_state_dict_type"].value == "LOCAL_STATE_DICT":
        raise ValueError(
            f"{_describe(settings, 'fsdp_state_dict_type')} does not exist in FSDP2 "
            f"({_describe(settings, 'fsdp_version')}): use one of "
            f"{', '.join(FSDP2_STATE_DICT_TYPES)}"
        )
    policy = settings["fsdp_auto_wrap_policy"].value
    for key, needs in (
        ("fsdp_transformer_layer_cls_to_wrap", "TRANSFORMER_BASED_WRAP"),
        ("fsdp_min_num_params", "SIZE_BASED_WRAP"),
    ):
        if settings[key].value is not None and policy is not None and policy != needs:
            raise ValueError(
                f"{_describe(settings, key)} is used by the {needs} policy only, but "
                f"{_describe(settings, 'fsdp_auto_wrap_policy')}: drop it or change the policy"
            )


def _export(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def engine_environment(
    settings: Mapping[str, Setting], config: ClusterConfig | None = None
) -> dict[str, str]:
    """The variables that hand the engine and its set settings to the script.

    ``ACCEL_USE_DEEPSPEED=true`` or ``ACCEL_USE_FSDP=true``, then one variable per setting
    that has a value. For DeepSpeed, ``ACCEL_CONFIG_DS_FIELDS`` lists (as Accelerate's
    ``ACCELERATE_CONFIG_DS_FIELDS`` does) the ``deepspeed_config`` keys of the config file,
    plus ``mixed_precision`` when the file sets it. Nothing for the engine ``"none"``.
    """
    engine = settings["engine"].value
    if engine not in _SWITCHES:
        return {}
    env = {_SWITCHES[engine][1]: "true"}
    for key in _KEYS_BY_ENGINE[engine]:
        value = settings[key.name].value
        if key.name == "deepspeed_config_file" and value is not None:
            value = Path(str(value)).expanduser().resolve()  # the script may change folder
        if value is not None:
            env[key.variable] = _export(value)
    if engine == "deepspeed":
        fields = list(config.deepspeed_config) if config is not None else []
        if config is not None and "mixed_precision" in config.given_keys():
            fields.append("mixed_precision")
        env[ACCEL_CONFIG_DS_FIELDS] = ",".join(fields)
    return env


def parallelism_environment(
    flags: Mapping[str, Any], config: ClusterConfig | None
) -> dict[str, str]:
    """``ACCEL_USE_PARALLELISM_CONFIG`` and the ``PARALLELISM_CONFIG_*`` settings for the script.

    From ``--use_parallelism_config`` and the ``--parallelism_config_*`` flags, over the config
    file's ``parallelism_config`` section (its keys with or without the ``parallelism_config_``
    prefix, as Accelerate writes them); a paradigm flag (``--cpu``, ``--multi_gpu``) without a
    parallelism flag leaves the section out, as it does every engine of the config file. The
    Accelerator in each process builds its ``ParallelismConfig`` from these variables.
    """
    given = {name: flags[name] for name in PARALLELISM_FLAGS if flags.get(name) is not None}
    asked = bool(flags.get("use_parallelism_config") or given)
    section: Mapping[str, Any] = {}
    if config is not None and (asked or not (flags.get("cpu") or flags.get("multi_gpu"))):
        section = config.parallelism_config
    if not (asked or section):
        return {}
    env = {ACCEL_USE_PARALLELISM_CONFIG: "true"}
    for key, value in [*section.items(), *given.items()]:  # the flags win
        name = str(key).removeprefix("parallelism_config_")
        env[f"PARALLELISM_CONFIG_{name.upper()}"] = _export(value)
    for size, kind in PARALLELISM_NOT_BUILT.items():
        raw = env.get(f"PARALLELISM_CONFIG_{size.upper()}", "1")
        if raw.strip() not in ("", "1", "None"):
            raise ValueError(
                f"parallelism_config_{size}={raw} asks for {kind}, which this release of accel "
                f"does not implement, so nothing was started: drop --parallelism_config_{size} "
                "(or its config key); the dp_replicate, dp_shard, tp and cp sizes are built"
            )
    return env
