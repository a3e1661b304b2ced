"""``AcceleratedScheduler``: a learning-rate scheduler that follows the optimizer.

Called once per training-loop iteration, like an unprepared scheduler, it advances only when
the optimizer really stepped: not while gradients accumulate (with ``adjust_scheduler``, the
default), not after an fp16 overflow skipped the step. Because each step consumes one batch
per process, it advances ``num_processes`` times per call unless batches are split, so a
schedule sized for a single process ends at the same sample count on any number of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from accel_state import AcceleratorState, GradientState

from .optimizer import AcceleratedOptimizer

__all__ = ["AcceleratedScheduler"]


def _as_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [optimizers]


class AcceleratedScheduler:
    """Wrap ``scheduler`` so it steps with the prepared optimizer(s).

    Args:
        scheduler: The torch LR scheduler (or any object with ``step()``).
        optimizers: The prepared optimizer(s) (``AcceleratedOptimizer``) the scheduler drives.
        step_with_optimizer: ``False`` makes ``step()`` a plain ``scheduler.step()``.
        split_batches: Whether each process sees a slice of one batch (then one step per call).

    Raises:
        ValueError: ``step_with_optimizer`` is set and the scheduler's optimizer is not among
            the prepared ``optimizers``.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Any,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = _as_list(optimizers)
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()
        if step_with_optimizer:
            _check_prepared(scheduler, self.optimizers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule by as many steps as the optimizer took since the last call."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        gradient_state = self.gradient_state
        if not gradient_state.sync_gradients:
            if gradient_state.adjust_scheduler:
                return
        elif any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        repeats = 1 if self.split_batches else AcceleratorState().num_processes
        total_steps = getattr(self.scheduler, "total_steps", None)
        for _ in range(repeats):
            # OneCycleLR raises past its total; a loader without drop_last can overshoot.
            if total_steps is not None and self.scheduler._step_count > total_steps:
                break
            self.scheduler.step(*args, **kwargs)

    # --- passthrough ----------------------------------------------------------------------

    def get_last_lr(self) -> list[float]:
        """The learning rates the last step set."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        """The inner scheduler's state dict."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner scheduler's state dict."""
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        """The inner scheduler's ``get_lr()``."""
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        """The inner scheduler's ``print_lr()``."""
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally; avoid recursion while unpickling.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "gradient_state"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)


def _check_prepared(scheduler: Any, optimizers: Sequence[Any]) -> None:
    target = getattr(scheduler, "optimizer", None)
    if target is None:
        return  # a custom scheduler that does not say which optimizer it drives
    prepared: Iterable[Any] = [opt for opt in optimizers if isinstance(opt, AcceleratedOptimizer)]
    for opt in prepared:
        if target is opt or target is _inner(opt):
            return
    names = ", ".join(type(_inner(opt)).__name__ for opt in optimizers) or "none"
    raise ValueError(
        f"scheduler={type(scheduler).__name__} drives a {type(target).__name__} that was not "
        f"prepared (prepared optimizers: {names}). Pass that optimizer to prepare() together "
        "with the scheduler (or before it), so the scheduler can follow its real steps"
    )
