"""The hook protocol: :class:`ModelHook`, :class:`SequentialHook`, attaching and removing hooks.

A hooked module keeps its hook and its original ``forward`` in its own ``__dict__``, under the
attribute names below (Accelerate's names, which other libraries read); its ``forward`` is
replaced on the instance by one that runs the hook's callbacks around the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "BOUND_MATERIALIZER_ATTR",
    "GUARDED_METHODS",
    "HOOK_ATTR",
    "META_SLOTS_ATTR",
    "OLD_FORWARD_ATTR",
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "close_materializer",
    "hook_of",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]

HOOK_ATTR = "_hf_hook"
"""Where a hooked module keeps its hook."""
OLD_FORWARD_ATTR = "_old_forward"
"""Where a hooked module keeps its original ``forward``."""
META_SLOTS_ATTR = "_accel_meta_slots"
"""Where an offloaded module caches its meta tensors for the fast path of ``materialize``."""
BOUND_MATERIALIZER_ATTR = "_accel_bound_materializer"
"""Where a model keeps the materialiser bound by ``set_weight_materializer`` (closed on removal)."""
GUARDED_METHODS = ("to", "cuda", "cpu", "xpu", "npu", "mlu", "musa", "sdaa")
"""Methods that ``dispatch_model`` guards on a model instance; removing the hook removes them."""


class ModelHook:
    """Callbacks run just before and after a module's ``forward``, with its args and kwargs.

    Subclass it and attach an instance with :func:`add_hook_to_module`. Unlike PyTorch's forward
    hooks, ``pre_forward`` receives (and may replace) the keyword arguments too, and the hook
    can replace the module when attached.

    Attributes:
        no_grad: run the module's original ``forward`` under ``torch.no_grad()``.
    """

    no_grad: bool = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is attached; returns the module to use (usually ``module``)."""
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run before ``forward``; returns the ``(args, kwargs)`` that ``forward`` receives."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Run after ``forward``; returns the output given back to the caller."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is removed; undoes what ``init_hook`` did where that matters."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order at each event (``post_forward`` in the same order too).

    ``no_grad`` is true when any of the hooks asks for it.

    Args:
        *hooks: the hooks, first to run first.
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks
        self.no_grad = any(hook.no_grad for hook in hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Run every hook's ``init_hook``, each on the module the previous one returned."""
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Thread ``(args, kwargs)`` through every hook's ``pre_forward``."""
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Thread the output through every hook's ``post_forward``."""
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Run every hook's ``detach_hook``."""
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def __repr__(self) -> str:
        return f"SequentialHook({', '.join(repr(hook) for hook in self.hooks)})"


def _is_graph_module(module: nn.Module) -> bool:
    # torch.fx gives each GraphModule instance its own class; its forward must be patched on
    # that class (an instance attribute would freeze the graph's code).
    return isinstance(module, fx.GraphModule)


def hook_of(module: nn.Module) -> ModelHook | None:
    """The hook attached to ``module`` (kept in its ``__dict__``), if any."""
    hook: ModelHook | None = module.__dict__.get(HOOK_ATTR)
    return hook


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    attributes = module.__dict__
    hook: ModelHook = attributes[HOOK_ATTR]
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = attributes[OLD_FORWARD_ATTR](*args, **kwargs)
    else:
        output = attributes[OLD_FORWARD_ATTR](*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its ``forward`` now runs the hook's callbacks around it.

    The original ``forward`` is kept in ``module._old_forward`` (across any number of
    re-hookings) and the hook in ``module._hf_hook``; ``forward`` is replaced on the instance
    only, so other instances of the class are unaffected. :func:`remove_hook_from_module`
    restores the original.

    Args:
        module: the module to hook.
        hook: the hook; its ``init_hook`` runs now.
        append: chain ``hook`` after the module's current hook (as a :class:`SequentialHook`)
            instead of replacing it.

    Returns:
        The module returned by ``hook.init_hook`` (the same module unless the hook replaced it).
    """
    previous = hook_of(module)
    if append and previous is not None:
        _detach(module, remove_guards=False)
        hook = SequentialHook(previous, hook)

    original: Callable[..., Any]
    if hook_of(module) is not None and OLD_FORWARD_ATTR in module.__dict__:
        original = module.__dict__[OLD_FORWARD_ATTR]
    else:
        original = module.forward
        module.__dict__[OLD_FORWARD_ATTR] = original

    module = hook.init_hook(module)
    module.__dict__[HOOK_ATTR] = hook
    module.__dict__[OLD_FORWARD_ATTR] = original

    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if _is_graph_module(module):
        type(module).forward = forward
    else:
        module.__dict__["forward"] = forward
    return module


def _restore_forward(module: nn.Module, original: Callable[..., Any]) -> None:
    bound_here = getattr(original, "__self__", None) is module
    func = getattr(original, "__func__", None)
    if _is_graph_module(module):
        type(module).forward = func if bound_here and func is not None else original
    elif bound_here and func is getattr(type(module), "forward", None):
        # The original was the class's own forward: drop the instance attribute so the module
        # is exactly as it was before hooking.
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = original


def _detach(module: nn.Module, remove_guards: bool) -> None:
    hook = hook_of(module)
    if hook is not None:
        hook.detach_hook(module)
    module.__dict__.pop(HOOK_ATTR, None)
    original = module.__dict__.pop(OLD_FORWARD_ATTR, None)
    if original is not None:
        _restore_forward(module, original)
    if remove_guards:
        for name in GUARDED_METHODS:
            module.__dict__.pop(name, None)
        bound = module.__dict__.pop(BOUND_MATERIALIZER_ATTR, None)
        if bound is not None:
            close_materializer(bound)


def close_materializer(materializer: object) -> None:
    """Call ``materializer.close()`` when it has one (materialisers with per-model state)."""
    close = getattr(materializer, "close", None)
    if callable(close):
        close()


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (running its ``detach_hook``) and restore its ``forward``.

    Also removes the guards that :func:`~accel_bigmodel.dispatch.dispatch_model` puts on
    ``model.to`` / ``model.cuda``, and closes the weight materialiser bound to ``module`` by
    :func:`~accel_bigmodel.hooks.set_weight_materializer` (its background work stops).

    Args:
        module: the hooked module (a module without hook is returned unchanged).
        recurse: do the same for every submodule.

    Returns:
        The same module.
    """
    _detach(module, remove_guards=True)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and of all its submodules."""
    remove_hook_from_module(module, recurse=True)
