"""A run with a ``ParallelismConfig``: checked before any process group, then its device mesh.

``Accelerator(parallelism_config=...)`` (or ``ACCEL_USE_PARALLELISM_CONFIG=true`` with the
``PARALLELISM_CONFIG_*`` sizes, which ``accel launch --use_parallelism_config
--parallelism_config_*`` writes) composes data replication, data sharding, tensor and context
parallelism on a named ``DeviceMesh``:

* ``dp_shard_size > 1``: FSDP2 shards over the ``dp_shard`` dimension; with
  ``dp_replicate_size > 1`` too it is HSDP (FSDP2 over the 2-D ``(dp_replicate,
  dp_shard_cp)`` mesh: each replica group holds whole shards, gradients are reduce-scattered in
  a replica and all-reduced across replicas). Sharding needs the FSDP2 engine
  (``fsdp_plugin`` or ``--use_fsdp``); without it the run is refused, never trained unsharded.
* ``dp_replicate_size > 1`` alone: plain data parallelism (DDP, or FSDP2 is refused: it would
  have nothing to shard over).
* ``tp_size > 1``: a model split over ``tp`` (:mod:`accel.tensor_parallel`), trained by the
  tensor-parallel engine alone or by FSDP2 over the data-parallel dimensions beside it.
* ``cp_size > 1``: sequences split over ``cp`` (:mod:`accel.context_parallel`), with FSDP2
  averaging over ``dp_shard_cp``; refused on devices where torch's ring attention cannot run.
* every size 1 (the default): ``dp_replicate_size`` becomes the number of processes, as in
  Accelerate.

Everything is checked against the world size *before* the process group and the mesh exist
(Accelerate builds the mesh first and refuses afterwards): each error names every size and the
world size. Sequence parallelism (``sp_size`` above 1) is not in this release and is refused
the same way, before anything starts.

The mesh is built on the run's device type (``gloo`` on CPU included) with Accelerate's
dimensions and flattened views (``dp``, ``dp_shard_cp``, ``dp_cp``), stored as
``accelerator.torch_device_mesh``; the ranks along it are ``data_parallel_rank``,
``data_parallel_shard_rank``, ``tensor_parallel_rank`` and ``context_parallel_rank``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from accel_state import get_process_topology
from accel_state.engine_requests import PARALLELISM_NOT_BUILT, EngineRequest

from .parallelism_config import ParallelismConfig

__all__ = [
    "MeshRanks",
    "build_device_mesh",
    "check_context_parallel_device",
    "check_parallelism_config",
    "mesh_rank",
    "resolve_parallelism",
]


def resolve_parallelism(
    config: Any, torch_tp_plugin: Any, requests: Sequence[EngineRequest]
) -> ParallelismConfig | None:
    """The run's ``ParallelismConfig``: the argument, the old TP plugin's, or the environment's.

    Raises:
        TypeError: ``parallelism_config`` is not a ``ParallelismConfig``, or
            ``torch_tp_plugin`` not a ``TorchTensorParallelPlugin``.
        ValueError: both ``parallelism_config`` and ``torch_tp_plugin`` were given.
    """
    if config is not None and torch_tp_plugin is not None:
        raise ValueError(
            "Accelerator(parallelism_config=..., torch_tp_plugin=...): torch_tp_plugin is the "
            "old spelling of ParallelismConfig(tp_size=...); pass only parallelism_config"
        )
    if torch_tp_plugin is not None:
        size = getattr(torch_tp_plugin, "tp_size", None)
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(
                f"Accelerator(torch_tp_plugin={torch_tp_plugin!r}): expected a "
                "TorchTensorParallelPlugin (or pass parallelism_config=ParallelismConfig(...))"
            )
        warnings.warn(
            "Accelerator(torch_tp_plugin=...) is deprecated (as in Accelerate): pass "
            f"parallelism_config=ParallelismConfig(tp_size={size}) instead",
            FutureWarning,
            stacklevel=3,
        )
        return ParallelismConfig(tp_size=size)
    if config is None:
        if any(request.engine == "parallelism_config" for request in requests):
            return ParallelismConfig()  # the PARALLELISM_CONFIG_* variables
        return None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(
            f"Accelerator(parallelism_config={config!r}): expected an accel.ParallelismConfig"
        )
    return config


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return get_process_topology(os.environ).world_size


def _describe(config: ParallelismConfig) -> str:
    return (
        f"dp_replicate_size={config.dp_replicate_size}, dp_shard_size={config.dp_shard_size}, "
        f"tp_size={config.tp_size}, cp_size={config.cp_size}, sp_size={config.sp_size}"
    )


def check_parallelism_config(config: ParallelismConfig, *, fsdp: bool, deepspeed: bool) -> None:
    """Check ``config`` against the world size and the engine, before any group exists.

    With every size 1 and several processes, ``dp_replicate_size`` becomes the number of
    processes (Accelerate's default), in place.

    Raises:
        NotImplementedError: sequence parallelism was asked for.
        ValueError: the sizes' product is not the number of processes; sharding (or context
            parallelism) without the FSDP2 engine; FSDP2 with nothing to shard over;
            DeepSpeed with any layout (DeepSpeed builds its own groups). Tensor or context
            parallelism beside pure replication is refused by ``ParallelismConfig`` itself.
    """
    for name, kind in PARALLELISM_NOT_BUILT.items():
        if (getattr(config, name) or 1) > 1:
            raise NotImplementedError(
                f"ParallelismConfig({name}={getattr(config, name)}) asks for {kind}, which this "
                "release of accel does not implement, so nothing was started "
                f"({_describe(config)}). "
                f"Set {name}=1 (dp_replicate_size, dp_shard_size, tp_size and cp_size are built)"
            )
    world = _world_size()
    if config.total_size == 1 and world > 1:
        config.dp_replicate_size = world
    if config.total_size != world:
        raise ValueError(
            f"ParallelismConfig({_describe(config)}) needs {config.total_size} processes (the "
            f"product of the sizes), but the run has {world}: make the product {world}, or "
            f"launch {config.total_size} processes"
        )
    shard = config.dp_shard_size or 1
    tp, cp = config.tp_size or 1, config.cp_size or 1
    model_parallel = [f"{name}_size={size}" for name, size in (("tp", tp), ("cp", cp)) if size > 1]
    if deepspeed and config.total_size > 1 and (shard > 1 or model_parallel):
        raise ValueError(
            f"ParallelismConfig({_describe(config)}) with DeepSpeed: DeepSpeed shards by its "
            "ZeRO stage over its own groups and does not train accel's tensor- or "
            "context-parallel meshes; drop parallelism_config, or use FSDP2"
        )
    if cp > 1 and not fsdp:
        raise ValueError(
            f"ParallelismConfig(cp_size={cp}) splits each sequence over "
            f"{cp} ranks, whose gradients FSDP2 averages (over dp_shard_cp): "
            "pass fsdp_plugin=FullyShardedDataParallelPlugin() (or launch with --use_fsdp)"
        )
    if shard > 1 and not fsdp:
        raise ValueError(
            f"ParallelismConfig(dp_shard_size={config.dp_shard_size}) shards the model, which "
            "the FSDP2 engine does: pass fsdp_plugin=FullyShardedDataParallelPlugin() (or launch "
            "with --use_fsdp / ACCEL_USE_FSDP=true), or set dp_shard_size=1 to replicate only"
        )
    if fsdp and shard == 1 and cp == 1 and world > 1:
        raise ValueError(
            f"FSDP2 with ParallelismConfig({_describe(config)}): no dimension is left for FSDP2 to "
            f"shard over (dp_shard_size and cp_size are 1). Set dp_shard_size (e.g. "
            f"dp_shard_size={world // tp}), or drop the FSDP request"
        )


def check_context_parallel_device(config: ParallelismConfig, *, cpu: bool) -> None:
    """Refuse context parallelism where torch's implementation cannot run (before any group).

    Args:
        config: The run's config.
        cpu: Whether the run computes on the CPU (``cpu=True`` or ``ACCEL_USE_CPU``).

    Raises:
        NotImplementedError: ``cp_size > 1`` on the CPU or on a machine without CUDA.
    """
    if (config.cp_size or 1) <= 1:
        return
    import torch

    if cpu or not torch.cuda.is_available():
        where = "the CPU" if cpu else "a machine without a CUDA device"
        raise NotImplementedError(
            f"ParallelismConfig(cp_size={config.cp_size}) on {where}: torch's context "
            "parallelism swaps scaled_dot_product_attention's flash, memory-efficient and cuDNN "
            "kernels for ring attention, and only CUDA (and ROCm) devices have them (on the "
            "CPU, SDPA runs a kernel it does not split), so nothing was started. Run context "
            "parallel jobs on CUDA devices, or set cp_size=1"
        )


def build_device_mesh(config: ParallelismConfig, device_type: str) -> Any:
    """The run's named mesh (None for one process: nothing to lay out)."""
    if config.total_size == 1:
        return None
    return config.get_device_mesh(device_type)


