"""Tensor parallelism alone: every rank of the ``tp`` group holds a slice of each sharded layer.

The run is ``ParallelismConfig(tp_size=N)`` with N processes and no FSDP2 (with FSDP2, the
FSDP2 engine shards the data-parallel dimensions of a tensor-parallel model). The model
arrives sharded (:mod:`accel.tensor_parallel`); ``prepare`` checks that it is sharded over the
run's ``tp`` mesh and wraps it in nothing. All ranks see the same batches (the loaders shard
over the data-parallel ranks, of which there is one), so no gradient is averaged: the
sharded layers exchange activations and their gradients inside forward and backward, and the
parameters the plan left plain get the same gradient on every rank.

Clipping, full state dicts and model files are the DTensor engines' (:mod:`.dtensor`).
Checkpoints go through DCP, each rank writing its slices into the folders FSDP2's sharded
checkpoints use (``pytorch_model_fsdp_<i>/``, ``optimizer_<i>/``), so DCP can reshard a
checkpoint between tensor parallelism alone and FSDP2 x TP; Accelerate 1.15 writes only rank
0's slices and cannot resume such a run. Gradients pending inside an accumulation window are
saved per rank and put back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accel.models import get_model_tp_size, has_multi_device_map

from .base import CheckpointLayout, EngineOptions
from .dtensor import DTensorEngine

__all__ = ["TensorParallelEngine"]


class TensorParallelEngine(DTensorEngine):
    """Training a tensor-parallel model without data parallelism (see the module docstring)."""

    name = "tensor parallel"

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        mesh = getattr(self.state, "device_mesh", None)
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                "the tensor-parallel engine needs the run's device mesh with a 'tp' dimension "
                "(Accelerator(parallelism_config=ParallelismConfig(tp_size=...)))"
            )
        self.tp_mesh = mesh["tp"]

    @property
    def multi_device(self) -> bool:
        """Several GPU-like devices."""
        return self.state.device.type != "cpu"

    def check_prepare(self, objects: Sequence[Any]) -> None:
        """Refuse models that are not sharded over the run's ``tp`` mesh.

        Raises:
            ValueError: a model dispatched by a device map, with no DTensor parameter (and no
                transformers tensor-parallel degree equal to ``tp_size``), or sharded over
                another mesh.
        """
        from accel.tensor_parallel import tensor_parallel_mesh_of

        size = self.tp_mesh.size()
        for obj in objects:
            if not isinstance(obj, torch.nn.Module):
                continue
            name = type(obj).__name__
            if has_multi_device_map(obj):
                raise ValueError(
                    f"prepare() got a {name} dispatched over several devices "
                    f"(hf_device_map={getattr(obj, 'hf_device_map', None)!r}): tensor "
                    "parallelism shards a model that lives on each process's device. Load it "
                    "without device_map"
                )
            mesh = tensor_parallel_mesh_of(obj)
            if mesh is None:
                if get_model_tp_size(obj) == size:
                    continue  # sharded by transformers' own tensor parallelism
                raise ValueError(
                    f"prepare(): ParallelismConfig(tp_size={size}) but {name} is not tensor "
                    "parallel (no DTensor parameter), so every rank would train the whole "
                    "model on the same data. Shard it before prepare(): "
                    "accel.utils.apply_tensor_parallel(model, accelerator.torch_device_mesh, "
                    "plan), or torch's parallelize_module on "
                    "accelerator.torch_device_mesh['tp']"
                )
            if mesh != self.tp_mesh:
                raise ValueError(
                    f"prepare(): {name} is sharded over a mesh {mesh.mesh_dim_names} "
                    f"{mesh.mesh.tolist()}, not over this run's 'tp' dimension "
                    f"{self.tp_mesh.mesh.tolist()}: shard it over "
                    "accelerator.torch_device_mesh['tp']"
                )

    def checkpoint_layout(self) -> CheckpointLayout:
        """DCP folders of slices (``pytorch_model_fsdp_<i>/``, ``optimizer_<i>/``)."""
        from .fsdp2_checkpoint import TensorParallelLayout

        return TensorParallelLayout(self)
