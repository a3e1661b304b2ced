"""What an ``Accelerator`` prepared: the registry of its objects, and the rules of ``prepare``.

:class:`PreparedObjects` keeps the prepared models, optimizers, schedulers and data loaders in
prepare order (clipping, metrics and checkpoints find them there), the objects registered for
checkpointing and the checkpoint pre-hooks. A prepared object carries a mark
(``_is_accelerate_prepared``), so preparing it again, even with another Accelerator of the same
run, returns it unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import DataLoader

from accel_amp import AcceleratedOptimizer, AcceleratedScheduler
from accel_state import DistributedType

__all__ = ["Kind", "PreparedObjects", "prepare_stage", "refuse_quantized_placement"]

_T = TypeVar("_T")

#: The kinds of prepared objects, each the name of its list in :class:`PreparedObjects`.
Kind = Literal["models", "optimizers", "schedulers", "dataloaders"]

#: The attribute that marks an object as prepared (Accelerate's name).
_MARK = "_is_accelerate_prepared"


class PreparedObjects:
    """The prepared objects of one Accelerator, by kind and in prepare order.

    Attributes:
        models: Prepared models (the engine's wrappers).
        optimizers: Prepared optimizers (``AcceleratedOptimizer``).
        schedulers: Prepared schedulers (``AcceleratedScheduler``).
        dataloaders: Prepared data loaders.
        custom_objects: Objects registered with ``register_for_checkpointing``.
        save_pre_hooks: Hooks run before ``save_state``, by handle id.
        load_pre_hooks: Hooks run before ``load_state``, by handle id.
    """

    def __init__(self) -> None:
        self.models: list[Any] = []
        self.optimizers: list[AcceleratedOptimizer] = []
        self.schedulers: list[AcceleratedScheduler] = []
        self.dataloaders: list[DataLoader[Any]] = []
        self.custom_objects: list[Any] = []
        self.save_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.load_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    def __contains__(self, obj: Any) -> bool:
        return any(obj is known for registry in self._kinds() for known in registry)

    def add(self, kind: Kind, obj: _T) -> _T:
        """Mark ``obj`` as prepared and keep it in the ``kind`` list; return it."""
        setattr(obj, _MARK, True)
        getattr(self, kind).append(obj)
        return obj

    def adopt(self, kind: Kind, obj: Any) -> bool:
        """Whether ``obj`` is prepared already; if so it is kept in the ``kind`` list (once).

        An object prepared by another Accelerator of the run is adopted, so that this one's
        clipping and checkpoints include it.
        """
        if not getattr(obj, _MARK, False):
            return False
        registry: list[Any] = getattr(self, kind)
        if not any(obj is known for known in registry):
            registry.append(obj)
        return True

    def sizes(self) -> tuple[int, ...]:
        """The length of each kind's list (see :meth:`truncate`)."""
        return tuple(len(registry) for registry in self._kinds())

    def truncate(self, sizes: tuple[int, ...]) -> list[Any]:
        """Drop what was added since :meth:`sizes` returned ``sizes``; return the dropped."""
        dropped: list[Any] = []
        for registry, size in zip(self._kinds(), sizes, strict=True):
            dropped += registry[size:]
            del registry[size:]
        return dropped

    def discard(self, objects: Iterable[Any]) -> None:
        """Forget each of ``objects`` (by identity)."""
        gone = list(objects)
        for registry in self._kinds():
            registry[:] = [known for known in registry if all(known is not x for x in gone)]

    def forget(self) -> None:
        """Forget every prepared object (custom objects and hooks stay).

        New lists replace the old ones, which wrappers built earlier may still hold.
        """
        self.models = []
        self.optimizers = []
        self.schedulers = []
        self.dataloaders = []

    def register_for_checkpointing(self, objects: Iterable[Any]) -> None:
        """Keep ``objects`` (each with ``state_dict``/``load_state_dict``) for checkpoints.

        Raises:
            ValueError: some objects lack the two methods; the message lists their indices.
        """
        objects = list(objects)
        invalid = [
            f"- Item at index {index}, `{type(obj).__name__}`"
            for index, obj in enumerate(objects)
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            )
        ]
        if invalid:
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to "
                "be stored. The following inputs are invalid:\n" + "\n".join(invalid)
            )
        self.custom_objects.extend(objects)

    def _kinds(self) -> tuple[list[Any], ...]:
        return (self.models, self.optimizers, self.schedulers, self.dataloaders)


def prepare_stage(obj: Any) -> int | None:
    """When ``prepare`` handles ``obj``: 0 models and loaders, 1 optimizers, 2 schedulers."""
    if isinstance(obj, DataLoader | torch.nn.Module):
        return 0
    if isinstance(obj, torch.optim.Optimizer):
        return 1
    if isinstance(
        obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        return 2
    return None


def refuse_quantized_placement(
    model: torch.nn.Module,
    distributed_type: DistributedType,
    device: torch.device,
    *,
    cpu_kernels: Callable[[], bool],
) -> None:
    """Refuse to train an 8-/4-bit (bitsandbytes) model whose device map cannot train.

    Such a model trains only where its weights are: on several devices only without a
    distributed run, never with weights on ``"disk"``, and on ``"cpu"`` only with a
    bitsandbytes build that has its CPU (multi-backend) kernels and not on XPU.

    Args:
        model: The model ``prepare`` was given.
        distributed_type: The run's distributed type.
        device: This process's device.
        cpu_kernels: Says whether bitsandbytes can train on the CPU here (a multi-backend
            build, not on XPU); called only for a quantized model with CPU weights.

    Raises:
        ValueError: the placement cannot train (the message says which rule and the fix).
    """
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(
        model, "is_loaded_in_4bit", False
    )
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not device_map:
        return
    placements = {str(value) for value in device_map.values()}
    if len(placements) > 1 and distributed_type != DistributedType.NO:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on "
            f"multiple devices ({sorted(placements)}) in a distributed run "
            f"({distributed_type.value}): launch one process, which then runs the layers "
            "one after the other on their devices"
        )
    if "disk" in placements or ("cpu" in placements and not cpu_kernels()):
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU "
            f"or disk offload (device map places weights on {sorted(placements)}): load it "
            "entirely on the accelerator, or install a bitsandbytes build with CPU "
            "(multi-backend) support to train it on the CPU"
        )
    if len(placements) == 1 and device.type != "cpu":
        (only,) = placements
        where = torch.device(int(only)) if only.isdigit() else torch.device(only)
        if where.type != device.type or (where.index not in (None, 0, device.index)):
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision on a "
                f"different device ({where}) than the one this process trains on ({device}): "
                f"load it with device_map={{'': {device.index or 0}}}"
            )
