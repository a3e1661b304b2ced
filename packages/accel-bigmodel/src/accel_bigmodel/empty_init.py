"""Build a model without allocating its weights: on the meta device, or straight on a device.

``with init_empty_weights(): model = MyModel(config)`` costs no memory whatever the model's
size; the weights are filled in later by the checkpoint loader. ``init_on_device`` creates the
parameters directly on a given device (for example a GPU), skipping the CPU copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from accel_state.environment import ACCEL_INIT_INCLUDE_BUFFERS, parse_flag_from_env

from .tensors import DeviceLike, parse_device, same_device

__all__ = ["init_empty_weights", "init_on_device"]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter built inside the block on the meta device (no memory used).

    Args:
        include_buffers: also create buffers on meta. Default: the ``ACCEL_INIT_INCLUDE_BUFFERS``
            environment variable if set, else ``False`` (buffers such as rotary frequencies are
            usually computed in ``__init__`` and not stored in checkpoints).

    Example::

        with init_empty_weights():
            model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(1000)])
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: DeviceLike, include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter (and, optionally, buffer) built inside the block on ``device``.

    Parameters keep their class (``nn.Parameter`` subclasses), their attributes and
    ``requires_grad``. The patch of ``nn.Module.register_parameter`` is always undone on exit,
    even when the block raises.

    Args:
        device: where parameters are created (``"meta"``, ``"cpu"``, ``"cuda:0"``, ...).
        include_buffers: also create buffers on ``device``; then every tensor factory call in the
            block runs on it (``with torch.device(device)``). Default:
            ``ACCEL_INIT_INCLUDE_BUFFERS`` if set, else ``False``.

    Raises:
        ValueError: ``device`` is not a device (``"disk"`` is not one here).
    """
    target = parse_device(device, "device")
    if target == "disk":
        raise ValueError(
            "device='disk': parameters cannot be created on disk; use init_empty_weights() and "
            "offload them when loading (device_map with 'disk' entries)."
        )
    if include_buffers is None:
        include_buffers = parse_flag_from_env(ACCEL_INIT_INCLUDE_BUFFERS, False)
    if include_buffers:
        with torch.device(target):
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None:
            return
        created = module._parameters[name]
        assert created is not None
        if same_device(created.device, target):
            # Already there (e.g. `self.head.weight = self.embed.weight` re-registers a
            # parameter made inside the block): keep the object, so ties survive.
            return
        attributes = dict(created.__dict__)
        rebuilt = type(created)(created.to(target), requires_grad=created.requires_grad)
        for key, item in attributes.items():
            setattr(rebuilt, key, item)
        module._parameters[name] = rebuilt

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
