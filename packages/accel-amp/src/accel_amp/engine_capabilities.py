"""What the gradient accumulator asks of a training engine: typed protocols.

The accumulator does not know the training engines (they live in accel, which this package
cannot import). What it needs from every engine is :class:`GradientSync`: turning gradient
synchronisation off for a model, the number of ranks its gradients are averaged over, and
clipping. :class:`DuckGradientSync` is the default, which recognises DDP and FSDP2 models by
their methods; accel's engines inherit it.

Some engines can do more, and the accumulator asks for that through one protocol per
capability, checked with ``isinstance`` (never by looking a member up by its name):

* :class:`OwnsBackward` — the engine runs backward itself (DeepSpeed divides the loss by the
  accumulation steps and steps the optimizer on its own);
* :class:`HasAveragingGroup` — the ranks gradients are averaged over are not the whole world
  (FSDP2 beside tensor parallelism, whose ``tp`` peers see the same items);
* :class:`SumsOverAveragingWorld` — the engine's processes have no ``torch.distributed`` group
  (XLA), so it sums a window's item counts itself.

An engine declares a capability by naming the protocol among its bases. The protocols'
methods are abstract, so an engine that names one and misspells its method cannot be built
(``TypeError`` naming the method) instead of silently losing the capability — a misspelt
``averaging_group`` would otherwise normalise over the wrong ranks under FSDP2 + TP. An
object that only has the method (a test double, another library's engine) matches
structurally.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = [
    "DuckGradientSync",
    "GradientSync",
    "HasAveragingGroup",
    "OwnsBackward",
    "SumsOverAveragingWorld",
    "no_sync",
]


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Stop ``model`` from all-reducing gradients inside the block.

    FSDP2 modules toggle ``set_requires_gradient_sync``; DDP (and anything with a
    ``no_sync()`` context) uses it; other modules are unaffected.
    """
    toggle = getattr(model, "set_requires_gradient_sync", None)
    if callable(toggle):
        toggle(False)
        try:
            yield
        finally:
            toggle(True)
        return
    method = getattr(model, "no_sync", None)
    if callable(method):
        with method():
            yield
        return
    yield


def _averaging_world_size(model: Any) -> int:
    """How many ranks ``model``'s gradient synchronisation averages over (1: none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return int(dist.get_world_size(model.process_group))
    if callable(getattr(model, "set_requires_gradient_sync", None)):
        return int(dist.get_world_size())
    return 1


@runtime_checkable
class GradientSync(Protocol):
    """What the accumulator needs from every training engine (accel's engines implement it).

    ``no_sync`` keeps a model's gradients rank-local inside the block;
    ``grads_averaged_over`` is how many ranks a model's gradient synchronisation averages
    over (1: none), which exact normalisation multiplies back; the two clipping methods act
    on already unscaled gradients and may refuse (an engine whose gradients are clipped
    elsewhere). The optional capabilities are :class:`OwnsBackward`,
    :class:`HasAveragingGroup` and :class:`SumsOverAveragingWorld`.
    """

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Keep ``model``'s gradients local inside the block."""
        ...

    def grads_averaged_over(self, model: Any) -> int:
        """Number of ranks ``model``'s gradients are averaged over."""
        ...

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the total gradient norm; return the norm before clipping (a plain tensor)."""
        ...

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``."""
        ...


class DuckGradientSync:
    """The default :class:`GradientSync`: plain torch, with DDP and FSDP2 told by their methods."""

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """See :func:`no_sync`."""
        return no_sync(model)

    def grads_averaged_over(self, model: Any) -> int:
        """World size of a DDP model's group or of an FSDP2 model; 1 otherwise."""
        return _averaging_world_size(model)

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_``."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)


@runtime_checkable
class OwnsBackward(Protocol):
    """An engine that runs backward itself (DeepSpeed).

    ``GradientAccumulator.backward`` hands such an engine every loss as it is, with whether the
    micro-batch completes the window; the engine divides by the accumulation steps and steps
    the optimizer itself, so exact normalisation (``num_items``) is refused.
    """

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        """Back-propagate ``loss``; step when ``sync_gradients`` (the window is complete)."""


@runtime_checkable
class HasAveragingGroup(Protocol):
    """An engine whose gradients are averaged over a group smaller than the world (FSDP2 + TP).

    Exact normalisation sums a window's item counts over that group: summing over the world
    would count the items of tensor-parallel peers, which see the same batch, several times.
    """

    @abc.abstractmethod
    def averaging_group(self, model: Any) -> Any:
        """The process group ``model``'s gradients are averaged over (None: the default)."""


@runtime_checkable
class SumsOverAveragingWorld(Protocol):
    """An engine whose processes have no ``torch.distributed`` group (XLA).

    Exact normalisation asks it to sum a window's item counts over its processes.
    """

    @abc.abstractmethod
    def sum_over_averaging_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the processes gradients are averaged over."""
