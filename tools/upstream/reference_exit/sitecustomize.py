"""Accelerate's calibration processes release their process groups before finalization.

On ``PYTHONPATH`` for ``--lib accelerate`` only (``tools/upstream_suite.py``). Accelerate 1.15
never destroys the default process group unless ``end_training`` is called, so its gloo worker
threads are still alive during interpreter finalization, where they can abort a process that
has passed (SIGABRT, "terminate called without an active exception", pytorch/pytorch#190489):
a test program would then count as failed for a reason that is torch's, not the program's.
This exit handler, registered at start-up and so run after every other one, does what
accel-state's own exit handler does for accel: destroy the groups, then collect the reference
cycles that keep them alive, which joins the worker threads.
"""

from __future__ import annotations

import atexit
import gc
import sys


def _release_process_groups() -> None:
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
    gc.collect()


atexit.register(_release_process_groups)
