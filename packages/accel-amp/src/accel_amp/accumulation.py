"""Gradient accumulation: the plugin, and one object that owns a training step's gradients.

:class:`GradientAccumulator` drives accel-state's ``GradientState.advance()`` state machine
and keeps everything that depends on it in one place: ``no_sync`` while a window is open,
loss scaling in ``backward``, ``unscale``/clipping only on the step that completes a window,
and exact loss normalisation.

Exact normalisation (``backward(loss_sum, num_items=n)``): the default divides each
micro-batch's *mean* loss by ``num_steps``, which weights every micro-batch equally — wrong
when micro-batches hold different numbers of tokens or samples (the bug class of
transformers #34191), and wrong for the short last window of an epoch. Passing the *summed*
loss with its item count instead lets the accumulator divide the finished gradient by the
total item count of the window, summed over the ranks that average gradients, so the result
is exactly the gradient of one big batch of the same items.

The accumulator does not know the training engines (they live in accel, which this package
cannot import). What it needs from one is the :class:`GradientSync` protocol, and its optional
capabilities are protocols too, checked with ``isinstance`` (:mod:`accel_amp.engine_capabilities`).

The step count and the other settings are parsed once, where they enter (the plugin's fields,
``Accelerator(gradient_accumulation_steps=...)``, ``ACCEL_GRADIENT_ACCUMULATION_STEPS``), into
accel-state's frozen ``AccumulationPlan``, which ``GradientState`` stores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accel_state import GradientState
from accel_state.accumulation_plan import (
    AccumulationPlan,
    accumulation_steps_from_environment,
    parse_accumulation_steps,
)
from accel_state.kwargs import KwargsHandler

from .engine_capabilities import (
    DuckGradientSync,
    GradientSync,
    HasAveragingGroup,
    OwnsBackward,
    SumsOverAveragingWorld,
    no_sync,
)
from .optimizer import AcceleratedOptimizer

__all__ = [
    "DuckGradientSync",
    "GradientAccumulationPlugin",
    "GradientAccumulator",
    "GradientSync",
    "make_gradient_accumulation_plugin",
    "no_sync",
    "plan_accumulation",
]


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate over micro-batches.

    Args:
        num_steps: Micro-batches per optimizer step (``None`` means 1).
        adjust_scheduler: ``True`` (default): a prepared scheduler counts optimizer steps.
            ``False``: it also advances on accumulating micro-batches, for schedules sized in
            micro-batches. (Accelerate accepts this field and ignores it.)
        sync_with_dataloader: Also complete a window on the last batch of each data loader.
        sync_each_batch: All-reduce gradients on every micro-batch instead of entering
            ``no_sync`` (less memory, more communication).

    Raises:
        ValueError: ``num_steps`` is not a whole number >= 1 (``2.0`` is read as 2; text and
            ``True`` are refused).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None:
            self.num_steps = parse_accumulation_steps(
                self.num_steps, "num_steps", owner="GradientAccumulationPlugin"
            )

    @classmethod
    def from_plan(cls, plan: AccumulationPlan) -> GradientAccumulationPlugin:
        """The plugin holding ``plan``'s settings (its step count is not parsed again)."""
        plugin = cls(
            adjust_scheduler=plan.adjust_scheduler,
            sync_with_dataloader=plan.sync_with_dataloader,
            sync_each_batch=plan.sync_each_batch,
        )
        plugin.num_steps = plan.steps  # parsed when the plan was built
        return plugin

    def to_plan(self) -> AccumulationPlan:
        """The frozen plan of these settings, which ``GradientState`` stores.

        Raises:
            ValueError: ``num_steps`` was set to something other than an ``int`` >= 1 after
                the plugin was built.
        """
        return AccumulationPlan(
            steps=1 if self.num_steps is None else self.num_steps,
            adjust_scheduler=bool(self.adjust_scheduler),
            sync_with_dataloader=bool(self.sync_with_dataloader),
            sync_each_batch=bool(self.sync_each_batch),
        )


