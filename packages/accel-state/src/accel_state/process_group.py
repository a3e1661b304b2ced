"""The process group: joining it, leaving it, and turning its failures into clear errors.

accel never writes its own rendezvous or collective: it calls
``torch.distributed.init_process_group`` with the topology read by :mod:`accel_state.topology`
(``env://`` rendezvous, gloo on CPU, nccl on CUDA) and a timeout.

Under torchelastic with ``--max_restarts`` above 0, a restarted worker group finds the store
of the run as the previous attempt left it (torchrun keeps the same store across restarts), and
gloo or nccl would read the dead ranks' addresses from it ("Gloo connectFullMesh failed ...
Connection refused"). So in that case the group is built on a view of the store whose keys carry
a prefix unique to the attempt: global rank 0 draws a fresh generation id and hands it to every
other rank through a token echo that old keys cannot fake (see :func:`agree_on_generation`).
The id is agreed on rather than derived from ``TORCHELASTIC_RESTART_COUNT`` because that count
is kept per machine, and machines of one run can disagree on it.

This module also owns the
*hang guard*: every collective accel runs goes through :func:`collective_failure`, so a rank
that waits for a peer that never arrives fails after the process-group timeout with a
:class:`~accel_state.exceptions.DistributedOperationException` naming the operation instead
of hanging, and, in debug mode (``ACCEL_DEBUG_MODE=1``), :func:`verify_collective` first checks
that every rank entered the same operation with matching inputs.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .exceptions import DistributedOperationException
from .topology import ProcessTopology

__all__ = [
    "agree_on_generation",
    "collective_failure",
    "destroy_process_group",
    "init_process_group",
    "release_mesh_groups",
    "verify_collective",
]

_timeout_seconds: float | None = None

#: Where the generation handshake keeps its keys in the run's store.
_GENERATION_KEY = "accel/generation"
#: First and longest pause between two looks at the store during the handshake (seconds).
_POLL_START = 0.002
_POLL_MAX = 0.05


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
    if _restartable(topology, init_method, kwargs):
        dist.init_process_group(
            backend=backend,
            store=_attempt_store(topology, timeout),
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timeout,
            **kwargs,
        )
    else:
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


def _restartable(
    topology: ProcessTopology, init_method: str | None, kwargs: dict[str, Any]
) -> bool:
    """Whether the group must be built on a per-attempt view of torchelastic's store.

    Only ``env://`` rendezvous under torchelastic with restarts allowed: the condition is the
    same on every rank of a run (``--max_restarts`` is a launch argument), so either all ranks
    take part in the generation handshake or none does.
    """
    if "store" in kwargs or init_method not in (None, "env://"):
        return False
    return topology.max_restarts > 0


def _attempt_store(topology: ProcessTopology, timeout: timedelta) -> dist.Store:
    rendezvous = dist.rendezvous(
        "env://", rank=topology.rank, world_size=topology.world_size, timeout=timeout
    )
    store, _, _ = next(rendezvous)
    store.set_timeout(timeout)
    generation = agree_on_generation(store, topology.rank, topology.world_size, timeout)
    return dist.PrefixStore(f"{_GENERATION_KEY}/{generation}", store)  # joined with "/"


def _read(store: dist.Store, key: str) -> str | None:
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode("utf-8")


def agree_on_generation(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """Agree with every rank on an id that no earlier attempt of the run has used.

    A store shared with earlier attempts holds their keys, including this handshake's, so a
    value found in it proves nothing by itself. Global rank 0 draws a fresh id; every other
    rank publishes a fresh token under ``accel/generation/join/<rank>`` and waits for rank 0 to
    answer ``<token>:<id>`` under ``accel/generation/ack/<rank>``; an answer to an old token is
    ignored. Each rank then writes the id back under ``accel/generation/confirm/<rank>``, and
    rank 0 returns once every rank has confirmed the id it drew, which no old key can contain.

    Args:
        store: The run's store (shared by all ranks).
        rank: This process's global rank.
        world_size: Number of processes of the run.
        timeout: How long to wait for the other ranks.

    Returns:
        The generation id (a hex string), the same on every rank.

    Raises:
        TimeoutError: some ranks did not take part within ``timeout``; the message names them.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    pause = _POLL_START
    if rank == 0:
        generation = uuid.uuid4().hex
        pending = set(range(1, world_size))
        answered: dict[int, str] = {}
        while pending:
            for peer in sorted(pending):
                token = _read(store, f"{_GENERATION_KEY}/join/{peer}")
                if token is not None and answered.get(peer) != token:
                    store.set(f"{_GENERATION_KEY}/ack/{peer}", f"{token}:{generation}")
                    answered[peer] = token
                if _read(store, f"{_GENERATION_KEY}/confirm/{peer}") == generation:
                    pending.discard(peer)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank 0 waited {timeout.total_seconds():g} s for ranks "
                        f"{sorted(pending)} to join this attempt of the run (torchelastic "
                        "restart handshake): they did not start or died first; see their logs"
                    )
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
        return generation
    token = uuid.uuid4().hex
    store.set(f"{_GENERATION_KEY}/join/{rank}", token)
    while True:
        answer = _read(store, f"{_GENERATION_KEY}/ack/{rank}")
        if answer is not None:
            echoed, _, generation = answer.partition(":")
            if echoed == token and generation:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} waited {timeout.total_seconds():g} s for rank 0 to answer its "
                "join of this attempt of the run (torchelastic restart handshake): rank 0 did "
                "not start or died first; see its log"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)
    store.set(f"{_GENERATION_KEY}/confirm/{rank}", generation)
    return generation


