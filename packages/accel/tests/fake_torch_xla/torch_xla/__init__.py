"""A fake ``torch_xla`` for accel's tests (torch_xla cannot be installed beside torch 2.13).

It behaves like one XLA device per process: the device is the CPU, the processes are the
ones :func:`torch_xla.distributed.xla_multiprocessing.spawn` starts, and the collectives of
``torch_xla.core.xla_model`` really exchange tensors between them (through a file store, not
a ``torch.distributed`` group, as torch_xla has none either). Every call accel makes is
recorded (see :mod:`torch_xla._fake`) so tests can check what was called, and in which order.
Only the parts of torch_xla's documented API that accel uses exist.
"""

from __future__ import annotations

import torch

from . import _fake

__version__ = "2.9.0"


def device(index: int | None = None) -> torch.device:
    """This process's XLA device (the CPU here)."""
    _fake.record("device")
    return torch.device("cpu")


def sync() -> None:
    """Run the pending graph (``xm.mark_step``'s newer name)."""
    _fake.record("mark_step")
