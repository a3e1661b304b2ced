"""What the engines of DTensor models share: FSDP2 and tensor parallelism.

Their parameters (some or all) are ``DTensor`` slices spread over a mesh, so three verbs
differ from DDP's:

* the gradient norm is the norm of the whole gradients: each group of DTensor gradients on
  one mesh gives its norm as a DTensor that ``full_tensor()`` reduces over that mesh, plain
  gradients (the same on every rank that holds them) count once, and the groups combine as
  plain tensors (so gradients on a tensor-parallel mesh and on a 2-D FSDP2 x TP mesh mix);
* the full state dict is gathered (a collective, the full tensors on the CPU of rank 0);
* model files are written shard file by shard file, rank 0 holding one file's full tensors
  at most.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Engine

__all__ = ["DTensorEngine", "total_grad_norm"]


def total_grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> Any:
    """The norm of the whole gradients ``grads`` (DTensor slices or plain), a plain tensor."""
    from torch.distributed.tensor import DTensor

    groups: dict[int, list[torch.Tensor]] = {}
    plain = []
    for grad in grads:
        if isinstance(grad, DTensor):
            groups.setdefault(id(grad.device_mesh), []).append(grad)
        else:
            plain.append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type))
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


class DTensorEngine(Engine):
    """The verbs of an engine whose models hold DTensor parameters (see the module docstring)."""

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the norm of the whole gradients; return it as a plain tensor (as under DDP)."""
        from torch.distributed.tensor.experimental import implicit_replication

        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        device = self.state.device
        if not grads:
            return torch.tensor(0.0, device=device)
        total = total_grad_norm(grads, float(norm_type), device)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with implicit_replication():
            for grad in grads:
                grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
        return total

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient slice (element-wise, so slices clip as the whole tensor would)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for param in params:
            if param.grad is not None:
                param.grad.clamp_(-clip_value, clip_value)

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """The full state dict on rank 0 (on the CPU), ``{}`` elsewhere: a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return dict(
            get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        )

    def save_model(
        self,
        model: Any,
        save_directory: str,
        *,
        max_shard_size: int | str,
        safe_serialization: bool,
    ) -> None:
        """Write full weights shard file by shard file: rank 0 holds one file's tensors at most."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        from accel.model_files import save_model_files

        sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))

        def materialize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            full = {}
            for name, value in tensors.items():
                tensor = value.full_tensor() if isinstance(value, DTensor) else value
                full[name] = tensor.detach().cpu()
            return full if self.state.is_main_process else {}

        save_model_files(
            sharded,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            is_main_process=self.state.is_main_process,
            materialize=materialize,
        )
