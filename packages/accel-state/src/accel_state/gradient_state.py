"""Gradient accumulation's shared state: ``GradientState``.

A Borg singleton like ``PartialState`` (every instance shares one class-level ``__dict__``;
``_reset_state()`` empties it in place). It carries the accumulation plan (an
:class:`~accel_state.accumulation_plan.AccumulationPlan`, parsed once where the settings
entered), the state machine that decides ``sync_gradients``, and the stack of data loaders
being iterated.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Mapping
from typing import Any

from . import xla
from .accumulation_plan import AccumulationPlan, PlansAccumulation
from .enums import DistributedType
from .partial_state import PartialState

__all__ = ["GradientState"]


def _plan_and_kwargs(settings: Any) -> tuple[AccumulationPlan, dict[str, Any]]:
    """The plan of a plan, of accel-amp's plugin, or of any object with ``to_kwargs()``."""
    if isinstance(settings, AccumulationPlan):
        return settings, settings.to_kwargs()
    kwargs = dict(settings.to_kwargs())
    if isinstance(settings, PlansAccumulation):  # already parsed when the plugin was built
        return settings.to_plan(), kwargs
    # A plugin accel did not build (Accelerate's): its values enter here, and are parsed once.
    return AccumulationPlan.from_kwargs(kwargs, owner=type(settings).__name__), kwargs


