"""Local SGD: every process trains on its own for a few steps, then the weights are averaged.

``LocalSGD`` is Accelerate's helper of that name. Inside ``with LocalSGD(...)`` the prepared
(DDP) model does not all-reduce gradients; each call of ``step()`` counts one optimizer step,
and every ``local_sgd_steps`` steps (and on leaving the block) the parameters are averaged over
all processes, so that the ranks continue from the same weights. With one process it does
nothing. The average is one all-reduce per parameter dtype and device (the parameters are
flattened into one buffer each), where Accelerate reduces parameter by parameter.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from accel_amp import no_sync
from accel_state import DistributedType, reduce

if TYPE_CHECKING:
    from .accelerator import Accelerator

__all__ = ["LocalSGD"]

_DATA_PARALLEL_TYPES = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_NEURON,
}


class LocalSGD:
    """Average the model's weights over processes every ``local_sgd_steps`` optimizer steps.

    Use it as a context manager around the training loop and call :meth:`step` after each
    ``optimizer.step()``::

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                ...
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()

    Args:
        accelerator: The run's ``Accelerator``.
        model: The prepared model whose parameters are averaged.
        local_sgd_steps: Optimizer steps between two averages (a positive integer).
        enabled: ``False`` turns it into a no-op (it is one anyway with a single process).

    Raises:
        ValueError: ``local_sgd_steps`` is not a positive integer.
        NotImplementedError: the run is not plain data parallel (DDP or one process).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if accelerator.distributed_type not in _DATA_PARALLEL_TYPES:
            raise NotImplementedError(
                f"LocalSGD averages whole replicas, so it needs plain data parallelism (DDP); "
                f"this run is {accelerator.distributed_type.value}"
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int):
            raise ValueError(
                f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): pass the number of optimizer "
                "steps between two averages, a positive integer"
            )
        if local_sgd_steps < 1:
            raise ValueError(
                f"LocalSGD(local_sgd_steps={local_sgd_steps}): it must be at least 1 (1 averages "
                "after every step)"
            )
        self.enabled = bool(enabled) and accelerator.distributed_type != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled or self._no_sync is None:
            return
        try:
            if kind is None:
                self._average()  # on an exception the other ranks may not get here
        finally:
            gradients_sync, self._no_sync = self._no_sync, None
            gradients_sync.__exit__(kind, value, traceback)

    def step(self) -> None:
        """Count one optimizer step; average the weights when ``local_sgd_steps`` are done."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        """Replace every parameter by its mean over the processes, in place."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for parameter in self.model.parameters():
            groups.setdefault((parameter.dtype, parameter.device), []).append(parameter)
        with torch.no_grad():
            for parameters in groups.values():
                flat = torch.cat([p.detach().reshape(-1) for p in parameters])
                averaged: Any = reduce(flat, reduction="mean")
                offset = 0
                for parameter in parameters:
                    count = parameter.numel()
                    parameter.copy_(averaged[offset : offset + count].view_as(parameter))
                    offset += count
