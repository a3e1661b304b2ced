"""``ParallelismConfig``: the parallel groups of a run and the named ``DeviceMesh`` they form.

The processes split into data-replicate, data-shard, tensor, context and sequence groups.

This module holds the configuration, its validation and the mesh it describes; training with
one is :mod:`accel.parallelism`'s. ``Accelerator(parallelism_config=...)`` trains data
replication (DDP, or HSDP with FSDP2), data sharding (FSDP2), tensor parallelism (alone, or
with FSDP2 beside it) and context parallelism (with FSDP2, on CUDA devices), after checking the
sizes against the world size and the engine before any process group exists. Sequence
parallelism (``sp_size > 1``) is configured and validated here but not trained in this
release: such a run is refused before anything starts
(:func:`accel.parallelism.check_parallelism_config`), never silently dropped.

Mesh dimensions, in this order and only when their size is above 1: ``dp_replicate``,
``dp_shard``, ``cp``, ``sp``, ``tp``; :meth:`ParallelismConfig.build_device_mesh` adds the
flattened ``dp`` (replicate x shard), ``dp_shard_cp`` (what FSDP shards over) and ``dp_cp``
(what the loss is averaged over).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

from accel_state.environment import (
    PARALLELISM_CONFIG_CP_BACKEND,
    PARALLELISM_CONFIG_CP_COMM_STRATEGY,
    PARALLELISM_CONFIG_CP_SIZE,
    PARALLELISM_CONFIG_DP_REPLICATE_SIZE,
    PARALLELISM_CONFIG_DP_SHARD_SIZE,
    PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION,
    PARALLELISM_CONFIG_SP_BACKEND,
    PARALLELISM_CONFIG_SP_SEQ_LENGTH,
    PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE,
    PARALLELISM_CONFIG_SP_SIZE,
    PARALLELISM_CONFIG_TP_SIZE,
    str_to_bool,
)
from accel_state.torch_support import TORCH_FEATURES, torch_has

__all__ = [
    "DeepSpeedSequenceParallelConfig",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]

_CP_STRATEGIES = ("allgather", "alltoall")
_SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")
_MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel settings of a :class:`ParallelismConfig`.

    Args:
        enable_async_tp: Asynchronous tensor parallelism; not supported (a warning says so and
            the option is ignored, as in Accelerate). Unlike Accelerate, transformers is not
            required.
    """

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn(
                "TorchTensorParallelConfig(enable_async_tp=True): asynchronous tensor "
                "parallelism is not supported; the option is ignored",
                stacklevel=2,
            )


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Context-parallel settings of a :class:`ParallelismConfig` (torch's implementation).

    Args:
        cp_comm_strategy: ``"allgather"`` or ``"alltoall"``; None reads
            ``PARALLELISM_CONFIG_CP_COMM_STRATEGY`` (default ``"allgather"``).

    Raises:
        ValueError: an unknown strategy, or a torch without context parallelism (older than
            2.6, ``accel_state.torch_support``).
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if not torch_has("context_parallel"):
            since = TORCH_FEATURES["context_parallel"].since
            raise ValueError(
                f"context parallelism needs torch >= {since}; this is torch {torch.__version__}: "
                f"upgrade torch (pip install 'torch>={since}') or leave cp_size at 1"
            )
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(PARALLELISM_CONFIG_CP_COMM_STRATEGY, "allgather")
        if self.cp_comm_strategy not in _CP_STRATEGIES:
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Choose one of "
                f"{', '.join(_CP_STRATEGIES)} (argument cp_comm_strategy or "
                f"{PARALLELISM_CONFIG_CP_COMM_STRATEGY})"
            )


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """Sequence-parallel settings of a :class:`ParallelismConfig` (DeepSpeed's ALST/Ulysses).

    Args:
        sp_seq_length: The sequence length when every batch has the same one.
        sp_seq_length_is_variable: Lengths change between batches; None reads
            ``PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE`` (default True).
        sp_attn_implementation: ``"sdpa"``, ``"flash_attention_2"``, ``"flash_attention_3"`` or
            a hub flash-attention kernel (``"kernels-community/flash-attn2"``); None reads
            ``PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION``.

    Raises:
        ValueError: a fixed length is asked for without one; an attention implementation that
            sequence parallelism cannot use.
    """

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            raw = os.environ.get(PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE, "true")
            self.sp_seq_length_is_variable = bool(str_to_bool(raw, to_bool=True))
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            raw_length = os.environ.get(PARALLELISM_CONFIG_SP_SEQ_LENGTH)
            if raw_length is None:
                raise ValueError(
                    "DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False) needs the "
                    "sequence length: pass sp_seq_length or set "
                    f"{PARALLELISM_CONFIG_SP_SEQ_LENGTH}"
                )
            self.sp_seq_length = None if raw_length == "None" else int(raw_length)
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = os.environ.get(PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION)
        name = self.sp_attn_implementation
        if name is None or name in _SP_ATTENTION:
            return
        if name in ("eager", "flex_attention") or "/" not in name or "flash-attn" not in name:
            raise ValueError(
                f"Invalid sp_attn_implementation: {name}. Sequence parallelism runs with one of "
                f"{', '.join(_SP_ATTENTION)} or a hub flash-attention kernel such as "
                "'kernels-community/flash-attn2' (not eager or flex_attention)"
            )


