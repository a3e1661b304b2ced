"""DeepSpeed checkpoints inside accel's: one DeepSpeed tag folder per trained model.

``save_state`` under DeepSpeed writes, crash-safely like every accel checkpoint, DeepSpeed's
own ``engine.save_checkpoint`` folders (``pytorch_model/``, then ``pytorch_model_<i>/``: the
layout Accelerate writes and reads) beside accel's files (RNG, loader position, custom
objects). Inside an open accumulation window it also saves, per rank, the partial gradients
DeepSpeed keeps (see :meth:`DeepSpeedLayout.pending_gradients`), and ``load_state`` puts them
back where DeepSpeed adds the next micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .base import CheckpointLayout
from .deepspeed_plugin import get_value

__all__ = [
    "CHECKPOINT_TAG",
    "DeepSpeedLayout",
    "DeepSpeedModel",
    "DeepSpeedRun",
    "RunDevice",
    "checkpoint_tag",
]

CHECKPOINT_TAG = "pytorch_model"


# The layout declares what it reads of the engine and its models here, so that the engine
# module depends on the layout and not the reverse; accel's DeepSpeedZeroEngine and
# DeepSpeedEngineWrapper have these members.


class RunDevice(Protocol):
    """The part of the run's state the layout reads: the device this process computes on."""

    @property
    def device(self) -> torch.device:
        """This process's device."""
        ...


class DeepSpeedModel(Protocol):
    """One prepared DeepSpeed model, as the layout sees it (accel's ``DeepSpeedEngineWrapper``)."""

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine``."""
        ...

    @property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config the engine was initialized with."""
        ...

    @property
    def trains(self) -> bool:
        """Whether the model was prepared with an optimizer (only those are checkpointed)."""
        ...


class DeepSpeedRun(Protocol):
    """What :class:`DeepSpeedLayout` needs from its engine (accel's ``DeepSpeedZeroEngine``)."""

    @property
    def state(self) -> RunDevice:
        """The run's state; pending gradients are put back on its ``device``."""
        ...

    @property
    def wrappers(self) -> Sequence[DeepSpeedModel]:
        """Every prepared DeepSpeed model, in the order they were prepared."""
        ...

    def wrapper_of(self, model: Any) -> DeepSpeedModel | None:
        """The prepared DeepSpeed model ``model`` is (or wraps), None when it is none."""
        ...


class DeepSpeedLayout(CheckpointLayout):
    """``engine.save_checkpoint`` / ``load_checkpoint``, one tag folder per trained model.

    The first model's tag is ``pytorch_model`` (and ``latest`` names it), the next ones'
    ``pytorch_model_1``, ``pytorch_model_2``, ... by position among the prepared models, as
    Accelerate names them. A model prepared without an optimizer (a frozen teacher, ZeRO-3
    inference) has no training state and DeepSpeed cannot checkpoint it (it sets up no
    checkpoint engine for it): it is left out, and keeps the weights it has when loading.

    Args:
        engine: The engine building the layout (see :class:`DeepSpeedRun`).
    """

    def __init__(self, engine: DeepSpeedRun) -> None:
        self.engine = engine

    def _wrappers(self, models: Sequence[Any]) -> list[tuple[int, DeepSpeedModel]]:
        """``(position, wrapper)`` of every prepared model that trains."""
        found = []
        for index, model in enumerate(models):
            wrapper = self.engine.wrapper_of(model)
            if wrapper is not None and wrapper.trains:
                found.append((index, wrapper))
        return found

    def save(self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path) -> None:
        """Every rank writes its DeepSpeed files of every trained model (a collective)."""
        prepared = self._wrappers(models)
        first = prepared[0][0] if prepared else 0
        for index, wrapper in prepared:
            wrapper.engine.save_checkpoint(
                str(directory), tag=checkpoint_tag(index), save_latest=index == first
            )

    def prepare_load(
        self, models: Sequence[Any], optimizers: Sequence[Any], directory: Path
    ) -> Callable[[], None]:
        """Check that every model's tag folder exists; the loads themselves are DeepSpeed's."""
        prepared = self._wrappers(models)
        for index, _ in prepared:
            folder = directory / checkpoint_tag(index)
            if not folder.is_dir():
                from accel.checkpointing import CheckpointError

                raise CheckpointError(
                    f"{folder} is missing: not a DeepSpeed checkpoint of {len(prepared)} trained "
                    "model(s) (save_state under DeepSpeed writes one tag folder per trained "
                    "model; a DDP or FSDP2 checkpoint does not load into a DeepSpeed run)"
                )

        def apply() -> None:
            for index, wrapper in prepared:
                wrapper.engine.load_checkpoint(
                    str(directory), tag=checkpoint_tag(index), load_lr_scheduler_states=False
                )

        return apply

    def check_save(self, window_open: bool) -> None:
        """Refuse a save inside a window where accel cannot read DeepSpeed's partial gradients."""
        if not window_open:
            return
        for wrapper in self.engine.wrappers:
            reason = _unreadable_window(wrapper) if wrapper.trains else None
            if reason is not None:
                raise ValueError(
                    f"save_state() inside an accumulation window under DeepSpeed with {reason}: "
                    "the window's partial gradients live inside DeepSpeed where accel cannot "
                    "read them exactly. Save when accelerator.sync_gradients is True (the end "
                    "of a window), or run without that setting"
                )

    def pending_gradients(self, models: Sequence[Any]) -> dict[str, torch.Tensor]:
        """This rank's part of the open window's gradients, where DeepSpeed accumulates them.

        ZeRO-0/1 keep each rank's unreduced gradients in ``param.grad``; ZeRO-2 keeps the
        reduced gradients of this rank's partition (``all_grad_tensors``); ZeRO-3 keeps the
        local fp32 partition of every parameter (``safe_get_local_grad``). The micro-step
        counter DeepSpeed uses to choose between copying and adding goes with them. Keys
        start with the model's position among the prepared models.
        """
        found: dict[str, torch.Tensor] = {}
        for index, wrapper in self._wrappers(models):
            for key, tensor in _window_gradients(wrapper).items():
                found[f"{index}.{key}"] = tensor
        return found

    def restore_pending_gradients(
        self, models: Sequence[Any], grads: dict[str, torch.Tensor] | None
    ) -> None:
        """Put :meth:`pending_gradients` back (``None``: no window was open; clear them)."""
        grads = grads or {}
        for index, wrapper in self._wrappers(models):
            prefix = f"{index}."
            own = {k[len(prefix) :]: v for k, v in grads.items() if k.startswith(prefix)}
            _put_window_gradients(wrapper, own, self.engine.state.device)


