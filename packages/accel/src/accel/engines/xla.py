"""The XLA engine: replicated data parallelism over the processes torch_xla starts.

Every process holds the whole model on its XLA device. There is no wrapper around the model:
gradients accumulate locally through the window and are averaged over the processes once,
in one ``xm.all_reduce``, when the window's optimizer step runs, or earlier when the window
is clipped (the norm must be the averaged gradients' norm), never twice. Accelerate reduces
on every ``optimizer.step()`` call, also inside accumulation windows where the step does
nothing.

Moving a model to the XLA device gives it new parameter objects (CPU and XLA tensors cannot
share storage), so an optimizer built before ``prepare`` would hold parameters the model no
longer has: :meth:`XLAEngine.prepare_optimizer` re-points it (and its state) to the moved
ones, as Accelerate does by name. A model and an optimizer given to one ``prepare`` on
different devices are refused with Accelerate's explanation.

Loaders are wrapped in torch_xla's preloader by accel-data (``accel_data.xla``), which places
the batches; ``save_state`` / ``save_model`` run the pending lazy graph (``mark_step``) first
and write CPU copies; ``random_states_<rank>.pkl`` gains the XLA seed (``xm_seed``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from accel_amp import AcceleratedOptimizer, SumsOverAveragingWorld
from accel_state import send_to_device, xla

from .base import Engine

__all__ = ["XLAEngine", "XLAOptimizer"]


class XLAOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` that averages its gradients over the XLA processes first.

    Args:
        optimizer: The torch optimizer.
        device_placement: Move its state to the device.
        scaler: The fp16 loss scaler, if any.
        world_size: Number of XLA processes.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = False,
        scaler: Any = None,
        world_size: int = 1,
    ) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self.world_size = world_size
        self._reduced = False

    def reduce_gradients(self) -> None:
        """Average this optimizer's gradients over the processes, once per window."""
        if self._reduced:
            return
        if self.world_size > 1:
            gradients = [
                param.grad
                for group in self.optimizer.param_groups
                for param in group["params"]
                if param.grad is not None
            ]
            xla.reduce_gradients(gradients, self.world_size)
        self._reduced = True
        self.gradient_state.is_xla_gradients_synced = True

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, computed (``mark_step``) and on the CPU."""
        xla.mark_step()
        return send_to_device(super().state_dict(), torch.device("cpu"))

    def step(self, closure: Any = None) -> Any:
        """Reduce the gradients (at the end of a window), then step."""
        if not self.gradient_state.sync_gradients:
            return None
        self.reduce_gradients()
        try:
            return super().step(closure)
        finally:
            self._reduced = False


class XLAEngine(Engine, SumsOverAveragingWorld):
    """Replicated training on torch_xla's processes (see the module docstring)."""

    name = "XLA"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self._optimizers: list[weakref.ref[XLAOptimizer]] = []
        # Parameters that ``.to(xla)`` replaced, by id of the old one: (the old one, weakly;
        # the new one), for optimizers built before. Tensors compare elementwise, so they
        # cannot be dictionary keys themselves.
        self._moved: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    @property
    def multi_device(self) -> bool:
        """Whether several XLA processes take part."""
        return self.state.num_processes > 1

    @property
    def places_batches(self) -> bool:
        """No: torch_xla's preloader places the batches (``accel_data.xla``)."""
        return False

    # --- prepare ---------------------------------------------------------------------------

    def check_prepare(self, objects: Sequence[Any]) -> None:
        """Refuse a model and an optimizer of one ``prepare`` call on different devices."""
        model_device = next(
            (
                param.device
                for obj in objects
                if isinstance(obj, torch.nn.Module)
                for param in obj.parameters()
            ),
            None,
        )
        optimizer_device = next(
            (
                param.device
                for obj in objects
                if isinstance(obj, torch.optim.Optimizer)
                for group in obj.param_groups
                for param in group["params"]
            ),
            None,
        )
        if model_device is not None and optimizer_device is not None:
            if model_device != optimizer_device:
                raise ValueError(
                    f"The model's parameters are on {model_device} and the optimizer's on "
                    f"{optimizer_device}, which probably means you created the optimizer "
                    "before putting the model on the device. Put model.to(device) before "
                    "the optimizer is created, or remove it and let the Accelerator place "
                    "the model (device_placement=True, the default)"
                )

    def prepare_model(
        self, model: torch.nn.Module, *, device_placement: bool, evaluation_mode: bool
    ) -> torch.nn.Module:
        """Place the model; remember which parameters the move replaced."""
        before = dict(model.named_parameters(remove_duplicate=False))
        prepared = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        for name, param in model.named_parameters(remove_duplicate=False):
            old = before.get(name)
            if old is not None and old is not param:
                key = id(old)
                forget = functools.partial(self._forget_moved, key)
                self._moved[key] = (weakref.ref(old, forget), param)
        return prepared

    def _forget_moved(self, key: int, _dead: Any) -> None:
        """Drop the entry of a replaced parameter that no longer exists (its id may recur)."""
        self._moved.pop(key, None)

    def _replacement(self, param: torch.Tensor, default: Any) -> Any:
        """The parameter that replaced ``param`` (``default`` when none did)."""
        entry = self._moved.get(id(param))
        if entry is None or entry[0]() is not param:
            return default
        return entry[1]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` (and its state) at the parameters the model now has."""
        if not self._moved:
            return optimizer
        for group in optimizer.param_groups:
            group["params"] = [self._replacement(param, param) for param in group["params"]]
        for old in list(optimizer.state):
            new = self._replacement(old, None)
            if new is not None:
                optimizer.state[new] = optimizer.state.pop(old)
        return optimizer

    def optimizer_wrapper(
        self, optimizer: Any, scaler: Any, device_placement: bool = False
    ) -> AcceleratedOptimizer:
        """An :class:`XLAOptimizer` (gradients averaged in its step)."""
        wrapped = XLAOptimizer(
            optimizer,
            device_placement=device_placement,
            scaler=scaler,
            world_size=self.state.num_processes,
        )
        self._optimizers = [ref for ref in self._optimizers if ref() is not None]
        self._optimizers.append(weakref.ref(wrapped))
        return wrapped

    # --- the step ------------------------------------------------------------------------

    def grads_averaged_over(self, model: Any) -> int:
        """Every XLA process: the optimizer step averages over all of them."""
        return int(self.state.num_processes)

    def sum_over_averaging_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the XLA processes (the items of a ``num_items`` window)."""
        return xla.all_reduce(tensor, "sum")

    def reduce_gradients(self) -> None:
        """Average the gradients of every prepared optimizer not yet reduced this window."""
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None:
                optimizer.reduce_gradients()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Average the gradients first, then clip their norm (the same on every process)."""
        self.reduce_gradients()
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Average the gradients first, then clamp them."""
        self.reduce_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # --- models and checkpoints --------------------------------------------------------

    def synchronize(self) -> None:
        """Run the pending lazy graph, so the tensors about to be saved hold their values."""
        xla.mark_step()

    def model_state_dict(self, model: Any) -> dict[str, Any]:
        """The full state dict, computed (``mark_step``) and copied to the CPU."""
        self.synchronize()
        return {
            name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
            for name, value in super().model_state_dict(model).items()
        }

    def rng_states(self) -> dict[str, Any]:
        """The XLA device's seed, as Accelerate saves it (``xm_seed``)."""
        return {"xm_seed": xla.rng_state()}

    def restore_rng_states(self, states: dict[str, Any]) -> None:
        """Restore ``xm_seed`` when the checkpoint has it."""
        if "xm_seed" in states:
            xla.set_rng_state(states["xm_seed"])
