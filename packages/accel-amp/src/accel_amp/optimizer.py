"""``AcceleratedOptimizer``: an optimizer that steps only when a gradient window is complete.

It wraps a torch optimizer without copying it: ``param_groups``, ``state`` and ``defaults``
are the inner optimizer's own objects. ``step`` and ``zero_grad`` act only on steps where
``GradientState.sync_gradients`` is set; with a ``GradScaler`` a step runs
``scaler.step`` + ``scaler.update`` and ``step_was_skipped`` reports an overflow (the inner
step was not called). It is still an instance of ``torch.optim.Optimizer``, so torch's LR
schedulers accept it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from accel_state import AcceleratorState, DistributedType, GradientState
from accel_state.structures import send_to_device

__all__ = ["AcceleratedOptimizer"]

# Attributes rebuilt on unpickling instead of pickled (singletons and per-step flags).
_TRANSIENT = ("accelerator_state", "gradient_state", "_step_called", "_accepts_set_to_none")


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` for gradient accumulation, mixed precision and device placement.

    Args:
        optimizer: The torch optimizer to wrap (its parameters may already be on the device).
        device_placement: Move the optimizer's existing state to the run's device, by loading
            its state dict back through the device.
        scaler: A ``GradScaler`` when training in fp16, else ``None``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer: pass the "
                "optimizer object itself (built from model.parameters())"
            )
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        self._is_overflow = False
        self._unscaled = False
        self._attach()
        if device_placement:
            state_dict = send_to_device(self.optimizer.state_dict(), self.accelerator_state.device)
            self.optimizer.load_state_dict(state_dict)

    def _attach(self) -> None:
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self._step_called = False
        zero_grad = self.optimizer.zero_grad
        try:
            self._accepts_set_to_none = "set_to_none" in inspect.signature(zero_grad).parameters
        except (TypeError, ValueError):
            self._accepts_set_to_none = False

    # --- views of the inner optimizer ---------------------------------------------------

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (the same list object)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's default hyper-parameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict into the inner optimizer (moved to the device on XLA)."""
        xla = self.accelerator_state.distributed_type == DistributedType.XLA
        if self.device_placement and xla:
            state_dict = send_to_device(dict(state_dict), self.accelerator_state.device)
        self.optimizer.load_state_dict(dict(state_dict))

    def train(self) -> None:
        """Switch a schedule-free optimizer to training mode (no-op for others)."""
        method = getattr(self.optimizer, "train", None)
        if callable(method):
            method()

    def eval(self) -> None:
        """Switch a schedule-free optimizer to evaluation mode (no-op for others)."""
        method = getattr(self.optimizer, "eval", None)
        if callable(method):
            method()

    # --- stepping ---------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients, but only at the end of an accumulation window.

        Raises:
            ValueError: ``set_to_none`` was given but the inner optimizer's ``zero_grad``
                does not accept it.
        """
        if not self.gradient_state.sync_gradients:
            return
        if self._accepts_set_to_none:
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise ValueError(
                f"zero_grad(set_to_none={set_to_none!r}): {type(self.optimizer).__name__}."
                "zero_grad() takes no set_to_none argument; call zero_grad() without it"
            )
        else:
            self.optimizer.zero_grad()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer at the end of an accumulation window.

        With a scaler the step is ``scaler.step`` + ``scaler.update``; a step whose gradients
        overflowed is skipped by the scaler and ``step_was_skipped`` becomes ``True``.
        """
        if not self.gradient_state.sync_gradients:
            return None
        result: Any = None
        if self.scaler is None:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._is_overflow = False
        else:
            result = self._scaled_step(closure)
        self._unscaled = False
        if self.accelerator_state.distributed_type == DistributedType.XLA:
            self.gradient_state.is_xla_gradients_synced = False
        return result

    def _scaled_step(self, closure: Callable[[], Any] | None) -> Any:
        inner_step = self.optimizer.step
        had_instance_step = "step" in self.optimizer.__dict__
        self._step_called = False

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            self._step_called = True
            return inner_step(*args, **kwargs)

        self.optimizer.step = recording_step  # type: ignore[method-assign]
        try:
            if closure is not None:
                result = self.scaler.step(self.optimizer, closure)
            else:
                result = self.scaler.step(self.optimizer)
            self.scaler.update()
        finally:
            if had_instance_step:
                self.optimizer.step = inner_step  # type: ignore[method-assign]
            else:
                del self.optimizer.step
        self._is_overflow = not self._step_called
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped because the gradients overflowed."""
        return self._is_overflow

    @property
    def is_overflow(self) -> bool:
        """Deprecated alias of :attr:`step_was_skipped`."""
        warnings.warn(
            "AcceleratedOptimizer.is_overflow is deprecated: use step_was_skipped",
            FutureWarning,
            stacklevel=2,
        )
        return self._is_overflow

    def _switch_parameters(self, parameters_map: Mapping[Any, Any]) -> None:
        """Replace parameters in the param groups (after a wrapper re-created them)."""
        for group in self.optimizer.param_groups:
            group["params"] = [parameters_map.get(p, p) for p in group["params"]]

    # --- pickling -----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in _TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attach()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"
