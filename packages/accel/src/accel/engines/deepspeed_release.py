"""Let go of everything DeepSpeed keeps of a run, so its process groups end with ``end_training``.

A gloo process group's worker threads live as long as the group object; still alive during
interpreter finalization they can abort a process that has finished ("terminate called
without an active exception", pytorch/pytorch#190489). After ``end_training`` and a garbage
collection, a ZeRO run on 2 CPU ranks still had two groups alive, held by:

* the ZeRO optimizer, kept alive by its own gradient hooks: a parameter's post-accumulate
  hook closes over the optimizer, which holds the parameter and its data-parallel group, and
  part of that cycle is held from C++ (autograd), which the collector cannot see through.
  ``DeepSpeedEngine.destroy()`` removes the hooks (and ZeRO-3's module hooks).
* ZeRO-3's module stack (``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``), where
  each ZeRO-3 engine pushes its model at set-up and never pops it: the model holds its
  parameters, their partitioning group and the optimizer.
* ``deepspeed.utils.groups``: the clone of the world group DeepSpeed makes for its data
  parallelism (``_WORLD_GROUP``), and whatever other group or mesh it registered. Left there,
  they would also be handed to a later run in the same process after the world is rebuilt.
* the world group itself, captured as the *default argument* ``group=group.WORLD`` of
  functions defined in modules first imported after the group existed (DeepSpeed's
  ``TorchBackend.barrier``, ``torch.distributed.nn.functional``, which DeepSpeed imports).
  ``None`` means the default group to those functions, so the default becomes ``None``:
  identical while the group lives, and correct for a group built later.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["release_deepspeed"]

#: Modules whose functions may hold the world group as a default argument.
_CAPTURING_PREFIXES = ("deepspeed", "torch.distributed")


def release_deepspeed(engines: Iterable[Any]) -> None:
    """Destroy ``engines`` (``deepspeed.DeepSpeedEngine``) and DeepSpeed's group references."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    for engine in engines:
        engine.destroy()
        if isinstance(stack, list):
            stack[:] = [module for module in stack if module is not engine.module]
    _forget_registered_groups(sys.modules.get("deepspeed.utils.groups"))
    if dist.is_available() and dist.is_initialized():
        _uncapture(dist.distributed_c10d._get_default_group())


def _is_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup) or type(value).__name__ == "DeviceMesh"


def _forget_registered_groups(groups: types.ModuleType | None) -> None:
    """Reset every module-level group, mesh or mapping of groups in DeepSpeed's registry."""
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if _is_group(value):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(_is_group(item) for item in value.values()):
            value.clear()


def _uncapture(world: Any) -> None:
    """Replace ``world`` by ``None`` wherever a function holds it as a default argument."""
    for function in _functions():
        defaults = function.__defaults__
        if defaults and any(value is world for value in defaults):
            function.__defaults__ = tuple(None if value is world else value for value in defaults)
        keywords = function.__kwdefaults__
        if keywords and any(value is world for value in keywords.values()):
            function.__kwdefaults__ = {
                key: (None if value is world else value) for key, value in keywords.items()
            }


def _functions() -> Iterator[types.FunctionType]:
    """The functions and methods defined in the modules of :data:`_CAPTURING_PREFIXES`."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_CAPTURING_PREFIXES):
            continue
        # type() only: isinstance() would read ``__class__``, which some deprecated module
        # attributes turn into a warning (torch.distributed.reduce_op).
        for value in list(vars(module).values()):
            if issubclass(type(value), type) and vars(value).get("__module__") == name:
                for member in list(vars(value).values()):
                    if type(member) in (staticmethod, classmethod):
                        member = member.__func__
                    if type(member) is types.FunctionType:
                        yield member
            elif type(value) is types.FunctionType and value.__module__ == name:
                yield value
