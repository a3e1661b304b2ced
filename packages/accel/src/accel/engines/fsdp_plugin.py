"""``FullyShardedDataParallelPlugin``: Accelerate 1.15's FSDP settings, resolved for FSDP2.

Fields default to ``None`` and are resolved in ``__post_init__`` from the ``FSDP_*`` variables
(``accel launch --use_fsdp --fsdp_*`` writes them), as in Accelerate, with these differences,
all listed in docs/compat.md:

* ``fsdp_version`` defaults to 2: accel has no FSDP1 engine, and an Accelerator given
  ``fsdp_version=1`` refuses it before any process starts (``accel to-fsdp2`` converts an
  FSDP1 config file). Building an FSDP1 plugin still works, so code that only inspects one
  keeps running.
* The precision policy made from the Accelerator's ``mixed_precision`` reduces gradients in
  fp32 and returns fp32 outputs (Accelerate reduces in the low precision).
* ``sharding_strategy`` becomes ``reshard_after_forward`` (``FULL_SHARD``/``HYBRID_SHARD``:
  True, ``SHARD_GRAD_OP``/``_HYBRID_SHARD_ZERO2``: False) and ``NO_SHARD`` is refused (that
  is DDP).

As in Accelerate, the FSDP1-only fields (``backward_prefetch``, also read from
``FSDP_BACKWARD_PREFETCH``; ``use_orig_params``; ``sync_module_states``) are set to ``None``
with one warning logged in Accelerate's words on ``accel.utils.dataclasses``
(``NO_PREFETCH`` says nothing); ``mixed_precision_policy`` is a ``MixedPrecisionPolicy`` or is
refused; ``SIZE_BASED_WRAP`` with ``min_num_params`` unset or 0 wraps nothing (the model is
one unit; ``accel launch`` users pass ``--fsdp_min_num_params``).
``enable_fsdp_ram_efficient_loading`` / ``disable_fsdp_ram_efficient_loading`` set the
variables transformers and this plugin read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from accel_state.engine_vocabulary import (
    FSDP2_STATE_DICT_TYPES,
    FSDP_AUTO_WRAP_POLICIES,
    RESHARD_OF_STRATEGY,
)
from accel_state.environment import (
    ACCEL_USE_FSDP,
    FSDP_ACTIVATION_CHECKPOINTING,
    FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_CPU_RAM_EFFICIENT_LOADING,
    FSDP_IGNORED_MODULES,
    FSDP_MIN_NUM_PARAMS,
    FSDP_OFFLOAD_PARAMS,
    FSDP_RESHARD_AFTER_FORWARD,
    FSDP_SHARDING_STRATEGY,
    FSDP_STATE_DICT_TYPE,
    FSDP_TRANSFORMER_CLS_TO_WRAP,
    FSDP_VERSION,
    accelerate_name,
    lookup_variable,
    str_to_bool,
)
from accel_state.torch_support import require_torch

__all__ = [
    "FSDP_AUTO_WRAP_POLICIES",
    "FullyShardedDataParallelPlugin",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "publish_ram_efficient_loading",
    "require_fsdp2",
]

# Accelerate logs the FSDP2 conversion notes on its module's logger, which a migrated test
# asserts on under accel's name.
logger = logging.getLogger("accel.utils.dataclasses")

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
#: The dtypes a precision policy may hold (Accelerate's list), by the name they are given.
_POLICY_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


def _env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return bool(str_to_bool(raw, to_bool=True))
    except ValueError as error:
        raise ValueError(f"environment variable {name}={raw!r}: {error}") from None


def _to_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return bool(str_to_bool(value, to_bool=True))
        except ValueError as error:
            raise ValueError(
                f"FullyShardedDataParallelPlugin({field}={value!r}): {error}"
            ) from None
    raise ValueError(f"FullyShardedDataParallelPlugin({field}={value!r}): must be True or False")


def _backward_prefetch_name(value: Any) -> str | None:
    """The FSDP1 prefetch mode ``value`` names (a name, its number or torch's enum).

    Raises:
        ValueError: ``value`` names none of them.
    """
    if value is None:
        return None
    name = str(getattr(value, "name", value)).strip().upper()
    if name.isdigit() and 1 <= int(name) <= 2:
        name = _BACKWARD_PREFETCH[int(name) - 1]
    if name not in _BACKWARD_PREFETCH:
        raise ValueError(
            f"FullyShardedDataParallelPlugin(backward_prefetch={value!r}) (or "
            f"{FSDP_BACKWARD_PREFETCH}): choose one of {', '.join(_BACKWARD_PREFETCH)}; FSDP2 "
            "ignores it either way"
        )
    return name


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings with Accelerate 1.15's fields (see the module docstring).

    Raises:
        ValueError: a field or ``FSDP_*`` variable holds a value FSDP2 cannot use (the
            message names the field, the value and the choices).
        accel_state.torch_support.TorchTooOldError: torch has no FSDP2 (older than 2.6).
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[[Any], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        if self.fsdp_version is None:
            raw = os.environ.get(FSDP_VERSION, "").strip() or "2"
            if raw not in ("1", "2"):
                raise ValueError(f"environment variable {FSDP_VERSION}={raw!r}: use 1 or 2")
            self.fsdp_version = int(raw)
        if self.fsdp_version not in (1, 2):
            raise ValueError(
                f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): use 2 "
                "(FSDP2, torch.distributed.fsdp.fully_shard)"
            )
        if self.fsdp_version == 1:
            return  # FSDP1 settings are kept as given; the Accelerator refuses FSDP1
        require_torch("fully_shard", "FullyShardedDataParallelPlugin (FSDP2)")
        self._resolve_sharding()
        self._resolve_obsolete()
        if self.cpu_offload is None:
            self.cpu_offload = _env_flag(FSDP_OFFLOAD_PARAMS)
        self._resolve_offload()
        self.set_state_dict_type(self.state_dict_type)
        self._resolve_wrap_policy()
        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_flag(FSDP_ACTIVATION_CHECKPOINTING)
        self.activation_checkpointing = _to_bool(
            "activation_checkpointing", self.activation_checkpointing
        )
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_flag(FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD)
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError(
                "FullyShardedDataParallelPlugin(activation_checkpointing_offload=True) needs "
                "activation_checkpointing=True (offloading applies to checkpointed activations)"
            )
        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get(FSDP_IGNORED_MODULES) or None
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_flag(FSDP_CPU_RAM_EFFICIENT_LOADING)
        else:
            self.cpu_ram_efficient_loading = _to_bool(
                "cpu_ram_efficient_loading", self.cpu_ram_efficient_loading
            )
            publish_ram_efficient_loading(self.cpu_ram_efficient_loading)
        self._resolve_precision()

    # --- resolution steps --------------------------------------------------------------

    def _resolve_precision(self) -> None:
        """Turn a precision name, dtype or dict into a ``MixedPrecisionPolicy``; refuse others.

        Raises:
            ValueError: anything else, or a name or dtype no policy holds.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if isinstance(policy, str | dict | torch.dtype):
            self.set_mixed_precision(policy, override=True)
        elif policy is not None and not isinstance(policy, MixedPrecisionPolicy):
            raise ValueError(
                "mixed_precision_policy must be an instance of "
                f"`torch.distributed.fsdp.MixedPrecisionPolicy`. Got {policy!r}: pass one, a "
                "precision ('bf16', 'fp16', 'fp32'), a torch dtype, or a dict of param_dtype, "
                "reduce_dtype and output_dtype"
            )

    def _resolve_sharding(self) -> None:
        strategy = self.sharding_strategy
        if self.reshard_after_forward is None and strategy is None:
            raw = os.environ.get(FSDP_RESHARD_AFTER_FORWARD, "").strip()
            strategy_env = os.environ.get(FSDP_SHARDING_STRATEGY, "").strip()
            if raw:
                self.reshard_after_forward = raw
            elif strategy_env:
                strategy = strategy_env
            else:
                self.reshard_after_forward = True
        if strategy is not None and self.reshard_after_forward is None:
            name = str(getattr(strategy, "name", strategy)).upper()
            if name == "NO_SHARD":
                raise ValueError(
                    "FullyShardedDataParallelPlugin(sharding_strategy='NO_SHARD'): nothing would "
                    "be sharded; train with DDP instead (accel launch --multi_gpu, or no plugin)"
                )
            if name not in RESHARD_OF_STRATEGY:
                raise ValueError(
                    f"FullyShardedDataParallelPlugin(sharding_strategy={strategy!r}): choose one "
                    f"of {', '.join(sorted(RESHARD_OF_STRATEGY))}, or set reshard_after_forward"
                )
            self.reshard_after_forward = RESHARD_OF_STRATEGY[name]
        if isinstance(self.reshard_after_forward, str):
            name = self.reshard_after_forward.strip().upper()
            if name in RESHARD_OF_STRATEGY:
                self.reshard_after_forward = RESHARD_OF_STRATEGY[name]
            else:
                self.reshard_after_forward = _to_bool(
                    "reshard_after_forward", self.reshard_after_forward
                )
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward set to {self.reshard_after_forward}. This is not "
                "supported with FSDP2, please set to a `bool`"
            )
        self.sharding_strategy = None

    def _resolve_obsolete(self) -> None:
        """Drop the FSDP1-only settings, logging one warning with Accelerate's notes.

        Raises:
            ValueError: ``backward_prefetch`` names no prefetch mode; ``forward_prefetch``.
        """
        notes = []
        if self.backward_prefetch is None:
            self.backward_prefetch = os.environ.get(FSDP_BACKWARD_PREFETCH, "").strip() or None
        if _backward_prefetch_name(self.backward_prefetch) not in (None, "NO_PREFETCH"):
            notes.append(
                "backward_prefetch is not supported in FSDP2. Setting backward prefetch to None."
            )
        self.backward_prefetch = None
        if self.use_orig_params is not None:
            notes.append(
                "use_orig_params is obsolete in FSDP2, as FSDP2 always uses the original "
                "parameters."
            )
            self.use_orig_params = None
        if self.sync_module_states is not None:
            notes.append(
                "sync_module_states is obsolete in FSDP2, as it is not needed anymore. Setting "
                "sync_module_states to None."
            )
            self.sync_module_states = None
        if notes:
            logger.warning("\n".join(notes))
        if self.forward_prefetch:
            raise ValueError(
                "forward_prefetch is not yet implemented in FSDP2, set to None (accel has no "
                "FSDP1 engine)"
            )
        self.forward_prefetch = None

    def _resolve_offload(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if isinstance(self.cpu_offload, bool):
            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        if not isinstance(self.cpu_offload, OffloadPolicy):
            raise ValueError(
                f"FullyShardedDataParallelPlugin(cpu_offload={self.cpu_offload!r}): use True, "
                "False or a torch.distributed.fsdp.OffloadPolicy (CPUOffloadPolicy())"
            )

    def _resolve_wrap_policy(self) -> None:
        from torch.distributed.fsdp.wrap import (
            size_based_auto_wrap_policy,
            transformer_auto_wrap_policy,
        )

        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = os.environ.get(FSDP_AUTO_WRAP_POLICY, "").strip() or "NO_WRAP"
        if isinstance(self.auto_wrap_policy, str):
            name = self.auto_wrap_policy.upper()
            if name not in FSDP_AUTO_WRAP_POLICIES:
                raise ValueError(
                    f"Invalid auto wrap policy: {self.auto_wrap_policy}. Must be one of "
                    f"{list(FSDP_AUTO_WRAP_POLICIES)}"
                )
            if name == "TRANSFORMER_BASED_WRAP":
                self.auto_wrap_policy = transformer_auto_wrap_policy
            elif name == "SIZE_BASED_WRAP":
                self.auto_wrap_policy = size_based_auto_wrap_policy
            else:
                self.auto_wrap_policy = None
        if self.auto_wrap_policy is transformer_auto_wrap_policy:
            if self.transformer_cls_names_to_wrap is None:
                raw = os.environ.get(FSDP_TRANSFORMER_CLS_TO_WRAP, "").strip()
                if raw:
                    self.transformer_cls_names_to_wrap = [raw]
            names: Any = self.transformer_cls_names_to_wrap
            if isinstance(names, str):
                names = [names]
            if names is not None:
                self.transformer_cls_names_to_wrap = [
                    part.strip() for name in names for part in str(name).split(",") if part.strip()
                ]
        if self.auto_wrap_policy is size_based_auto_wrap_policy:
            if self.min_num_params is None:
                raw = os.environ.get(FSDP_MIN_NUM_PARAMS, "").strip() or "0"
                try:
                    self.min_num_params = int(raw)
                except ValueError:
                    raise ValueError(
                        f"environment variable {FSDP_MIN_NUM_PARAMS}={raw!r}: must be an integer"
                    ) from None
            if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int):
                raise ValueError(
                    f"`min_num_params` must be an integer. Got {self.min_num_params} of type "
                    f"{type(self.min_num_params)}"
                )

    # --- Accelerate's setters ------------------------------------------------------------

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Choose how ``save_state`` stores the model: sharded (default) or full.

        Args:
            state_dict_type: ``"SHARDED_STATE_DICT"``, ``"FULL_STATE_DICT"`` or torch's
                ``StateDictType``; ``None`` reads ``FSDP_STATE_DICT_TYPE``.

        Raises:
            ValueError: ``LOCAL_STATE_DICT`` or an unknown name.
        """
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is None:
            state_dict_type = os.environ.get(FSDP_STATE_DICT_TYPE, "").strip() or (
                "SHARDED_STATE_DICT"
            )
        name = str(getattr(state_dict_type, "name", state_dict_type)).upper()
        if name.isdigit() and 1 <= int(name) <= 3:
            name = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")[int(name) - 1]
        if name == "LOCAL_STATE_DICT":
            raise ValueError(
                "FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to "
                "`SHARDED_STATE_DICT` or `FULL_STATE_DICT`."
            )
        if name not in FSDP2_STATE_DICT_TYPES:
            raise ValueError(
                f"FullyShardedDataParallelPlugin(state_dict_type={state_dict_type!r}): choose "
                f"one of {', '.join(FSDP2_STATE_DICT_TYPES)}"
            )
        self.state_dict_type = StateDictType[name]
        if name == "FULL_STATE_DICT":
            self.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            self.optim_state_dict_config = FullOptimStateDictConfig(
                offload_to_cpu=True, rank0_only=True
            )
        else:
            self.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            self.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)

    @property
    def full_state_dict(self) -> bool:
        """Whether ``save_state`` writes full (rank 0) files instead of sharded DCP folders."""
        return str(getattr(self.state_dict_type, "name", self.state_dict_type)) == (
            "FULL_STATE_DICT"
        )

    def set_mixed_precision(
        self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False
    ) -> None:
        """Make ``mixed_precision_policy`` from a precision name, a dtype or a dict of dtypes.

        ``"bf16"``/``"fp16"`` or ``torch.bfloat16``/``torch.float16`` (``"fp8"`` computes in
        bf16) give parameters in that dtype, gradients reduced in fp32 and fp32 outputs;
        ``"fp32"``/``torch.float32``/``"no"`` cast nothing; a dict gives the
        ``MixedPrecisionPolicy`` fields (``param_dtype``, ``reduce_dtype``, ``output_dtype``:
        bf16, fp16 or fp32, as names or dtypes). An existing policy is kept unless
        ``override``.

        Raises:
            ValueError: an unknown precision, dtype or key.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision_policy is not None and not override:
            if isinstance(self.mixed_precision_policy, MixedPrecisionPolicy):
                return
        if isinstance(mixed_precision, MixedPrecisionPolicy):
            self.mixed_precision_policy = mixed_precision
            return
        if isinstance(mixed_precision, dict):
            unknown = sorted(set(mixed_precision) - {"param_dtype", "reduce_dtype", "output_dtype"})
            if unknown:
                raise ValueError(
                    f"mixed_precision_policy has unknown keys {unknown}: use param_dtype, "
                    "reduce_dtype and output_dtype (FSDP1's buffer_dtype has no FSDP2 meaning)"
                )
            fields = {key: _dtype(key, value) for key, value in mixed_precision.items()}
            self.mixed_precision_policy = MixedPrecisionPolicy(**fields)  # type: ignore[arg-type]
            return
        name = _precision_name(mixed_precision)
        if name in ("no", "fp32"):
            self.mixed_precision_policy = MixedPrecisionPolicy()
            return
        self.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=_PRECISION_DTYPES[name],
            reduce_dtype=torch.float32,
            output_dtype=torch.float32,
        )

    def set_auto_wrap_policy(
        self, model: torch.nn.Module
    ) -> Callable[[torch.nn.Module, set[int]], bool] | None:
        """The predicate that picks the modules sharded as their own unit (None: the root only).

        As in Accelerate, ``auto_wrap_policy`` then holds torch's policy bound to ``model``:
        ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={...})``, or
        ``functools.partial(size_based_auto_wrap_policy, min_num_params=n)``; ``None`` for
        ``NO_WRAP`` and for ``SIZE_BASED_WRAP`` with ``min_num_params`` unset or 0 (nothing is
        wrapped: the model is one unit).

        Raises:
            ValueError: a class name to wrap is not a class of ``model`` (the message lists
                the model's classes). The plugin is left unchanged.
        """
        from torch.distributed.fsdp.wrap import (
            size_based_auto_wrap_policy,
            transformer_auto_wrap_policy,
        )

        predicate = wrap_predicate(self, model)
        policy = self.auto_wrap_policy
        func = policy.func if isinstance(policy, functools.partial) else policy
        if func is transformer_auto_wrap_policy:
            self.auto_wrap_policy = functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls=set(_wrap_classes(self, model))
            )
        elif func is size_based_auto_wrap_policy:
            minimum = int(self.min_num_params or 0)
            self.auto_wrap_policy = (
                functools.partial(size_based_auto_wrap_policy, min_num_params=minimum)
                if minimum > 0
                else None
            )
        return predicate

    def ignored_parameters(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """The parameters of ``ignored_modules`` (a regex of module names, or modules).

        Raises:
            ValueError: the regex matches no module.
        """
        modules: Iterable[torch.nn.Module]
        if self.ignored_modules is None:
            return set()
        if isinstance(self.ignored_modules, str):
            pattern = re.compile(self.ignored_modules)
            modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
            if not modules:
                raise ValueError(
                    f"FullyShardedDataParallelPlugin(ignored_modules={self.ignored_modules!r}) "
                    "matches no module name of the model (full match of names like "
                    "'layers.0.attn')"
                )
        else:
            modules = list(self.ignored_modules)
        return {p for module in modules for p in module.parameters()}


def _precision_name(mixed_precision: Any) -> str:
    """``"no"``, ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` for a precision or a dtype.

    Raises:
        ValueError: neither a known precision nor a dtype a policy holds.
    """
    if isinstance(mixed_precision, torch.dtype):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        if mixed_precision not in names:
            raise ValueError(
                f"Invalid mixed precision: {mixed_precision}. Must be one of "
                f"{list(names)} (or a precision name: no, fp32, fp16, bf16, fp8)"
            )
        return names[mixed_precision]
    name = str(mixed_precision).lower()
    if name not in ("no", "fp32", *_PRECISION_DTYPES):
        raise ValueError(
            f"Invalid mixed precision: {mixed_precision!r}. Must be one of "
            "['no', 'fp8', 'fp16', 'bf16', 'fp32'], a torch dtype or a dict of dtypes"
        )
    return name


def _dtype(key: str, value: Any) -> torch.dtype | None:
    """The dtype a policy field is given as (a name or a dtype; None: no cast).

    Raises:
        ValueError: a dtype other than bf16, fp16 or fp32, or an unknown name.
    """
    if value is None:
        return None
    found = value if isinstance(value, torch.dtype) else _POLICY_DTYPES.get(str(value).lower())
    if found not in _POLICY_DTYPES.values():
        raise ValueError(
            f"mixed_precision_policy[{key!r}]={value!r}: use torch.bfloat16, torch.float16 or "
            f"torch.float32 (or one of the names {', '.join(_POLICY_DTYPES)})"
        )
    return found


def _size_policy(min_num_params: int) -> Callable[[torch.nn.Module, set[int]], bool]:
    """SIZE_BASED_WRAP: a module whose parameters not yet in a unit reach ``min_num_params``."""

    def policy(module: torch.nn.Module, taken: set[int]) -> bool:
        free = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        return free > 0 and free >= min_num_params

    return policy


def _wrap_classes(
    plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module
) -> tuple[type[torch.nn.Module], ...]:
    """The classes TRANSFORMER_BASED_WRAP wraps (by name: the plugin's, else the model's).

    Raises:
        ValueError: a name is not a class of ``model``, or there is no name at all.
    """
    names = plugin.transformer_cls_names_to_wrap
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__: type(m) for m in model.modules()}
    classes = []
    for name in names:
        if name not in present:
            raise ValueError(
                f"Could not find the transformer layer class {name} in the model. Its "
                f"classes are: {', '.join(sorted(present))} (set "
                "transformer_cls_names_to_wrap / --fsdp_transformer_layer_cls_to_wrap)"
            )
        classes.append(present[name])
    if not classes:
        raise ValueError(
            "auto_wrap_policy=TRANSFORMER_BASED_WRAP needs the layer classes to wrap: set "
            "transformer_cls_names_to_wrap (the model has no _no_split_modules)"
        )
    return tuple(classes)


