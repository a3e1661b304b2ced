"""Run a function on several gloo CPU processes on 127.0.0.1, with a timeout.

``run_on_cpu(fn, world_size=2)`` starts ``world_size`` processes (forked from a server that
has imported torch once, or spawned where that is unavailable), gives each
the environment a launcher would (``RANK``, ``WORLD_SIZE``, ... or SLURM / Open MPI / PMI
variables), calls ``fn(*args)`` in each and returns the results in rank order. An exception
in any rank is re-raised in the caller as :class:`MultiProcessError` naming the rank; a run
that outlives ``timeout`` is killed and reported the same way, so a hang fails a test
instead of stalling CI.

``fn`` may live in a test module that is not importable by name (pytest's importlib mode):
the children then load it from its file.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from accel_state.topology import get_free_port

__all__ = ["MultiProcessError", "free_port", "run_on_cpu"]

_TOPOLOGIES = ("torchrun", "slurm", "openmpi", "pmi")


class MultiProcessError(RuntimeError):
    """One or more ranks of :func:`run_on_cpu` failed.

    Attributes:
        failures: ``{rank: (exception type name, message, formatted traceback)}``.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]]) -> None:
        self.failures = failures
        parts = [
            f"rank {rank} raised {kind}: {message}\n{trace}"
            for rank, (kind, message, trace) in sorted(failures.items())
        ]
        super().__init__("\n".join(parts))


#: A TCP port on 127.0.0.1 that was free a moment ago: :func:`accel_state.topology.get_free_port`,
#: the one implementation, under the name the test helpers have always used.
free_port = get_free_port


def _topology_env(topology: str, rank: int, world_size: int, port: int) -> dict[str, str]:
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if topology == "torchrun":
        return {
            **common,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    if topology == "slurm":
        return {
            **common,
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(world_size),
            "SLURM_STEP_NUM_TASKS": str(world_size),
            "SLURM_LOCALID": str(rank),
            "SLURM_NNODES": "1",
            "SLURM_JOB_ID": "4242",
        }
    if topology == "openmpi":
        return {
            **common,
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(world_size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(world_size),
        }
    return {
        **common,
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(world_size),
        "MPI_LOCALRANKID": str(rank),
        "MPI_LOCALNRANKS": str(world_size),
    }


_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def _resolve(reference: tuple[str, str, str | None]) -> Callable[..., Any]:
    module_name, qualname, path = reference
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(f"_accel_run_on_cpu_{module_name}", path)
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _child(
    rank: int,
    reference: tuple[str, str, str | None],
    args: tuple[Any, ...],
    environ: dict[str, str],
    results: Any,
) -> None:
    for key in _LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_"))]:
        os.environ.pop(key, None)
    os.environ.update(environ)
    try:
        fn = _resolve(reference)
        value = fn(*args)
        # Plain pickle bytes, not the queue's pickler: a tensor in the result would otherwise
        # travel as a shared-memory handle that dies with this process (a race with the
        # parent's read on a loaded machine).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        results.put((rank, False, (type(err).__name__, str(err), traceback.format_exc())))
    finally:
        # The result reaches the parent before the group is torn down: on torch < 2.8 gloo's
        # ProcessGroup destructor holds the GIL while it joins worker threads that may need it
        # (fixed by pytorch/pytorch#154976); a rank stuck there is killed by the parent, which
        # already has its result.
        with contextlib.suppress(Exception):
            results.close()
            results.join_thread()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _context() -> Any:
    """A forkserver that has imported torch once: each run then starts in well under a second.

    The server imports torch without running any computation, so no thread pool exists
    when ranks are forked from it. Where forkserver is unavailable, spawn is used.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "accel_state"])
    return context


def run_on_cpu(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    topology: str = "torchrun",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` CPU processes and return the results by rank.

    Results travel back through a multiprocessing queue: return plain Python values
    (``tensor.tolist()``), not tensors, whose shared memory disappears with the rank.

    Args:
        fn: A module-level function (it is located by module and name in the children).
        *args: Picklable arguments passed to every rank.
        world_size: Number of processes.
        timeout: Seconds after which all ranks are killed and the run fails.
        collective_timeout: Process-group timeout given to the ranks
            (``ACCEL_PROCESS_GROUP_TIMEOUT``), so a collective some rank skips fails fast.
        topology: Which launcher's variables the ranks get: ``torchrun``, ``slurm``,
            ``openmpi`` or ``pmi``.
        env: Extra environment variables for every rank.

    Raises:
        ValueError: ``topology`` or ``world_size`` is invalid, or ``fn`` is not a
            module-level function.
        MultiProcessError: a rank raised, died, or did not finish within ``timeout``.
    """
    if topology not in _TOPOLOGIES:
        raise ValueError(
            f"topology={topology!r} is not supported: use one of {', '.join(_TOPOLOGIES)}"
        )
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be at least 1")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"run_on_cpu needs a module-level function, got {qualname!r}: move it to the top "
            "level of its module"
        )
    path = getattr(sys.modules.get(fn.__module__), "__file__", None)
    reference = (fn.__module__, qualname, path)
    port = free_port()
    context = _context()
    results = context.Queue()
    processes = []
    for rank in range(world_size):
        environ = {
            "ACCEL_PROCESS_GROUP_TIMEOUT": str(collective_timeout),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            **_topology_env(topology, rank, world_size, port),
            **dict(env or {}),
        }
        process = context.Process(
            target=_child, args=(rank, reference, args, environ, results), daemon=True
        )
        process.start()
        processes.append(process)

    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(processes) if not p.is_alive() and r not in outcomes
                ]
                if dead:
                    # Give the queue a moment: a result may still be in flight.
                    with contextlib.suppress(queue.Empty):
                        rank, ok, payload = results.get(timeout=1.0)
                        outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
                        continue
                    for r in dead:
                        code = processes[r].exitcode
                        outcomes[r] = (False, ("ProcessDied", f"exited with code {code}", ""))
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        results.close()

    failures = {rank: payload for rank, (ok, payload) in outcomes.items() if not ok}
    for rank in range(world_size):
        if rank not in outcomes:
            failures[rank] = ("TimeoutError", f"did not finish within {timeout:g} s (killed)", "")
    if failures:
        raise MultiProcessError(failures)
    return [outcomes[rank][1] for rank in range(world_size)]
