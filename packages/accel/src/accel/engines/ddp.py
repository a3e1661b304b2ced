"""DistributedDataParallel: every rank holds the whole model, gradients are all-reduced.

GPU-like devices get ``device_ids=[local rank]``; CPU processes (gloo) and models already
dispatched by a device map get none. ``no_sync`` and the accumulation window use DDP's own
``no_sync()``; ``join`` is torch's ``Join`` (on CPU too, where Accelerate does nothing and
uneven batches then hang).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accel.models import has_multi_device_map, model_has_dtensor
from accel_state import DistributedType
from accel_state.environment import ACCEL_BYPASS_DEVICE_MAP, parse_flag_from_env

from .base import Engine

__all__ = ["DDPEngine"]


class DDPEngine(Engine):
    """Data parallel training with ``torch.nn.parallel.DistributedDataParallel``."""

    name = "DDP"

    @property
    def multi_device(self) -> bool:
        """Several GPU-like devices (``MULTI_CPU`` is not one)."""
        return self.distributed_type != DistributedType.MULTI_CPU

    def check_prepare(self, objects: Sequence[Any]) -> None:
        """Refuse models DDP cannot train: dispatched over several devices, or DTensor-sharded.

        Raises:
            ValueError: naming the model, its device map and the fix.
        """
        for obj in objects:
            if not isinstance(obj, torch.nn.Module):
                continue
            if has_multi_device_map(obj) and not parse_flag_from_env(ACCEL_BYPASS_DEVICE_MAP):
                raise ValueError(
                    f"prepare() got a {type(obj).__name__} dispatched over several devices "
                    f"(hf_device_map={getattr(obj, 'hf_device_map', None)!r}) in a distributed "
                    f"run ({self.distributed_type}): such a model cannot be trained with DDP. "
                    "Load it on one device per process, or set ACCEL_BYPASS_DEVICE_MAP=1 if "
                    "you know what you are doing"
                )
            if model_has_dtensor(obj):
                raise ValueError(
                    f"prepare() got a {type(obj).__name__} whose parameters are DTensors "
                    "(sharded by a tensor-parallel plan or fully_shard): DDP replicates plain "
                    "tensors and cannot train it. Use FSDP2 (accel launch --use_fsdp, or "
                    "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()))"
                )

    def wrap_model(self, model: torch.nn.Module, *, dispatched: bool) -> torch.nn.Module:
        """Wrap in DDP (with the handler's settings and communication hook)."""
        handler = self.options.ddp_handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        if self.distributed_type == DistributedType.MULTI_CPU or dispatched:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        else:
            index = self.state.local_process_index
            wrapped = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[index], output_device=index, **kwargs
            )
        if handler is not None:
            handler.register_comm_hook(wrapped)
        return wrapped

    def grads_averaged_over(self, model: Any) -> int:
        """The size of a DDP model's process group (1 for an unwrapped model)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and dist.is_initialized():
            return int(dist.get_world_size(model.process_group))
        return super().grads_averaged_over(model)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: Any) -> Iterator[None]:
        """Make a DDP model's next backward all-reduce, even inside ``no_sync``."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield
            return
        previous = (model.require_backward_grad_sync, model.require_forward_param_sync)
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = previous

    def join(
        self, joinables: list[Any], enable: bool
    ) -> contextlib.AbstractContextManager[None] | None:
        """Torch's ``Join`` over the DDP models (early-terminating ranks shadow collectives).

        None when the state no longer says DDP (a test that switches the state's type).
        """
        from torch.distributed.algorithms.join import Join

        if not self.distributed_type.value.startswith("MULTI_"):
            return None
        return Join(joinables, enable=enable, throw_on_early_termination=False)