def wrap_predicate(
    plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module
) -> Callable[[torch.nn.Module, set[int]], bool] | None:
    """The plugin's wrap policy as ``predicate(module, params already in a unit) -> bool``.

    Containers without a ``forward`` (``ModuleList``, ``ModuleDict``) are never picked: torch
    cannot shard them as a unit (Accelerate's size policy picks them and crashes).

    Raises:
        ValueError: a class name to wrap is not in the model.
    """
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    policy = plugin.auto_wrap_policy
    func = policy.func if isinstance(policy, functools.partial) else policy
    if policy is None:
        return None
    if func is transformer_auto_wrap_policy:
        wanted = _wrap_classes(plugin, model)
        return lambda module, taken: isinstance(module, wanted)
    if func is size_based_auto_wrap_policy:
        minimum = int(plugin.min_num_params or 0)
        # 0 (unset) wraps nothing, as in Accelerate, where the launcher's default is 1e8.
        return _size_policy(minimum) if minimum > 0 else None
    if callable(policy):
        user = policy

        def custom(module: torch.nn.Module, taken: set[int]) -> bool:
            free = sum(p.numel() for p in module.parameters() if id(p) not in taken)
            try:
                return bool(user(module=module, recurse=False, nonwrapped_numel=free))
            except TypeError:
                return bool(user(module))

        return custom
    raise ValueError(
        f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}): use one of "
        f"{', '.join(FSDP_AUTO_WRAP_POLICIES)} or a callable"
    )


