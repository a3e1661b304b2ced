"""Kwargs handlers for ``torch.autocast`` and ``torch.amp.GradScaler``.

Both are dataclasses built on accel-state's :class:`~accel_state.kwargs.KwargsHandler`, so
``to_kwargs()`` returns only the fields a user changed and torch keeps its own defaults for
the rest — the same contract as Accelerate's handlers of the same names.
"""

from __future__ import annotations

import dataclasses
import math

from accel_state.kwargs import KwargsHandler

__all__ = ["AutocastKwargs", "GradScalerKwargs"]


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` in the wrapped forward and ``Accelerator.autocast``.

    Args:
        enabled: ``False`` makes a region run in full precision (an fp32 island inside a
            mixed-precision run).
        cache_enabled: Whether autocast caches the low-precision copies of weights inside the
            region; ``None`` keeps torch's default.
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (fp16 only).

    Args:
        init_scale: The first loss scale.
        growth_factor: Factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: Factor the scale shrinks by when a step overflows.
        growth_interval: Clean steps between two growths.
        enabled: ``False`` turns loss scaling off (the optimizer then steps unconditionally).

    Raises:
        ValueError: a value torch would reject later, with the field, the value and the rule.
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(
                f"GradScalerKwargs(init_scale={self.init_scale!r}): the initial loss scale "
                "must be a finite number > 0 (the default is 65536.0)"
            )
        if not self.growth_factor > 1.0:
            raise ValueError(
                f"GradScalerKwargs(growth_factor={self.growth_factor!r}): must be > 1.0 "
                "(the default is 2.0)"
            )
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"GradScalerKwargs(backoff_factor={self.backoff_factor!r}): must be between "
                "0 and 1 exclusive (the default is 0.5)"
            )
        if isinstance(self.growth_interval, bool) or not (
            isinstance(self.growth_interval, int) and self.growth_interval > 0
        ):
            raise ValueError(
                f"GradScalerKwargs(growth_interval={self.growth_interval!r}): must be an "
                "integer > 0 (the default is 2000)"
            )