def plan_accumulation(
    gradient_accumulation_steps: int = 1,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
    environ: Any = None,
) -> AccumulationPlan:
    """The accumulation plan of ``Accelerator``'s two ways of asking for it: the door.

    The plugin's plan when one is given; otherwise the step count, where the default of 1
    gives way to ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` (or Accelerate's
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``), which ``accel launch`` sets. Every value is
    read with accel-state's ``parse_accumulation_steps``, once.

    Raises:
        ValueError: both ``gradient_accumulation_steps != 1`` and a plugin were given, or the
            step count (argument or variable, named in the message) is not a whole number
            >= 1.
    """
    if gradient_accumulation_plugin is not None:
        if gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps!r} and "
                "gradient_accumulation_plugin were both given: pass only the plugin, with "
                f"GradientAccumulationPlugin(num_steps={gradient_accumulation_steps!r}, ...)"
            )
        return gradient_accumulation_plugin.to_plan()
    default = gradient_accumulation_steps == 1 and not isinstance(gradient_accumulation_steps, bool)
    found = accumulation_steps_from_environment(environ) if default else None
    if found is not None:
        return AccumulationPlan(steps=found[1], source=found[0])
    steps = parse_accumulation_steps(gradient_accumulation_steps, "gradient_accumulation_steps")
    return AccumulationPlan(steps=steps)


def make_gradient_accumulation_plugin(
    gradient_accumulation_steps: int = 1,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
    environ: Any = None,
) -> GradientAccumulationPlugin:
    """Resolve ``Accelerator``'s two ways of asking for accumulation into one plugin.

    The given plugin itself, or one holding :func:`plan_accumulation`'s plan (the step count
    parsed once; without a plugin, ``ACCEL_GRADIENT_ACCUMULATION_STEPS`` overrides the
    default of 1 steps).

    Raises:
        ValueError: both ``gradient_accumulation_steps != 1`` and a plugin were given, or the
            step count is not a whole number >= 1.
    """
    plan = plan_accumulation(gradient_accumulation_steps, gradient_accumulation_plugin, environ)
    if gradient_accumulation_plugin is not None:
        return gradient_accumulation_plugin
    return GradientAccumulationPlugin.from_plan(plan)


