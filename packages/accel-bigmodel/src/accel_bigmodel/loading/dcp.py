"""The distributed path of checkpoint loading, through ``torch.distributed.checkpoint``.

Models holding DTensors (FSDP2), and loads where rank 0 reads and broadcasts
(``broadcast_from_rank0``), go through ``set_model_state_dict`` shard by shard, as in
Accelerate; they take no device map.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from .files import load_state_dict


def has_dtensor(model: nn.Module) -> bool:
    """Whether some parameter or buffer of ``model`` is a DTensor."""
    # A model cannot hold DTensors unless their module was imported; importing it just to
    # check would cost tens of MB.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return False
    return any(isinstance(t, dtensor) for t in model.state_dict(keep_vars=True).values())


def load_with_dcp(
    model: nn.Module,
    files: Sequence[str],
    *,
    strict: bool,
    full_state_dict: bool,
    broadcast_from_rank0: bool,
) -> set[str]:
    """Accelerate's distributed path: per shard ``set_model_state_dict``; the unexpected keys.

    Raises:
        ValueError: ``broadcast_from_rank0`` without an initialised process group.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if broadcast_from_rank0 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "broadcast_from_rank0=True needs an initialised process group: start the processes "
            "with accel launch / torchrun and initialise PartialState() first, or pass "
            "broadcast_from_rank0=False."
        )
    model_keys = set(model.state_dict().keys())
    unexpected: set[str] = set()
    for path in files:
        reads = not broadcast_from_rank0 or dist.get_rank() == 0
        loaded: dict[str, Any] = load_state_dict(path) if reads else {}
        set_model_state_dict(
            model,
            loaded,
            options=StateDictOptions(
                full_state_dict=full_state_dict,
                strict=strict,
                broadcast_from_rank0=broadcast_from_rank0,
            ),
        )
        unexpected.update(set(loaded) - model_keys)
        del loaded
    return unexpected