def mesh_rank(state: Any, dim: str, what: str) -> int:
    """This process's rank along ``dim`` of the run's mesh (0 when that size is 1).

    Raises:
        RuntimeError: the run has no ``ParallelismConfig``.
    """
    config = getattr(state, "parallelism_config", None)
    if config is None:
        raise RuntimeError(
            f"{what} is not configured: pass Accelerator(parallelism_config=ParallelismConfig("
            "...)) to lay the processes out on a mesh"
        )
    mesh = getattr(state, "device_mesh", None)
    if config._sizes[dim] == 1 or mesh is None:
        return 0
    return int(mesh.get_local_rank(dim))


class MeshRanks:
    """The ``Accelerator``'s view of its ``ParallelismConfig`` and mesh (reads ``self.state``)."""

    state: Any

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The run's ``ParallelismConfig`` (None without one)."""
        return getattr(self.state, "parallelism_config", None)

    @property
    def torch_device_mesh(self) -> Any:
        """The run's named ``DeviceMesh`` (None without a ``ParallelismConfig`` or alone)."""
        return getattr(self.state, "device_mesh", None)

    @property
    def data_parallel_rank(self) -> int:
        """Rank along ``dp_replicate`` (0 when the model is not replicated).

        Raises:
            RuntimeError: the run has no ``ParallelismConfig``.
        """
        return mesh_rank(self.state, "dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """Rank along ``dp_shard`` (0 when the model is not sharded).

        Raises:
            RuntimeError: the run has no ``ParallelismConfig``.
        """
        return mesh_rank(self.state, "dp_shard", "Shard-based data parallelism")

    @property
    def tensor_parallel_rank(self) -> int:
        """Rank along ``tp`` (0 when the model is not split).

        Raises:
            RuntimeError: the run has no ``ParallelismConfig``.
        """
        return mesh_rank(self.state, "tp", "Tensor parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """Rank along ``cp`` (0 when sequences are not split).

        Raises:
            RuntimeError: the run has no ``ParallelismConfig``.
        """
        return mesh_rank(self.state, "cp", "Context parallelism")

    @property
    def pipeline_parallel_rank(self) -> int:
        """Pipeline parallelism is not supported (as in Accelerate).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "pipeline parallelism is not supported by accel (nor by Accelerate): there is no "
            "pipeline rank; use dp_replicate_size/dp_shard_size of a ParallelismConfig"
        )
