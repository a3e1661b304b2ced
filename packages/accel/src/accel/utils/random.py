"""Accelerate's ``accelerate.utils.random``, re-exported from the packages that own it.

Seeding and RNG synchronisation (Accelerate's ``accelerate.utils.random``).
"""

from __future__ import annotations

from accel_state.rng import (
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)

__all__ = [
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