def checkpoint_tag(index: int) -> str:
    """The DeepSpeed tag folder of the ``index``-th prepared model."""
    return CHECKPOINT_TAG if index == 0 else f"{CHECKPOINT_TAG}_{index}"


def _stage(wrapper: DeepSpeedModel) -> int:
    return int(get_value(wrapper.config, "zero_optimization.stage") or 0)


def _unreadable_window(wrapper: DeepSpeedModel) -> str | None:
    """Why this engine's in-window gradients cannot be saved (None: they can)."""
    for part in ("offload_optimizer", "offload_param"):
        device = get_value(wrapper.config, f"zero_optimization.{part}.device")
        if device not in (None, "none"):
            return f"zero_optimization.{part}.device={device!r}"
    stage = _stage(wrapper)
    optimizer = wrapper.engine.optimizer
    if stage in (1, 2) and (
        getattr(optimizer, "use_grad_accum_attribute", False)
        or getattr(optimizer, "gradient_accumulation_dtype", None)
        not in (None, getattr(optimizer, "dtype", None))
    ):
        return (
            f"ZeRO-{stage} accumulating gradients in {optimizer.gradient_accumulation_dtype} "
            f"beside {optimizer.dtype} weights"
        )
    if stage == 0 and wrapper.engine.bfloat16_enabled():
        return "ZeRO-0 and bf16 (DeepSpeed's BF16 optimizer)"
    return None


def _window_gradients(wrapper: DeepSpeedModel) -> dict[str, torch.Tensor]:
    engine = wrapper.engine
    optimizer = engine.optimizer
    stage = _stage(wrapper)
    found: dict[str, torch.Tensor] = {}
    if stage == 3:
        from deepspeed.utils import safe_get_local_grad

        for index, param in enumerate(engine.module.parameters()):
            if param.requires_grad:
                found[f"zero3.{index}"] = _saved(safe_get_local_grad(param))
        # ZeRO-3 counts a backward at the next forward: the count the next backward sees.
        done = optimizer.micro_step_id + int(
            bool(getattr(optimizer, "_epilogue_ran_this_backward", False))
        )
        found["zero3.micro_step_id"] = torch.tensor(done)
    elif stage == 2:
        for group, tensors in sorted(optimizer.all_grad_tensors.items()):
            for position, tensor in enumerate(tensors or ()):
                found[f"zero2.{group}.{position}"] = _saved(tensor)
        found["zero2.micro_step_id"] = torch.tensor(int(optimizer.micro_step_id))
    else:
        for index, param in enumerate(engine.module.parameters()):
            if param.grad is not None:
                found[f"local.{index}"] = _saved(param.grad)
    return found


def _put_window_gradients(
    wrapper: DeepSpeedModel, grads: dict[str, torch.Tensor], device: torch.device
) -> None:
    engine = wrapper.engine
    optimizer = engine.optimizer
    stage = _stage(wrapper)
    params = list(engine.module.parameters())
    if stage == 3:
        from deepspeed.utils import safe_set_local_grad

        for index, param in enumerate(params):
            saved = grads.get(f"zero3.{index}")
            if saved is not None:
                safe_set_local_grad(param, saved.to(device))
        optimizer.micro_step_id = int(grads.get("zero3.micro_step_id", torch.tensor(0)))
        optimizer._epilogue_ran_this_backward = False
    elif stage == 2:
        by_group: dict[int, dict[int, torch.Tensor]] = {}
        for key, tensor in grads.items():
            parts = key.split(".")
            if parts[0] == "zero2" and parts[1] != "micro_step_id":
                by_group.setdefault(int(parts[1]), {})[int(parts[2])] = tensor.to(device)
        for group in {*optimizer.all_grad_tensors, *by_group}:
            parts_of = by_group.get(group)
            optimizer.all_grad_tensors[group] = (
                None if parts_of is None else [parts_of[i] for i in sorted(parts_of)]
            )
        if "zero2.micro_step_id" in grads:
            optimizer.micro_step_id = int(grads["zero2.micro_step_id"])
    else:
        for index, param in enumerate(params):
            saved = grads.get(f"local.{index}")
            param.grad = None if saved is None else saved.to(device, param.dtype).clone()


def _saved(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu().clone()