class GradientState:
    """Gradient-accumulation settings, the accumulation state machine and the active loaders.

    The state machine is :meth:`advance`: every training micro-batch calls it once (accel-amp's
    ``GradientAccumulator.accumulate`` does) and it decides ``sync_gradients``, the one flag
    that ``no_sync``, the optimizer, the scheduler and clipping all read.

    Args:
        gradient_accumulation_plugin: The accumulation settings: an ``AccumulationPlan``,
            accel-amp's ``GradientAccumulationPlugin`` (whose plan is stored as it is), or any
            object with ``to_kwargs()`` (its non-default fields, read once). They become
            :attr:`plan` and ``plugin_kwargs``; a later construction with settings replaces
            them.

    Raises:
        ValueError: an object with ``to_kwargs()`` only holds a bad ``num_steps``.
    """

    _shared_state: dict[str, Any] = {}

    sync_gradients: bool
    step: int
    micro_batches_in_window: int
    _plan: AccumulationPlan
    _plugin_kwargs: dict[str, Any]
    _window_closed: bool
    _dataloader_references: list[Any]
    _is_xla_gradients_synced: bool

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        given = (
            _plan_and_kwargs(gradient_accumulation_plugin)
            if gradient_accumulation_plugin is not None
            else None
        )
        if not self.initialized:
            self.sync_gradients = True
            self.step = 0
            self.micro_batches_in_window = 0
            self._window_closed = True
            self._dataloader_references = [None]
            self._plan, self._plugin_kwargs = given or (AccumulationPlan(), {})
            self._is_xla_gradients_synced = False
        elif given is not None:
            self._plan, self._plugin_kwargs = given

    @property
    def initialized(self) -> bool:
        """Whether the state has been set up."""
        return GradientState._shared_state != {}

    @property
    def plan(self) -> AccumulationPlan:
        """The accumulation plan every other setting here reads."""
        return self._plan

    @plan.setter
    def plan(self, plan: AccumulationPlan) -> None:
        if not isinstance(plan, AccumulationPlan):
            raise TypeError(
                f"GradientState.plan={plan!r}: expected an AccumulationPlan "
                "(accel_state.accumulation_plan); build one with "
                "dataclasses.replace(state.plan, steps=...)"
            )
        self._plan = plan
        self._plugin_kwargs = plan.to_kwargs()

    @property
    def plugin_kwargs(self) -> Mapping[str, Any]:
        """The accumulation plugin's non-default fields (Accelerate's attribute), read-only.

        Assigning a new mapping re-plans from it (its ``num_steps`` is parsed); the mapping
        read here cannot be changed in place, which would leave :attr:`plan` behind.
        """
        return types.MappingProxyType(self._plugin_kwargs)

    @plugin_kwargs.setter
    def plugin_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        plan = AccumulationPlan.from_kwargs(kwargs)
        self._plan, self._plugin_kwargs = plan, dict(kwargs)

    @property
    def num_steps(self) -> int:
        """Number of micro-batches accumulated before the optimizer steps."""
        return self._plan.steps

    @property
    def adjust_scheduler(self) -> bool:
        """Whether a prepared scheduler counts optimizer steps (``True``) or micro-batches.

        ``True`` (the plugin's default) advances the scheduler only when the optimizer
        steps; ``False`` advances it on every micro-batch, for schedules sized in
        micro-batches. Accelerate reads ``False`` here by default and ignores the value.
        """
        return self._plan.adjust_scheduler

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether gradients are synchronised at the end of each data loader."""
        return self._plan.sync_with_dataloader

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised on every batch (saves memory, costs speed)."""
        return self._plan.sync_each_batch

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Whether an XLA optimizer has averaged this window's gradients (Accelerate's name).

        The XLA optimizer sets it when it reduces the gradients and clears it after the step.
        """
        return self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, synced: bool) -> None:
        self._is_xla_gradients_synced = bool(synced)

    @property
    def active_dataloader(self) -> Any:
        """The innermost data loader being iterated, or ``None``."""
        reference = self._dataloader_references[-1]
        return reference() if reference is not None else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active data loader is yielding its last batch."""
        if not self.in_dataloader:
            return False
        return bool(self.active_dataloader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Samples in the active loader's last batch that are padding (-1 if unknown)."""
        if not self.in_dataloader:
            return -1
        return int(self.active_dataloader.remainder)

    def advance(self) -> bool:
        """Begin a micro-batch and decide whether it completes an accumulation window.

        A window closes every ``num_steps`` micro-batches and, with ``sync_with_dataloader``,
        on the last batch of the active data loader (which also restarts the count, so each
        epoch starts a fresh window). Sets and returns ``sync_gradients``; afterwards
        ``micro_batches_in_window`` counts the micro-batches of the current window,
        this one included.
        """
        if self._window_closed:
            self.micro_batches_in_window = 0
        self.micro_batches_in_window += 1
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            sync = True
        else:
            self.step += 1
            sync = self.step % self._plan.steps == 0
        self._window_closed = sync
        self.sync_gradients = sync
        return sync

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients
        if sync_gradients and PartialState._shared_state.get("distributed_type") == (
            DistributedType.XLA
        ):
            # The micro-batches' lazy graph runs before the synchronising step is traced.
            xla.mark_step()

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window has begun and not completed (gradients pending)."""
        return not self._window_closed

    def state_dict(self) -> dict[str, Any]:
        """The state machine's counters, for exact resume (see :meth:`load_state_dict`)."""
        return {
            "step": self.step,
            "micro_batches_in_window": self.micro_batches_in_window,
            "window_closed": self._window_closed,
            "sync_gradients": self.sync_gradients,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters that :meth:`state_dict` returned.

        Raises:
            KeyError: a counter is missing (the message names it).
        """
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise KeyError(f"GradientState.load_state_dict: missing counters {missing}")
        self.step = int(state["step"])
        self.micro_batches_in_window = int(state["micro_batches_in_window"])
        self._window_closed = bool(state["window_closed"])
        self.sync_gradients = bool(state["sync_gradients"])

    def _add_dataloader(self, dataloader: Any) -> None:
        self._dataloader_references.append(weakref.ref(dataloader))

    def _remove_dataloader(self, dataloader: Any) -> None:
        for index in range(len(self._dataloader_references) - 1, 0, -1):
            reference = self._dataloader_references[index]
            if reference is not None and reference() is dataloader:
                del self._dataloader_references[index]
                return

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self._plugin_kwargs}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the state (tests use this)."""
        GradientState._shared_state.clear()