def _destroy_at_exit() -> None:
    # A gloo group still alive while the interpreter tears down can abort the process
    # ("terminate called without an active exception") after the script itself succeeded,
    # so the group accel created is destroyed while Python is still fully alive. Prepared
    # models keep their groups (and the groups' worker threads) through reference cycles,
    # which only the finalizing interpreter would collect: collect them here, first.
    try:
        destroy_process_group()
    except Exception:  # noqa: BLE001 - nothing useful can be raised at interpreter exit
        pass
    gc.collect()


#: How long :func:`destroy_process_group` lets go of the GIL after destroying (seconds).
_QUIESCE_SECONDS = 0.05


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (default: the default group) if it exists.

    Then sleeps :data:`_QUIESCE_SECONDS` without the GIL. A gloo worker thread frees each
    finished collective, and that may need the GIL (the work keeps the launching thread's
    state, which can hold Python objects); the group's destructor, run when its last holder
    (a DDP reducer, a mesh) is dropped, joins those threads while the dropping thread holds
    the GIL. Dropped right after the last collective, before the worker got the GIL, that is
    a deadlock (seen: ``del model`` hanging after ``end_training``, DDP on 2 gloo ranks under
    load). The pause lets the workers finish first.
    """
    global _timeout_seconds
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)
        if group is None:
            _timeout_seconds = None
        time.sleep(_QUIESCE_SECONDS)


def release_mesh_groups(mesh: Any, seen: set[int] | None = None) -> None:
    """Drop the process-group references ``mesh`` (and the meshes flattened from it) keeps.

    torch's ``DeviceMesh`` keeps the groups it was built from even after
    ``destroy_process_group``, and a gloo group's worker threads live as long as the group:
    held by a mesh, they run into interpreter finalization, where they can abort a finished
    process ("terminate called without an active exception"). The mesh is unusable after this.
    """
    seen = set() if seen is None else seen
    if mesh is None or id(mesh) in seen:
        return
    seen.add(id(mesh))
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
    flattened = getattr(mesh, "_flatten_mapping", None)
    for child in flattened.values() if isinstance(flattened, dict) else ():
        release_mesh_groups(child, seen)


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
