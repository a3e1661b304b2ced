"""How the scripts' Accelerate 1.15 processes leave: at once, with finalization skipped.

Accelerate 1.15 leaves its gloo process groups alive into interpreter finalization (it
destroys them only in ``end_training``, and even then FSDP2's device mesh and DeepSpeed keep
them). There torch's gloo worker threads can abort a process that has finished its work:
SIGABRT, "terminate called without an active exception" (pytorch/pytorch#190489). Here that
was 1 run in 30 of ``data_order.py`` under Accelerate, more often on the CI machines, and each
time it failed a comparison that had already produced its result (so did a 2-process run of
``hf_stack/trainer.py``, which leaves through here too: ``hf_stack/common.finish``).

accel releases its groups itself at exit (accel-state's exit handler), so its processes leave
normally and that stays under test: :func:`leave` returns the code unchanged for accel. For
Accelerate it destroys the default group, flushes the output and leaves with ``os._exit``.
"""

from __future__ import annotations

import os
import sys

import torch


def leave(lib: str, code: int) -> int:
    """``code`` for accel; for Accelerate, exit now with ``code`` (never returns)."""
    if lib != "accelerate":
        return code
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
