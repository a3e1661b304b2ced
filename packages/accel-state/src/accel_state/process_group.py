"""The process group: joining it, leaving it, and turning its failures into clear errors.

accel never writes its own rendezvous or collective: it calls
``torch.distributed.init_process_group`` with the topology read by :mod:`accel_state.topology`
(``env://`` rendezvous, gloo on CPU, nccl on CUDA) and a timeout. This module also owns the
*hang guard*: every collective accel runs goes through :func:`collective_failure`, so a rank
that waits for a peer that never arrives fails after the process-group timeout with a
:class:`~accel_state.exceptions.DistributedOperationException` naming the operation instead
of hanging, and, in debug mode (``ACCEL_DEBUG_MODE=1``), :func:`verify_collective` first checks
that every rank entered the same operation with matching inputs.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .exceptions import DistributedOperationException
from .topology import ProcessTopology

__all__ = ["collective_failure", "destroy_process_group", "init_process_group", "verify_collective"]

_timeout_seconds: float | None = None


def init_process_group(
    topology: ProcessTopology,
    backend: str,
    timeout: timedelta,
    init_method: str | None = None,
    **kwargs: Any,
) -> None:
    """Join the default process group described by ``topology`` unless one already exists.

    The rank variables are exported (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) so that code run later, and
    libraries such as DeepSpeed, see the same topology whichever launcher started the
    process. A group created beforehand (by the user or a launcher) is reused as it is.
    """
    global _timeout_seconds
    os.environ["RANK"] = str(topology.rank)
    os.environ["WORLD_SIZE"] = str(topology.world_size)
    os.environ["LOCAL_RANK"] = str(topology.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(topology.local_world_size)
    if topology.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", topology.master_addr)
    if topology.master_port is not None:
        os.environ.setdefault("MASTER_PORT", str(topology.master_port))
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=topology.rank,
        world_size=topology.world_size,
        timeout=timeout,
        **kwargs,
    )
    _timeout_seconds = timeout.total_seconds()
    atexit.unregister(_destroy_at_exit)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    # A gloo group still alive while the interpreter tears down can abort the process
    # ("terminate called without an active exception") after the script itself succeeded,
    # so the group accel created is destroyed while Python is still fully alive.
    try:
        destroy_process_group()
    except Exception:  # noqa: BLE001 - nothing useful can be raised at interpreter exit
        return


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (default: the default group) if it exists."""
    global _timeout_seconds
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)
        if group is None:
            _timeout_seconds = None


def _rank() -> str:
    try:
        return str(dist.get_rank())
    except (RuntimeError, ValueError):
        return "?"


def collective_failure(operation: str, error: BaseException) -> DistributedOperationException:
    """Describe a collective that raised (usually a timeout) as a named, actionable error."""
    waited = (
        f"{_timeout_seconds:g} s" if _timeout_seconds is not None else "the process-group timeout"
    )
    text = str(error).strip().splitlines()
    cause = text[-1] if text else type(error).__name__
    return DistributedOperationException(
        f"`{operation}` failed on rank {_rank()} (a collective waits at most {waited} for the "
        f"other ranks): {cause}. Every rank must call `{operation}` in the same order; a "
        "collective inside `if accelerator.is_main_process:` or a rank that stopped early "
        "leaves the others waiting. Run with ACCEL_DEBUG_MODE=1 to see which operation each "
        "rank was running, and set the timeout with InitProcessGroupKwargs(timeout=...) or "
        "ACCEL_PROCESS_GROUP_TIMEOUT."
    )


def verify_collective(
    operation: str, summary: Any, num_processes: int, compare_inputs: bool = True
) -> None:
    """Check, before a collective, that all ranks run ``operation`` with matching inputs.

    Used in debug mode. Every rank exchanges ``(operation, summary)`` through
    ``all_gather_object``; because the exchange itself is the same on every rank whatever
    operation follows, a rank that skipped a collective is caught at its next one.

    Raises:
        DistributedOperationException: the ranks entered different operations, their inputs
            differ (``summary`` mismatch, when ``compare_inputs``), or a rank never arrived.
    """
    entries: list[Any] = [None] * num_processes
    try:
        dist.all_gather_object(entries, (operation, summary))
    except RuntimeError as err:
        raise collective_failure(operation, err) from err
    operations = [entry[0] for entry in entries]
    if any(op != operation for op in operations):
        per_rank = "\n".join(f"  - Process {i}: `{op}`" for i, op in enumerate(operations))
        raise DistributedOperationException(
            f"The ranks entered different collective operations, so `{operation}` cannot run "
            f"(some rank skipped a collective or called one the others did not):\n{per_rank}"
        )
    summaries = [entry[1] for entry in entries]
    if compare_inputs and any(s != summaries[0] for s in summaries):
        per_rank = "\n".join(f"  - Process {i}: {s}" for i, s in enumerate(summaries))
        raise DistributedOperationException(
            "Cannot apply desired operation due to shape mismatches. All shapes across devices "
            f"must be valid.\n\nOperation: `{operation}`\nInput shapes:\n{per_rank}"
        )
