"""torch_xla, reached lazily: the runtime of an XLA (TPU) run and its collectives.

A process in which torch_xla can be imported (and ``USE_TORCH_XLA`` is not false) runs on its
XLA device, as under Accelerate, unless the CPU is forced (``cpu=True``, ``ACCEL_USE_CPU``) or
``ACCEL_TORCH_DEVICE`` names another device: then it is an ordinary run. torch_xla is imported
here on first use only, so importing accel never imports it.

The processes of an XLA run are started by torch_xla (``xmp.spawn``, which ``accel launch
--tpu`` calls) and talk through its collectives, not a ``torch.distributed`` group: the world
size and ordinals come from ``torch_xla.runtime``, barriers are ``xm.rendezvous``, tensors move
with ``xm.all_gather`` / ``xm.all_reduce`` / ``xm.collective_broadcast``, and picklable objects
with ``xm.mesh_reduce`` (Accelerate refuses ``gather_object`` on XLA; accel gathers them).

Only torch_xla's documented API is used (``torch_xla.core.xla_model``, ``torch_xla.runtime``,
``torch_xla.distributed.parallel_loader``); each call names what it needs, so a fake
``torch_xla`` in the test tree can stand in for the real one.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch

from .environment import ACCEL_DOWNCAST_BF16, str_to_bool
from .imports import is_torch_xla_available

__all__ = [
    "XLA_REDUCTIONS",
    "all_gather",
    "all_reduce",
    "bf16_environment",
    "broadcast_",
    "broadcast_objects",
    "gather_objects",
    "is_tpu",
    "mark_step",
    "reduce_gradients",
    "rendezvous",
    "rng_state",
    "runtime_topology",
    "set_rng_state",
    "uses_xla",
    "xla_device",
    "xla_model",
]

#: accel's reduction names and torch_xla's (``"mean"`` is a sum divided afterwards).
XLA_REDUCTIONS = {"sum": "sum", "mean": "sum", "none": "sum", "max": "max", "min": "min"}


def uses_xla(cpu: bool, device_override: torch.device | None = None) -> bool:
    """Whether this process runs on torch_xla's device.

    Args:
        cpu: The CPU is forced (``cpu=True`` or ``ACCEL_USE_CPU``).
        device_override: The device ``ACCEL_TORCH_DEVICE`` names, if any.
    """
    if cpu or (device_override is not None and device_override.type != "xla"):
        return False
    return is_torch_xla_available()


def xla_model() -> ModuleType:
    """``torch_xla.core.xla_model`` (imported on first use)."""
    return importlib.import_module("torch_xla.core.xla_model")


def _runtime() -> ModuleType:
    return importlib.import_module("torch_xla.runtime")


def xla_device() -> torch.device:
    """This process's XLA device (``torch_xla.device()``; ``xm.xla_device()`` before 2.5)."""
    torch_xla = importlib.import_module("torch_xla")
    if hasattr(torch_xla, "device"):
        return torch.device(torch_xla.device())
    return torch.device(xla_model().xla_device())


def is_tpu() -> bool:
    """Whether the XLA device is a TPU (``torch_xla.runtime.device_type()``)."""
    return str(_runtime().device_type()) == "TPU"


def runtime_topology(device: torch.device) -> tuple[int, int, int, int]:
    """``(world_size, global_ordinal, local_ordinal, local_world_size)`` of this XLA process.

    Sets the replication of ``device`` first where torch_xla still has ``set_replication``
    (it needs it before the first collective).
    """
    xm = xla_model()
    xr = _runtime()
    if hasattr(xm, "set_replication") and hasattr(xm, "get_xla_supported_devices"):
        xm.set_replication(device, xm.get_xla_supported_devices())
    world = int(xr.world_size())
    ordinal = int(xr.global_ordinal())
    local = int(xr.local_ordinal()) if hasattr(xr, "local_ordinal") else ordinal
    local_world = int(xr.local_device_count()) if hasattr(xr, "local_device_count") else world
    return world, ordinal, local, max(1, min(local_world, world))


