"""``torch_xla.core.xla_model``: device, replication, collectives, lazy steps, RNG."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_xla import _fake

REDUCE_SUM = "sum"
REDUCE_MAX = "max"
REDUCE_MIN = "min"

_rng = [101]


def xla_device(n: int | None = None) -> torch.device:
    _fake.record("xla_device")
    return torch.device("cpu")


def get_xla_supported_devices(devkind: str | None = None) -> list[str]:
    return ["xla:0"]


def set_replication(device: Any, devices: list[str]) -> None:
    _fake.record("set_replication", devices=list(devices))


def get_local_ordinal() -> int:
    return _fake.ordinal()


def mark_step(wait: bool = False) -> None:
    _fake.record("mark_step")


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
    _fake.record("rendezvous", tag=tag)
    return list(_fake.exchange(payload))


def _combine(reduce_type: str, values: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(values)
    if reduce_type == REDUCE_SUM:
        return stacked.sum(dim=0)
    if reduce_type == REDUCE_MAX:
        return stacked.amax(dim=0)
    if reduce_type == REDUCE_MIN:
        return stacked.amin(dim=0)
    raise ValueError(f"fake torch_xla: reduce_type {reduce_type!r} is not sum, max or min")


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: Any = None,
    pin_layout: bool = True,
) -> torch.Tensor | None:
    """A reduced copy of a tensor, or every tensor of a list reduced in place (as torch_xla)."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    _fake.record("all_reduce", reduce_type=reduce_type, scale=scale, tensors=len(tensors))
    everyone = _fake.exchange([t.detach().clone() for t in tensors])
    results = [
        _combine(reduce_type, [peer[i] for peer in everyone]) * scale for i in range(len(tensors))
    ]
    if isinstance(inputs, torch.Tensor):
        return results[0].to(inputs.dtype)
    for tensor, result in zip(tensors, results, strict=True):
        tensor.copy_(result)
    return None


def all_gather(
    value: torch.Tensor,
    dim: int = 0,
    groups: Any = None,
    output: Any = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    _fake.record("all_gather", shape=list(value.shape))
    return torch.cat(_fake.exchange(value.detach().clone()), dim=dim)


def collective_broadcast(
    tensors: list[torch.Tensor],
    root_ordinal: int = 0,
    groups: Any = None,
    pin_layout: bool = True,
) -> None:
    _fake.record("collective_broadcast", root=root_ordinal)
    everyone = _fake.exchange([t.detach().clone() for t in tensors])
    for tensor, sent in zip(tensors, everyone[root_ordinal], strict=True):
        tensor.copy_(sent)


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    _fake.record("mesh_reduce", tag=tag)
    return reduce_fn(_fake.exchange(data))


def get_rng_state(device: Any = None) -> int:
    return _rng[0]


def set_rng_state(seed: int, device: Any = None) -> None:
    _fake.record("set_rng_state", seed=int(seed))
    _rng[0] = int(seed)
