"""Gradient accumulation's shared state: ``GradientState``.

A Borg singleton like ``PartialState`` (every instance shares one class-level ``__dict__``;
``_reset_state()`` empties it in place). It carries the accumulation settings, the state
machine that decides ``sync_gradients``, and the stack of data loaders being iterated.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import xla
from .enums import DistributedType
from .partial_state import PartialState

__all__ = ["GradientState"]


class GradientState:
    """Gradient-accumulation settings, the accumulation state machine and the active loaders.

    The state machine is :meth:`advance`: every training micro-batch calls it once (accel-amp's
    ``GradientAccumulator.accumulate`` does) and it decides ``sync_gradients``, the one flag
    that ``no_sync``, the optimizer, the scheduler and clipping all read.

    Args:
        gradient_accumulation_plugin: An object with ``to_kwargs()`` (accel-amp's
            ``GradientAccumulationPlugin``); its non-default fields become ``plugin_kwargs``.
            A later construction with different settings replaces them.
    """

    _shared_state: dict[str, Any] = {}

    sync_gradients: bool
    plugin_kwargs: dict[str, Any]
    step: int
    micro_batches_in_window: int
    _window_closed: bool
    _dataloader_references: list[Any]
    _is_xla_gradients_synced: bool

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.step = 0
            self.micro_batches_in_window = 0
            self._window_closed = True
            self._dataloader_references = [None]
            self.plugin_kwargs = (
                gradient_accumulation_plugin.to_kwargs()
                if gradient_accumulation_plugin is not None
                else {}
            )
            self._is_xla_gradients_synced = False
        elif gradient_accumulation_plugin is not None:
            kwargs = gradient_accumulation_plugin.to_kwargs()
            if kwargs != self.plugin_kwargs:
                self.plugin_kwargs = kwargs

    @property
    def initialized(self) -> bool:
        """Whether the state has been set up."""
        return GradientState._shared_state != {}

    @property
    def num_steps(self) -> int:
        """Number of micro-batches accumulated before the optimizer steps."""
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def adjust_scheduler(self) -> bool:
        """Whether a prepared scheduler counts optimizer steps (``True``) or micro-batches.

        ``True`` (the plugin's default) advances the scheduler only when the optimizer
        steps; ``False`` advances it on every micro-batch, for schedules sized in
        micro-batches. Accelerate reads ``False`` here by default and ignores the value.
        """
        return bool(self.plugin_kwargs.get("adjust_scheduler", True))

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether gradients are synchronised at the end of each data loader."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised on every batch (saves memory, costs speed)."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

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
            sync = self.step % self.num_steps == 0
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
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the state (tests use this)."""
        GradientState._shared_state.clear()
