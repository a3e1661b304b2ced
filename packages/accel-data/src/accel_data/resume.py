"""Exact mid-epoch resume: what a prepared loader records so a new process can continue it.

A loader's order for one epoch is fixed by the state of its sampler when the epoch starts:
the seed and epoch of a :class:`~accel_data.samplers.SeedableRandomSampler`, the state of the
``torch.Generator`` of a ``RandomSampler``, or torch's global generator for a sampler that
draws from it. :func:`capture_order_state` records that state when an epoch starts and
:func:`restore_order_state` puts it back, so that iterating the epoch again produces the same
batches, of which the loader then skips those already yielded. No torchdata is needed, and it
works with any ``num_workers``: sampling happens in the main process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from .samplers import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler

__all__ = [
    "capture_order_state",
    "get_sampler",
    "is_reseeded_each_epoch",
    "mark_reseeded_each_epoch",
    "restore_order_state",
    "reseed_like_pytorch",
]

#: Set on a ``RandomSampler`` whose generator the loader seeds at every epoch as PyTorch
#: would seed a generator-less one (see :func:`reseed_like_pytorch`).
_RESEEDED = "_accel_reseeded_each_epoch"


def mark_reseeded_each_epoch(sampler: Any) -> None:
    """Have the loader seed ``sampler.generator`` at every epoch as PyTorch would."""
    setattr(sampler, _RESEEDED, True)


def is_reseeded_each_epoch(sampler: Any) -> bool:
    """Whether ``sampler`` was marked by :func:`mark_reseeded_each_epoch`."""
    return bool(getattr(sampler, _RESEEDED, False))


def reseed_like_pytorch(sampler: Any) -> None:
    """Seed ``sampler.generator`` with the number PyTorch's generator-less sampler would draw.

    Building a DataLoader iterator draws the workers' base seed from torch's RNG; the
    ``RandomSampler`` without a generator then draws its own seed, the next number. This
    peeks at that second number without consuming anything (the caller consumes it after
    building the iterator, so torch's RNG ends where PyTorch's would).
    """
    state = torch.get_rng_state()
    try:
        torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    finally:
        torch.set_rng_state(state)
    sampler.generator.manual_seed(seed)


def get_sampler(dataloader: DataLoader[Any]) -> Any:
    """Return the index sampler behind ``dataloader`` (under any batch sampler wrappers).

    Handles a ``BatchSampler`` passed as ``sampler=`` and the shard/skip wrappers.
    """
    sampler = getattr(dataloader, "batch_sampler", None)
    if sampler is None or isinstance(getattr(dataloader, "sampler", None), BatchSampler):
        sampler = getattr(dataloader, "sampler", None)
    while isinstance(sampler, (BatchSamplerShard, SkipBatchSampler, BatchSampler)):
        inner = getattr(sampler, "batch_sampler", None)
        if inner is None:
            inner = getattr(sampler, "sampler", None)
        if inner is None or inner is sampler:
            break
        sampler = inner
    return sampler


def _generator_of(sampler: Any) -> torch.Generator | None:
    generator = getattr(sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def capture_order_state(sampler: Any) -> dict[str, Any]:
    """Record what fixes the order of the epoch that is about to start.

    Call it right before the sampler is iterated.
    """
    if isinstance(sampler, SeedableRandomSampler):
        return {"kind": "seedable", "initial_seed": int(sampler.initial_seed)}
    generator = _generator_of(sampler)
    if generator is not None:
        return {"kind": "generator", "state": generator.get_state().clone()}
    if isinstance(sampler, torch.utils.data.RandomSampler):
        # A RandomSampler without a generator draws its seed from torch's global generator.
        return {"kind": "global", "state": torch.get_rng_state()}
    return {"kind": "none"}


def restore_order_state(sampler: Any, state: dict[str, Any]) -> None:
    """Put back an order state recorded by :func:`capture_order_state`.

    Raises:
        ValueError: the state was recorded for a different kind of sampler.
    """
    kind = state.get("kind")
    current = capture_order_state(sampler)["kind"]
    if kind != current:
        raise ValueError(
            f"cannot resume: the loader state was saved with a {kind!r} sampler but this loader "
            f"has a {current!r} one ({type(sampler).__name__}); prepare the loader the same way "
            "as in the run that saved the state"
        )
    if kind == "seedable":
        sampler.initial_seed = int(state["initial_seed"])
    elif kind == "generator":
        generator = _generator_of(sampler)
        assert generator is not None
        generator.set_state(state["state"])
    elif kind == "global":
        torch.set_rng_state(state["state"])
