"""The ``accel launch`` namespace: Accelerate's parser defaults, and which flags were typed.

Code written for Accelerate reads the namespace ``launch_command_parser().parse_args(...)``
returns: it expects Accelerate's defaults on it (``args.fsdp_sync_module_states == "true"``,
``args.rdzv_backend == "static"``, ...) and ``args.nondefault``, the set of destinations the
user typed (Accelerate's ``_validate_launch_command`` copies a config file's sections only
onto the others). accel's parser gives both: :data:`ACCELERATE_LAUNCH_DEFAULTS` are set as
its defaults, and :func:`record_typed_flags` makes every storing action add its destination
to ``nondefault``.

accel's launcher itself tells a given value from a default by ``None`` (flag > environment >
config file > default): an Accelerate default such as ``fsdp_version="1"`` must not count as
a flag. :func:`typed_arguments` therefore gives the launcher a copy of the namespace in which
every such default the user did not type is ``None`` again.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["ACCELERATE_LAUNCH_DEFAULTS", "record_typed_flags", "typed_arguments"]

#: The values ``accelerate launch``'s parser (1.15) gives flags that were not typed, where they
#: are not None or False. Booleans that Accelerate defaults to False stay None here: accel reads
#: None as "not given" and False the same way.
ACCELERATE_LAUNCH_DEFAULTS: dict[str, Any] = {
    "dynamo_mode": "default",
    "tee": "0",
    "role": "default",
    "rdzv_backend": "static",
    "rdzv_conf": "",
    "max_restarts": 0,
    "monitor_interval": 0.1,
    "fsdp_version": "1",
    "fsdp_offload_params": "false",
    "fsdp_min_num_params": 100_000_000,
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_reshard_after_forward": "true",
    "fsdp_forward_prefetch": "false",
    "fsdp_use_orig_params": "true",
    "fsdp_cpu_ram_efficient_loading": "true",
    "fsdp_sync_module_states": "true",
    "fsdp_activation_checkpointing": "false",
    "fsdp_activation_checkpointing_offload": "false",
    "megatron_lm_tp_degree": 1,
    "megatron_lm_pp_degree": 1,
    "megatron_lm_gradient_clipping": 1.0,
    "fp8_margin": 0,
    "fp8_interval": 1,
    "fp8_format": "HYBRID",
    "fp8_amax_history_len": 1024,
    "fp8_amax_compute_algo": "most_recent",
    "fp8_override_linear_precision": (False, False, False),
    "fp8_opt_level": "O2",
    "fp8_enable_fsdp_float8_all_gather": 1,
    "fp8_pad_inner_dim": 1,
    "parallelism_config_dp_replicate_size": 1,
    "parallelism_config_dp_shard_size": 1,
    "parallelism_config_tp_size": 1,
    "parallelism_config_cp_size": 1,
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_size": 1,
    "parallelism_config_sp_backend": "deepspeed",
    "parallelism_config_sp_seq_length_is_variable": True,
    "parallelism_config_sp_attn_implementation": "sdpa",
}

#: The attribute Accelerate's parser records the typed destinations in.
_TYPED = "nondefault"


def _note(namespace: argparse.Namespace, dest: str) -> None:
    typed = getattr(namespace, _TYPED, None)
    if not isinstance(typed, set):
        typed = set()
        setattr(namespace, _TYPED, typed)
    typed.add(dest)


class _Records:
    """Mixed into an argparse action: also record its destination in ``namespace.nondefault``."""

    dest: str

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        _note(namespace, self.dest)


class _TypedStore(_Records, argparse._StoreAction):
    """``store`` that records what was typed."""


class _TypedStoreTrue(_Records, argparse._StoreTrueAction):
    """``store_true`` that records what was typed."""


class _TypedAppend(_Records, argparse._AppendAction):
    """``append`` that records what was typed."""


def record_typed_flags(parser: argparse.ArgumentParser) -> None:
    """Make ``parser``'s typed flags record their destination in ``namespace.nondefault``.

    The ``store``, ``store_true`` and ``append`` actions created from now on add their
    destination to that set when the user types them. Argument groups share the parser's
    registry, so their arguments record too. Positional arguments count as typed, as in
    Accelerate (``training_script``, ``training_script_args``).
    """
    parser.register("action", None, _TypedStore)
    parser.register("action", "store", _TypedStore)
    parser.register("action", "store_true", _TypedStoreTrue)
    parser.register("action", "append", _TypedAppend)


def typed_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` in which the Accelerate defaults the user did not type are None.

    A value counts as typed when ``args.nondefault`` names it, or when it differs from
    :data:`ACCELERATE_LAUNCH_DEFAULTS` (code may assign attributes after parsing). A
    namespace without ``nondefault`` was not parsed (every parse records the training
    script) but built by hand: all its values count. ``args`` itself is not changed.
    """
    copy = argparse.Namespace(**vars(args))
    typed = getattr(args, _TYPED, None)
    if typed is None:
        return copy
    for name, default in ACCELERATE_LAUNCH_DEFAULTS.items():
        if name in typed or not hasattr(copy, name):
            continue
        value = getattr(copy, name)
        if type(value) is type(default) and value == default:
            setattr(copy, name, None)
    return copy