def require_fsdp2(plugin: Any) -> None:
    """Refuse an FSDP1 plugin (or another object) before anything starts: FSDP2 only.

    Raises:
        TypeError: ``plugin`` is not a ``FullyShardedDataParallelPlugin``.
        ValueError: naming the version, the reason and the conversion command.
    """
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"Accelerator(fsdp_plugin={plugin!r}): pass an accel.FullyShardedDataParallelPlugin "
            "(from accel or accel.utils)"
        )
    version = plugin.fsdp_version
    if version == 2:
        return
    raise ValueError(
        f"FullyShardedDataParallelPlugin(fsdp_version={version!r}): accel implements FSDP2 "
        "(torch.distributed.fsdp.fully_shard) only; FSDP1 (FullyShardedDataParallel with flat "
        "parameters) is deprecated in torch. Use fsdp_version=2 (FSDP_VERSION=2, or "
        "`accel launch --fsdp_version 2`); `accel to-fsdp2 --config_file CONFIG --output_file "
        "NEW` converts an FSDP1 config file"
    )


def enable_fsdp_ram_efficient_loading() -> None:
    """Make transformers load pretrained weights on rank 0 only (the others on ``meta``).

    Sets ``FSDP_CPU_RAM_EFFICIENT_LOADING=True``, and, when neither ``ACCEL_USE_FSDP`` nor
    Accelerate's ``ACCELERATE_USE_FSDP`` is set, both of them to ``True`` (transformers reads
    the latter to know FSDP is on; accel then trains with the FSDP2 engine, as Accelerate
    does). A run that already says whether it uses FSDP keeps its setting. An FSDP2 plugin
    built afterwards reads ``cpu_ram_efficient_loading=True``.

    Raises:
        ValueError: ``ACCEL_USE_FSDP`` and ``ACCELERATE_USE_FSDP`` are both set and disagree.
    """
    if lookup_variable(ACCEL_USE_FSDP) is None:
        os.environ[ACCEL_USE_FSDP] = "True"
        # transformers' is_fsdp_enabled() reads Accelerate's name of the switch.
        os.environ[str(accelerate_name(ACCEL_USE_FSDP))] = "True"
    publish_ram_efficient_loading(True)


def disable_fsdp_ram_efficient_loading() -> None:
    """Make every rank load the pretrained weights (``FSDP_CPU_RAM_EFFICIENT_LOADING=False``)."""
    publish_ram_efficient_loading(False)


def publish_ram_efficient_loading(enabled: bool) -> None:
    """Write ``FSDP_CPU_RAM_EFFICIENT_LOADING``: the one place accel writes it.

    The variable is a contract with other libraries, not accel's own state: transformers'
    ``from_pretrained`` reads it (beside ``ACCELERATE_USE_FSDP``, its ``is_fsdp_enabled()``)
    to load pretrained weights on rank 0 only and build the other ranks' models on ``meta``;
    an FSDP2 plugin built later reads it back as its default. ``accel launch`` exports it from
    ``--fsdp_cpu_ram_efficient_loading`` to the processes it starts.
    """
    os.environ[FSDP_CPU_RAM_EFFICIENT_LOADING] = str(enabled)