def rendezvous(tag: str) -> None:
    """Block until every XLA process reaches ``xm.rendezvous(tag)``."""
    xla_model().rendezvous(tag)


def mark_step() -> None:
    """Run the pending lazy XLA graph (``xm.mark_step``), so tensors hold their values."""
    xla_model().mark_step()


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's ``tensor`` concatenated along dimension 0 (0-d tensors become 1-d)."""
    if tensor.ndim == 0:
        tensor = tensor[None]
    gathered = xla_model().all_gather(tensor.detach().contiguous(), dim=0)
    mark_step()
    return gathered


def all_reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the processes (``reduction`` in XLA_REDUCTIONS)."""
    result = xla_model().all_reduce(XLA_REDUCTIONS[reduction], tensor.detach().clone())
    return result


def broadcast_(tensor: torch.Tensor, src: int) -> None:
    """Overwrite ``tensor`` (contiguous) with process ``src``'s, in place."""
    xla_model().collective_broadcast([tensor], root_ordinal=src)


def gather_objects(tag: str, value: Any) -> list[Any]:
    """Every process's picklable ``value``, in ordinal order (``xm.mesh_reduce``)."""
    gathered = xla_model().mesh_reduce(tag, value, list)
    return list(gathered)


def broadcast_objects(tag: str, value: Any, src: int) -> Any:
    """Process ``src``'s picklable ``value`` on every process."""
    return xla_model().mesh_reduce(tag, value, lambda values: values[src])


def reduce_gradients(gradients: list[torch.Tensor], world_size: int) -> None:
    """Average ``gradients`` over the processes in place (one ``xm.all_reduce`` for all)."""
    if gradients:
        xla_model().all_reduce("sum", gradients, scale=1.0 / world_size)


def rng_state() -> int:
    """The XLA device's random seed state (``xm.get_rng_state``)."""
    return int(xla_model().get_rng_state())


def set_rng_state(seed: int) -> None:
    """Restore the XLA device's random seed state (``xm.set_rng_state``)."""
    xla_model().set_rng_state(int(seed))


def bf16_environment(mixed_precision: str, environ: Any = None) -> bool:
    """Set torch_xla's bf16 variables for a bf16 run on a TPU; return whether it downcasts.

    ``mixed_precision="bf16"`` sets ``XLA_USE_BF16=1`` (every float32 tensor is bf16 on the
    TPU); with ``ACCEL_DOWNCAST_BF16`` true (Accelerate's ``ACCELERATE_DOWNCAST_BF16`` is
    named by the warning about Accelerate's variables, as its other settings are) it
    sets ``XLA_DOWNCAST_BF16=1`` instead (float32 becomes bf16, float64 becomes float32).
    Other precisions leave the variables alone.

    Raises:
        ValueError: a downcast variable holds something that is not a truth value, or asks
            for a downcast while ``mixed_precision`` is not ``"bf16"``.
    """
    env = os.environ if environ is None else environ
    downcast_by = None
    for name in (ACCEL_DOWNCAST_BF16,):
        raw = env.get(name, "")
        if not raw.strip():
            continue
        try:
            if str_to_bool(raw, to_bool=True):
                downcast_by = downcast_by or f"{name}={raw.strip()}"
        except ValueError as error:
            raise ValueError(f"environment variable {name}={raw!r}: {error}") from None
    if mixed_precision != "bf16":
        if downcast_by is not None:
            raise ValueError(
                f"{downcast_by} (`accel launch --downcast_bf16`) downcasts a bf16 run, but "
                f"mixed_precision={mixed_precision!r}: pass mixed_precision='bf16' or unset it"
            )
        return False
    downcast = downcast_by is not None
    env["XLA_USE_BF16"] = "0" if downcast else "1"
    env["XLA_DOWNCAST_BF16"] = "1" if downcast else "0"
    return downcast