_HANDLER_TYPES = (
    TorchTensorParallelConfig,
    TorchContextParallelConfig,
    DeepSpeedSequenceParallelConfig,
)


def _size(name: str, value: int | None, variable: str) -> int:
    if value is None:
        raw = os.environ.get(variable, "1")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"{variable}={raw!r} is not a whole number: set {name} or the variable to an "
                "integer >= 1"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ParallelismConfig({name}={value!r}): must be an integer >= 1")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, but got {value}")
    return value


@dataclasses.dataclass
class ParallelismConfig:
    """How the processes split into parallel groups (Accelerate 1.15's ``ParallelismConfig``).

    ``dp_shard_size > 1`` alone is FSDP; with ``dp_replicate_size > 1`` too it is HSDP;
    ``dp_replicate_size > 1`` alone is plain data parallelism. Every size left None is read from
    its ``PARALLELISM_CONFIG_*`` variable (default 1).

    Args:
        dp_replicate_size: Replicas of the (sharded) model.
        dp_shard_size: Processes one replica is sharded over.
        tp_size: Tensor-parallel group size.
        cp_size: Context-parallel group size.
        cp_backend: ``"torch"``.
        sp_size: Sequence-parallel group size (exclusive with ``cp_size > 1``).
        sp_backend: ``"deepspeed"``.
        tp_handler: Tensor-parallel settings; a default one is made when ``tp_size > 1``.
        cp_handler: Context-parallel settings; a default one is made when ``cp_size > 1``.
        sp_handler: Sequence-parallel settings; a default one is made when ``sp_size > 1``.

    Raises:
        ValueError: a size below 1 or not an integer, an unknown backend, CP and SP together,
            TP or CP over pure replication, a handler of the wrong class.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None
    device_mesh: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.dp_replicate_size = _size(
            "dp_replicate_size", self.dp_replicate_size, PARALLELISM_CONFIG_DP_REPLICATE_SIZE
        )
        self.dp_shard_size = _size(
            "dp_shard_size", self.dp_shard_size, PARALLELISM_CONFIG_DP_SHARD_SIZE
        )
        self.tp_size = _size("tp_size", self.tp_size, PARALLELISM_CONFIG_TP_SIZE)
        self.cp_size = _size("cp_size", self.cp_size, PARALLELISM_CONFIG_CP_SIZE)
        self.sp_size = _size("sp_size", self.sp_size, PARALLELISM_CONFIG_SP_SIZE)
        if self.cp_backend is None:
            self.cp_backend = os.environ.get(PARALLELISM_CONFIG_CP_BACKEND, "torch")
        if self.sp_backend is None:
            self.sp_backend = os.environ.get(PARALLELISM_CONFIG_SP_BACKEND, "deepspeed")
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be one of ['torch'], but got {self.cp_backend}")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend}")
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                "Context parallelism (CP) and sequence parallelism (SP) are mutually exclusive: "
                f"got cp_size={self.cp_size} and sp_size={self.sp_size}; set one of them to 1"
            )
        if (
            (self.tp_size > 1 or self.cp_size > 1)
            and self.dp_replicate_size > 1
            and self.dp_shard_size == 1
        ):
            raise ValueError(
                f"tp_size={self.tp_size} / cp_size={self.cp_size} cannot be combined with pure "
                f"replication (dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1): "
                "set dp_shard_size > 1 (FSDP or HSDP underneath TP/CP)"
            )
        self._set_handlers()

    def _set_handlers(self) -> None:
        handlers: tuple[tuple[str, type], ...] = (
            ("tp", TorchTensorParallelConfig),
            ("cp", TorchContextParallelConfig),
            ("sp", DeepSpeedSequenceParallelConfig),
        )
        for kind, cls in handlers:
            size = self._sizes[kind]
            handler = getattr(self, f"{kind}_handler")
            if handler is not None and not isinstance(handler, cls):
                raise ValueError(
                    f"ParallelismConfig({kind}_handler={handler!r}): expected a {cls.__name__}"
                )
            if handler is None and size > 1:
                setattr(self, f"{kind}_handler", cls())

    # --- sizes ------------------------------------------------------------------------------

    @property
    def _sizes(self) -> dict[str, int]:
        return {
            "dp_replicate": int(self.dp_replicate_size or 1),
            "dp_shard": int(self.dp_shard_size or 1),
            "tp": int(self.tp_size or 1),
            "cp": int(self.cp_size or 1),
            "sp": int(self.sp_size or 1),
        }

    @property
    def total_size(self) -> int:
        """Processes the configuration needs: the product of every size."""
        sizes = self._sizes
        return sizes["dp_replicate"] * sizes["dp_shard"] * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Replicas x shards: the processes that see different batches."""
        return self._sizes["dp_replicate"] * self._sizes["dp_shard"]

    @property
    def non_data_parallel_size(self) -> int:
        """Tp x cp x sp: the processes that see the same batch."""
        return self._sizes["tp"] * self._sizes["cp"] * self._sizes["sp"]

    @property
    def dp_replicate_enabled(self) -> bool:
        """``dp_replicate_size > 1``."""
        return self._sizes["dp_replicate"] > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """``dp_shard_size > 1``."""
        return self._sizes["dp_shard"] > 1

    @property
    def tp_enabled(self) -> bool:
        """``tp_size > 1``."""
        return self._sizes["tp"] > 1

    @property
    def cp_enabled(self) -> bool:
        """``cp_size > 1``."""
        return self._sizes["cp"] > 1

    @property
    def sp_enabled(self) -> bool:
        """``sp_size > 1``."""
        return self._sizes["sp"] > 1

    # --- mesh dimension names ---------------------------------------------------------------

    def _enabled(self, *names: str) -> list[str]:
        return [name for name in names if self._sizes[name] > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled data-parallel dimensions (different batches)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose processes receive the same batch."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the one FSDP shards over."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions the loss is averaged over."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP applies to: replication (if any), then ``dp_shard_cp``."""
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension: data-parallel ones first."""
        return self.dp_dim_names + self.non_dp_dim_names

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        """``(dimension names, sizes)`` in mesh order, or ``()`` when nothing is enabled."""
        active = set(self.active_mesh_dims)
        names = tuple(name for name in _MESH_ORDER if name in active)
        if not names:
            return ()
        return names, tuple(self._sizes[name] for name in names)

    def build_device_mesh(self, device_type: str) -> Any:
        """Build the named ``DeviceMesh`` on ``device_type`` with its flattened dimensions.

        Returns None when no dimension is enabled, or for DeepSpeed sequence parallelism
        (DeepSpeed builds its own groups). Needs an initialised process group of
        ``total_size`` processes.
        """
        if self.sp_backend == "deepspeed" and self.sp_enabled:
            return None
        from torch.distributed import device_mesh as mesh_module

        mesh = self._get_mesh()
        if not mesh:
            return None
        names, shape = mesh
        device_mesh = mesh_module.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for dims, flat in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if dims:
                # A list, as Accelerate passes (torch accepts it; its tests compare it).
                device_mesh[dims]._flatten(flat)  # type: ignore[index]
        return device_mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh, built on first use (then ``device_type`` is required).

        Raises:
            ValueError: no mesh yet and no ``device_type``; a mesh of another device type.
        """
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError(
                    "ParallelismConfig.get_device_mesh(): no mesh has been built yet; pass the "
                    "device type, e.g. get_device_mesh('cuda')"
                )
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"ParallelismConfig.get_device_mesh({device_type!r}): the mesh was built on "
                f"{self.device_mesh.device_type!r}"
            )
        return self.device_mesh

    def to_json(self) -> dict[str, Any]:
        """The settings as plain values (handlers as dicts; the mesh is left out)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name == "device_mesh":
                continue
            value = getattr(self, field.name)
            if isinstance(value, _HANDLER_TYPES):
                value = dataclasses.asdict(value)
            out[field.name] = value
        return out


def refuse_recurrent_layers_under_sequence_parallelism(model: Any) -> None:
    """Refuse a model whose layers carry a state along the sequence, for sequence parallelism.

    Ulysses-style sequence parallelism gathers the whole sequence only around attention; a
    linear-attention layer (``"linear_attention"`` in ``config.layer_types``) carries a
    recurrent state along the sequence inside its own code, so each rank would restart it from
    zero and the gradients would be silently wrong.

    Raises:
        ValueError: the model's config lists such layer types (they are named).
    """
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        config = text_config()
    layer_types = getattr(config, "layer_types", None) or []
    recurrent = sorted({kind for kind in layer_types if "linear_attention" in kind})
    if recurrent:
        raise ValueError(
            f"Sequence parallelism cannot shard {type(model).__name__}: its layers of type "
            f"{recurrent} carry a recurrent state along the sequence, which each rank would "
            "restart from zero (wrong gradients without an error). Use a full-attention "
            "model, or turn sequence parallelism off (sp_size=1)."
        )