class GradientAccumulator:
    """One training step's gradient bookkeeping, driven by ``GradientState``.

    Args:
        scaler: The fp16 ``GradScaler`` (or ``None``).
        optimizers: Prepared optimizers, unscaled before clipping and used to find the
            parameters to normalise; more can be added with :meth:`register_optimizer`.
        models: Prepared models (to know whether their gradients are averaged across ranks);
            models passed to :meth:`accumulate` are added automatically.
        grads_averaged_over: Override the number of ranks the backend averages gradients
            over (DeepSpeed-like engines); ``None`` asks ``sync``.
        sync: The engine's :class:`GradientSync` (default :class:`DuckGradientSync`).
    """

    def __init__(
        self,
        scaler: Any = None,
        optimizers: Sequence[Any] = (),
        models: Sequence[Any] = (),
        grads_averaged_over: int | None = None,
        sync: GradientSync | None = None,
    ) -> None:
        self.scaler = scaler
        self.sync: GradientSync = sync if sync is not None else DuckGradientSync()
        self.gradient_state = GradientState()
        self.optimizers: list[Any] = list(optimizers)
        self.models: list[Any] = list(models)
        self.grads_averaged_over = grads_averaged_over
        self.last_window_loss: torch.Tensor | None = None
        self.last_window_items: torch.Tensor | None = None
        self._backwards_in_micro_batch = 0
        self._in_micro_batch = 0
        self._reset_window()
        self._warned: set[str] = set()

    def register_optimizer(self, optimizer: Any) -> None:
        """Add a prepared optimizer (unscaled by clipping, normalised by ``num_items``)."""
        if not any(optimizer is known for known in self.optimizers):
            self.optimizers.append(optimizer)

    def register_model(self, model: Any) -> None:
        """Add a prepared model (its gradient averaging decides the normalisation factor)."""
        if not any(model is known for known in self.models):
            self.models.append(model)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch completes an accumulation window."""
        return self.gradient_state.sync_gradients

    # --- the window ---------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._mode: str | None = None
        self._items: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        """Run one micro-batch: decide ``sync_gradients`` and skip gradient sync until then.

        Wrap each iteration's forward, backward, ``optimizer.step()`` and ``zero_grad()``:
        the optimizer and scheduler act only on the iteration that completes a window.
        """
        sync = self.gradient_state.advance()
        if self.gradient_state.micro_batches_in_window == 1:
            self._reset_window()
        self._backwards_in_micro_batch = 0
        for model in models:
            self.register_model(model)
        allow_sync = sync or self.gradient_state.sync_each_batch
        self._in_micro_batch += 1
        try:
            with contextlib.ExitStack() as stack:
                if not allow_sync:
                    for model in models:
                        stack.enter_context(self.sync.no_sync(model))
                yield
        finally:
            self._in_micro_batch -= 1

    # --- backward -------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, *, num_items: Any = None, **kwargs: Any) -> None:
        """Back-propagate ``loss`` for this micro-batch.

        Args:
            loss: Without ``num_items``, the micro-batch's *mean* loss; it is divided by
                ``num_steps`` (Accelerate's behaviour). With ``num_items``, the *summed* loss
                over that many items (tokens, samples); the finished window's gradients are
                divided by the window's total item count across ranks (exact normalisation).
            num_items: The number of items ``loss`` sums over (int or tensor), or ``None``.
            **kwargs: Passed to ``Tensor.backward`` (``retain_graph``, ...).

        Raises:
            ValueError: one window mixes calls with and without ``num_items``.
            RuntimeError: a second ``num_items`` backward on the micro-batch that closes a
                window (normalisation happens right after the first one).

        An engine that :class:`~accel_amp.engine_capabilities.OwnsBackward` (DeepSpeed) gets
        the loss as it is, with whether this micro-batch completes the window; it divides and
        steps itself.
        """
        if isinstance(self.sync, OwnsBackward):
            if num_items is not None:
                raise ValueError(
                    f"backward(loss, num_items={num_items!r}): exact normalisation is not "
                    "available with an engine that runs backward itself (DeepSpeed divides the "
                    "loss by the accumulation steps); pass the mean loss without num_items"
                )
            self._backwards_in_micro_batch += 1
            self.sync.backward(loss, sync_gradients=self.gradient_state.sync_gradients, **kwargs)
            return
        if num_items is None:
            if self._mode == "sum":
                raise ValueError(
                    "backward(loss) without num_items in a window whose other micro-batches "
                    "passed num_items: pass num_items on every micro-batch of the window (the "
                    "summed loss and its item count) or on none"
                )
            self._mode = "mean"
            num_steps = self.gradient_state.num_steps
            if num_steps != 1:  # dividing by 1 changes nothing; skip the extra kernel
                loss = loss / num_steps
        else:
            if self._mode == "mean":
                raise ValueError(
                    f"backward(loss, num_items={num_items!r}) in a window whose other "
                    "micro-batches did not pass num_items: pass it on every micro-batch of the "
                    "window or on none"
                )
            closing = self.gradient_state.sync_gradients and self._in_micro_batch
            if closing and self._backwards_in_micro_batch:
                raise RuntimeError(
                    "backward(..., num_items=...) was called twice on the micro-batch that "
                    "completes the window: add the losses and call backward once"
                )
            self._mode = "sum"
            self._record(loss, num_items)
        self._backwards_in_micro_batch += 1
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)
        if self.gradient_state.sync_gradients:
            # The window is complete (outside accumulate(), every backward is its own window).
            if self._mode == "sum":
                self._normalise_window()
            self._reset_window()

    def _record(self, loss: torch.Tensor, num_items: Any) -> None:
        device = loss.device
        items = torch.as_tensor(num_items, device=device).detach().to(torch.float64).reshape(())
        loss_sum = loss.detach().to(torch.float64).reshape(())
        if self._items is None or self._loss_sum is None:
            self._items, self._loss_sum = items, loss_sum
        else:
            self._items = self._items + items.to(self._items.device)
            self._loss_sum = self._loss_sum + loss_sum.to(self._loss_sum.device)

    def _parameters(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        sources: Iterable[Any] = [
            p for opt in self.optimizers for group in opt.param_groups for p in group["params"]
        ]
        if not self.optimizers:
            sources = [p for model in self.models for p in model.parameters()]
        for param in sources:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        if not params:
            raise RuntimeError(
                "backward(..., num_items=...) cannot normalise gradients: no optimizer or model "
                "is known. Pass the model to accumulate(model) or register the optimizer with "
                "register_optimizer()"
            )
        return params

    def _averaging_world_size(self) -> int:
        if self.grads_averaged_over is not None:
            return int(self.grads_averaged_over)
        return max((self.sync.grads_averaged_over(model) for model in self.models), default=1)

    def _normalise_window(self) -> None:
        assert self._items is not None and self._loss_sum is not None
        world = self._averaging_world_size()
        totals = torch.stack([self._items, self._loss_sum])
        if world > 1:
            if isinstance(self.sync, SumsOverAveragingWorld):  # no torch.distributed group (XLA)
                totals = self.sync.sum_over_averaging_world(totals)
            else:
                group = None  # the default group: every rank averages
                if isinstance(self.sync, HasAveragingGroup) and self.models:
                    group = self.sync.averaging_group(self.models[0])
                dist.all_reduce(totals, group=group)
        items, loss_sum = totals[0], totals[1]
        factor = torch.where(items > 0, world / items, torch.zeros_like(items))
        grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in self._parameters():
            if param.grad is not None:
                grouped.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
        for (device, dtype), grads in grouped.items():
            torch._foreach_mul_(grads, factor.to(device=device, dtype=dtype))
        self.last_window_items = items
        self.last_window_loss = torch.where(items > 0, loss_sum / items, torch.zeros_like(items))

    # --- unscale and clip ---------------------------------------------------------------

    def _targets(self, optimizer: Any) -> list[Any]:
        if optimizer is None:
            return list(self.optimizers)
        if isinstance(optimizer, (list, tuple)):
            return list(optimizer)
        return [optimizer]

    def _outside_window_end(self, what: str) -> bool:
        if self.gradient_state.sync_gradients:
            return False
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"{what} was called on a micro-batch that does not complete the accumulation "
                "window; the gradients are still accumulating, so it does nothing now. Call it "
                "under `if accelerator.sync_gradients:`",
                stacklevel=3,
            )
        return True

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the loss scale (fp16 only; a no-op otherwise).

        Raises:
            RuntimeError: this optimizer was already unscaled since its last step.
        """
        if self.scaler is None or self._outside_window_end("unscale_gradients()"):
            return
        for opt in self._targets(optimizer):
            self._unscale(opt, strict=True)

    def _unscale(self, optimizer: Any, strict: bool) -> None:
        prepared = isinstance(optimizer, AcceleratedOptimizer)
        if prepared and optimizer._unscaled:
            if not strict:
                return
            raise RuntimeError(
                "unscale_gradients() was already called for this optimizer since its last "
                "step(): the gradients are unscaled once per optimizer step. Remove the second "
                "call (clip_grad_norm_ unscales by itself and skips optimizers already unscaled)"
            )
        inner = optimizer
        while isinstance(inner, AcceleratedOptimizer):
            inner = inner.optimizer
        try:
            self.scaler.unscale_(inner)
        except RuntimeError as error:
            if "already been called" not in str(error):
                raise
            if strict:
                raise RuntimeError(
                    "unscale_gradients() was already called for this optimizer since the last "
                    "scaler update: unscale once per optimizer step"
                ) from error
        if prepared:
            optimizer._unscaled = True

    def clip_grad_norm_(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        optimizer: Any = None,
    ) -> torch.Tensor | None:
        """Unscale (fp16), then clip the gradients' total norm; return the norm before clipping.

        Returns ``None`` (and warns once) on a micro-batch that does not complete the window.
        """
        if self._outside_window_end("clip_grad_norm_()"):
            return None
        if self.scaler is not None:
            for opt in self._targets(optimizer):
                self._unscale(opt, strict=False)
        return self.sync.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float, optimizer: Any = None) -> None:
        """Unscale (fp16), then clamp every gradient to ``[-clip_value, clip_value]``."""
        if self._outside_window_end("clip_grad_value_()"):
            return
        if self.scaler is not None:
            for opt in self._targets(optimizer):
                self._unscale(opt, strict=False)
        self.sync.clip_grad_value_(parameters, clip_value)

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The open window's normalisation state (for exact resume), tensors on the CPU.

        ``mode`` is ``None`` (no backward yet in the window), ``"mean"`` or ``"sum"``;
        ``items`` and ``loss_sum`` are the window's running totals with ``num_items``.
        """
        return {
            "mode": self._mode,
            "items": self._items.cpu() if self._items is not None else None,
            "loss_sum": self._loss_sum.cpu() if self._loss_sum is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        """Restore :meth:`state_dict`'s values, moving the totals to ``device``.

        Raises:
            ValueError: ``mode`` is not ``None``, ``"mean"`` or ``"sum"``.
        """
        mode = state.get("mode")
        if mode not in (None, "mean", "sum"):
            raise ValueError(
                f"GradientAccumulator.load_state_dict: mode={mode!r} is not None, 'mean' or "
                "'sum' (a state of another program?)"
            )
        items, loss_sum = state.get("items"), state.get("loss_sum")
        self._mode = mode
        self._items = items.to(device) if isinstance(items, torch.Tensor) else None
        self._loss_sum = loss_sum.to(device) if isinstance(loss_sum, torch.Tensor) else None
