"""Start a training function on several processes from Python: notebooks and debugging.

``notebook_launcher(fn, args, num_processes=n)`` runs ``fn(*args)`` on ``n`` processes through
``torch.distributed.elastic`` (the engine behind torchrun), forked from the notebook's kernel
by default so that functions defined in a cell work. ``debug_launcher(fn, args)`` forks ``n``
CPU-only processes that join a gloo group on 127.0.0.1, for tests and for trying distributed
code on a laptop. ``PrepareForLaunch`` is the picklable wrapper that gives each forked child
its rank before calling the function.

Inside the launched function, ``PartialState()`` (or an ``Accelerator``) joins the process
group from the usual ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` variables.

Forking has two traps that these launchers guard against instead of letting the children hang
or crash:

* CUDA cannot be re-initialised in a forked child. ``notebook_launcher`` refuses to fork when
  CUDA is already initialised in the parent and names the line that initialised it (recorded
  when ``accel_launch`` was imported first), with the fix.
* OpenMP's thread pool does not survive ``fork``: a child whose parent already ran a
  multi-threaded CPU operation deadlocks in its first parallel operation. Forked children
  therefore run with one intra-op thread (``OMP_NUM_THREADS=1``, torchrun's default too); use
  ``start_method="spawn"`` with a module-level function for multi-threaded CPU workers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from accel_state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    PartialState,
    PrecisionType,
    is_cuda_available,
    is_mps_available,
    patch_environment,
)
from accel_state.environment import ACCEL_MIXED_PRECISION, ACCEL_USE_CPU, FORK_LAUNCHED
from accel_state.files import atomic_write
from accel_state.topology import get_free_port

__all__ = ["PrepareForLaunch", "debug_launcher", "notebook_launcher"]

StartMethod = Literal["fork", "spawn", "forkserver"]
_START_METHODS: tuple[str, ...] = ("fork", "spawn", "forkserver")

#: Variables of an enclosing torchrun that would send a debug child to the wrong rendezvous.
_ENCLOSING_LAUNCHER_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")

# --------------------------------------------------------------------------------------------
# Fork bookkeeping
# --------------------------------------------------------------------------------------------

_fork_state = {"forked": False}


def _mark_forked() -> None:
    _fork_state["forked"] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


def _in_forked_child() -> bool:
    """Whether this process was made by ``fork`` from a process that had imported this module."""
    return _fork_state["forked"]


def _prepare_forked_child() -> None:
    """Make a freshly forked child safe to run torch code in.

    The parent's OpenMP thread pool is not copied by ``fork``: asking for more than one
    intra-op thread in the child then waits forever on threads that do not exist. One thread
    avoids that (and is torchrun's default); ``OMP_NUM_THREADS`` tells ``PartialState`` to keep
    it. Singletons copied from the parent describe the parent, not this child: forget them.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# --------------------------------------------------------------------------------------------
# Who initialised CUDA
# --------------------------------------------------------------------------------------------

#: Where CUDA was first initialised in this process, once the tracker has seen it.
_cuda_init_site: list[str] = []


def _describe_caller(skip_dirs: tuple[str, ...]) -> str:
    """Describe the innermost stack frame that lies outside ``skip_dirs`` and this file."""
    frames = traceback.extract_stack()[:-1]
    here = os.path.abspath(__file__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path == here or any(path.startswith(directory) for directory in skip_dirs):
            continue
        code = f": {frame.line.strip()}" if frame.line else ""
        return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"
    last = frames[-1] if frames else None
    return f"{last.filename}:{last.lineno} in {last.name}" if last else "an unknown caller"


def _install_cuda_init_tracker(cuda: Any = None) -> bool:
    """Wrap ``torch.cuda._lazy_init`` so that the first CUDA initialisation records its caller.

    Every path that initialises CUDA (``tensor.cuda()``, ``model.to("cuda")``,
    ``torch.cuda.*`` queries) goes through ``torch.cuda._lazy_init``; the wrapper only notes
    the first caller outside torch and then calls the original. Nothing is installed on a
    build without CUDA or when CUDA is already initialised.

    Args:
        cuda: The module to patch (default ``torch.cuda``; tests pass a stand-in).

    Returns:
        Whether the tracker is installed now.
    """
    cuda = torch.cuda if cuda is None else cuda
    original = getattr(cuda, "_lazy_init", None)
    if original is None:
        return False
    if getattr(original, "_accel_tracker", False):
        return True
    is_compiled = getattr(cuda, "_is_compiled", None)
    if is_compiled is not None and not is_compiled():
        return False
    if cuda.is_initialized():
        return False
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

    @functools.wraps(original)
    def _tracked_lazy_init(*args: Any, **kwargs: Any) -> Any:
        if not _cuda_init_site:
            with contextlib.suppress(Exception):
                if not cuda.is_initialized():
                    _cuda_init_site.append(_describe_caller((torch_dir,)))
        return original(*args, **kwargs)

    _tracked_lazy_init._accel_tracker = True  # type: ignore[attr-defined]
    cuda._lazy_init = _tracked_lazy_init
    return True


with contextlib.suppress(Exception):
    _install_cuda_init_tracker()


def _cuda_initialised_message() -> str:
    """Explain why a fork launch cannot follow CUDA initialisation, and what to do."""
    if _cuda_init_site:
        culprit = f"CUDA was first initialised at {_cuda_init_site[0]}."
    else:
        suspects = [name for name in ("bitsandbytes",) if name in sys.modules]
        culprit = (
            "CUDA was initialised before accel_launch was imported, so the line that did it "
            "is unknown"
            + (f" (loaded modules known to do so: {', '.join(suspects)})" if suspects else "")
            + "; typical causes are a cell that moved a tensor or model to 'cuda', called "
            "torch.cuda.* (current_device, get_device_name, mem_get_info, ...) or created an "
            "Accelerator."
        )
    return (
        "notebook_launcher cannot fork worker processes: CUDA is already initialised in this "
        "process (torch.cuda.is_initialized() is True), and a forked process cannot "
        f"re-initialise CUDA ('Cannot re-initialize CUDA in forked subprocess'). {culprit} "
        "Fix: restart the kernel and keep every CUDA operation (model.to('cuda'), tensors on "
        "the GPU, torch.cuda calls, Accelerator()) inside the launched function; or pass "
        "start_method='spawn' with a function defined in an importable .py module."
    )


# --------------------------------------------------------------------------------------------
# PrepareForLaunch
# --------------------------------------------------------------------------------------------


def _int_from_environ(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer: set it to a whole number or "
            "unset it"
        ) from None


class PrepareForLaunch:
    """Picklable wrapper that turns process ``index`` of a launch into a rank, then runs a function.

    Launchers built on ``torch.multiprocessing.start_processes`` call their target as
    ``target(index, *args)``. This wrapper sets the variables ``PartialState`` reads and calls
    ``launcher(*args)``:

    * ``debug=True`` (used by :func:`debug_launcher`): ``RANK`` and ``LOCAL_RANK`` are
      ``index`` and ``LOCAL_WORLD_SIZE`` is ``WORLD_SIZE`` (one machine), so ``PartialState()``
      joins the group at ``MASTER_ADDR:MASTER_PORT`` that the parent chose.
    * otherwise, for the ``MULTI_*`` distributed types, ``LOCAL_RANK`` is ``index`` and ``RANK``
      is ``NPROC * NODE_RANK + index`` (both read from the environment, defaults 1 and 0); other
      types get no rank variables.

    ``FORK_LAUNCHED=1`` is set in every case, which tells ``PartialState.destroy_process_group``
    to leave the group to the launcher: the wrapper destroys a group created during the call
    when the call ends. In a child made by ``fork``, the singletons copied from the parent are
    reset and the child uses one intra-op CPU thread (the parent's OpenMP pool does not survive
    ``fork``).

    Args:
        launcher: The function to run in each process.
        distributed_type: A :class:`~accel_state.DistributedType` (or its name).
        debug: Set up the single-machine debug rendezvous described above.

    Raises:
        ValueError: ``distributed_type`` is not a distributed type.
    """

    def __init__(
        self,
        launcher: Callable[..., Any],
        distributed_type: DistributedType | str = "NO",
        debug: bool = False,
    ) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(str(distributed_type))
        self.debug = debug
        # Set by debug_launcher: where a failing child notes when it failed.
        self._failure_dir: str | None = None

    def __call__(self, index: int, *args: Any) -> Any:
        """Set the rank variables of process ``index`` and return ``launcher(*args)``."""
        if _in_forked_child():
            _prepare_forked_child()
        if self.debug:
            for name in _ENCLOSING_LAUNCHER_VARIABLES:
                os.environ.pop(name, None)
            world_size = os.environ.get("WORLD_SIZE", "1")
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(index)
            os.environ["LOCAL_WORLD_SIZE"] = world_size
        elif self.distributed_type.value.startswith("MULTI_"):
            nproc = _int_from_environ("NPROC", 1)
            node_rank = _int_from_environ("NODE_RANK", 0)
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(nproc * node_rank + index)
        os.environ[FORK_LAUNCHED] = "1"
        with _destroy_group_created_inside(), _noting_failure(self._failure_dir):
            return self.launcher(*args)

    def __repr__(self) -> str:
        name = getattr(self.launcher, "__qualname__", repr(self.launcher))
        return (
            f"PrepareForLaunch({name}, distributed_type={self.distributed_type.value!r}, "
            f"debug={self.debug})"
        )


@contextlib.contextmanager
def _destroy_group_created_inside() -> Iterator[None]:
    """Destroy the default process group on exit if the block created it."""
    existed = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not existed and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class _ElasticWorker:
    """Entrypoint given to ``elastic_launch``: prepares the worker, then runs the function.

    torch.distributed.elastic records an exception in the worker's error file itself, so the
    parent's ``ChildFailedError`` shows it next to the rank; the wrapper also notes the time of
    the failure, so that the parent can tell which rank failed first.
    """

    def __init__(self, function: Callable[..., Any], failure_dir: str | None = None) -> None:
        self.function = function
        self.failure_dir = failure_dir
        # torch.distributed.elastic names the run and its events after the entrypoint.
        self.__name__ = getattr(function, "__name__", type(function).__name__)
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        if _in_forked_child():
            _prepare_forked_child()
            os.environ[FORK_LAUNCHED] = "1"
        with _destroy_group_created_inside(), _noting_failure(self.failure_dir):
            return self.function(*args)


# --------------------------------------------------------------------------------------------
# Which rank failed first
# --------------------------------------------------------------------------------------------
#
# When one rank raises, its peers usually fail a moment later in a collective ("connection
# closed by peer"). torch reports whichever failed process it notices first, which may be such
# a peer. Each worker therefore notes the time of its failure in a directory the parent made;
# the parent then reports the rank that failed first.


@contextlib.contextmanager
def _noting_failure(directory: str | None) -> Iterator[None]:
    """Note an exception leaving the block in ``directory`` (rank, pid, time, traceback)."""
    try:
        yield
    except Exception as err:
        if directory:
            with contextlib.suppress(Exception):
                _write_failure_note(directory, err)
        raise


def _write_failure_note(directory: str, err: BaseException) -> None:
    rank = _int_from_environ("RANK", -1)
    note = {
        "rank": rank,
        "local_rank": _int_from_environ("LOCAL_RANK", rank),
        "pid": os.getpid(),
        "time": time.time(),
        "error": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
        "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", ""),
    }
    # Atomic, so that the launcher never reads half a note; the temporary file's name ends
    # in ``.tmp``, which _read_failure_notes skips.
    atomic_write(os.path.join(directory, f"{rank}.json"), json.dumps(note))


def _read_failure_notes(directory: str) -> list[dict[str, Any]]:
    """Return the failure notes in ``directory``, earliest first."""
    notes = []
    for name in os.listdir(directory):
        if not name.endswith(".json"):
            continue
        with contextlib.suppress(Exception):
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                notes.append(json.load(handle))
    return sorted(notes, key=lambda note: float(note.get("time", 0.0)))


def _first_debug_failure(err: Exception, directory: str) -> Exception | None:
    """A ``ProcessRaisedException`` for the rank that failed first, if torch named another."""
    from torch.multiprocessing import ProcessRaisedException

    notes = _read_failure_notes(directory)
    if not notes or not isinstance(err, ProcessRaisedException):
        return None
    first = notes[0]
    if first.get("rank") == err.error_index:
        return None
    others = sorted({int(note["rank"]) for note in notes[1:]} | {err.error_index})
    return ProcessRaisedException(
        f"\n\n-- Process {first['rank']} terminated first, with the following error (process(es) "
        f"{', '.join(map(str, others))} failed after it, probably as a consequence):\n"
        f"{first['error']}",
        int(first["rank"]),
        int(first["pid"]),
    )


def _with_every_failure(err: Exception, directory: str) -> Exception | None:
    """A ``ChildFailedError`` listing every rank that noted a failure, the earliest first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    if not isinstance(err, ChildFailedError):
        return None
    notes = _read_failure_notes(directory)
    failures: dict[int, ProcessFailure] = {}
    for note in notes:
        rank = int(note["rank"])
        if rank in err.failures:
            failures[rank] = err.failures[rank]
        elif note.get("error_file") and os.path.isfile(note["error_file"]):
            # An unreadable error file only costs this rank its place in the report.
            with contextlib.suppress(Exception):
                failures[rank] = ProcessFailure(
                    local_rank=int(note["local_rank"]),
                    pid=int(note["pid"]),
                    exitcode=1,
                    error_file=str(note["error_file"]),
                )
    for rank, failure in err.failures.items():
        failures.setdefault(rank, failure)
    if list(failures) == list(err.failures):
        return None
    return ChildFailedError(err.name, failures)


# --------------------------------------------------------------------------------------------
# Checks shared by the launchers
# --------------------------------------------------------------------------------------------


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: pass an integer of at least {minimum}")
    return value


def _check_no_process_group(launcher: str) -> None:
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{launcher} cannot fork worker processes while this process is a member of a "
            "torch.distributed process group (the children would inherit a connection that is "
            "not theirs): call torch.distributed.destroy_process_group() first, or launch from a "
            "process that has not joined a group"
        )


class _TensorSkippingPickler(pickle.Pickler):
    """Pickler that leaves tensors out, to test picklability without copying their data."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return id(obj)
        return None


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


def _check_picklable(function: Callable[..., Any], args: tuple[Any, ...], method: str) -> None:
    """Refuse, before any process starts, a function or argument ``method`` cannot send."""
    module_name = getattr(function, "__module__", None)
    main = sys.modules.get("__main__")
    if module_name == "__main__" and main is not None and not hasattr(main, "__file__"):
        raise TypeError(
            f"start_method={method!r} needs a function the worker processes can import, but "
            f"{getattr(function, '__qualname__', function)!r} is defined interactively (in a "
            "notebook cell or the REPL): move it to a .py module and import it, or use "
            "start_method='fork'"
        )
    try:
        _TensorSkippingPickler(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL).dump(function)
    except Exception as err:
        raise TypeError(
            f"start_method={method!r} pickles the function for each worker, and "
            f"{getattr(function, '__qualname__', function)!r} cannot be pickled ({err}): lambdas, "
            "closures and functions defined inside other functions only work with "
            "start_method='fork'; otherwise define the function at the top level of a module"
        ) from err
    for position, value in enumerate(args):
        try:
            _TensorSkippingPickler(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as err:
            raise TypeError(
                f"start_method={method!r} pickles the arguments for each worker, and args"
                f"[{position}] of type {type(value).__name__} cannot be pickled ({err}): pass "
                "picklable arguments or use start_method='fork'"
            ) from err


def _check_mixed_precision(mixed_precision: Any) -> str:
    text = str(mixed_precision).lower()
    if text not in PrecisionType.list():
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported: choose one of "
            f"{', '.join(PrecisionType.list())}"
        )
    return text


def _state_initialised() -> bool:
    return bool(AcceleratorState._shared_state) or bool(PartialState._shared_state)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def notebook_launcher(  # noqa: PLR0913 - Accelerate's signature
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    start_method: StartMethod = "fork",
) -> None:
    """Run a training function on several processes from a notebook (or any Python session).

    With ``num_processes`` ``None`` or 1 the function is simply called here. With more, the
    processes are started by ``torch.distributed.elastic`` (as torchrun would) and each runs
    ``function(*args)`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set, plus ``ACCEL_MIXED_PRECISION`` and, on a machine without CUDA,
    ``ACCEL_USE_CPU=1``; an ``Accelerator`` or ``PartialState`` created inside the function
    joins the group (gloo on CPU, nccl on GPU). The call returns when every process has
    finished. Create the ``Accelerator`` inside the function, never before the launch.

    Args:
        function: The training function. With ``start_method="fork"`` (default) it may be
            defined in a notebook cell, be a lambda or a closure.
        args: Arguments passed to the function in every process.
        num_processes: Processes on this machine (``nproc_per_node``).
        mixed_precision: ``no``, ``fp16``, ``bf16`` or ``fp8``, exported as
            ``ACCEL_MIXED_PRECISION``.
        use_port: Port of the rendezvous on ``master_addr``; ``"0"`` picks a free port
            (single machine only).
        master_addr: Address of the machine of node rank 0.
        node_rank: Rank of this machine among ``num_nodes``.
        num_nodes: Number of machines taking part.
        rdzv_backend: ``static`` (default) or ``c10d``, as for torchrun.
        rdzv_endpoint: ``host:port`` of the rendezvous; default ``master_addr:use_port``.
        rdzv_conf: Extra rendezvous settings (``static`` also gets ``rank=node_rank``).
        rdzv_id: Run id shared by the machines of one run.
        max_restarts: How many times the group is restarted after a failure.
        monitor_interval: Seconds between checks of the workers' health.
        log_line_prefix_template: Prefix of the workers' log lines (e.g. ``"[${rank}]:"``).
        start_method: ``fork`` (default), or ``spawn`` / ``forkserver`` (accel extension),
            which start fresh interpreters: CUDA may then be initialised in the notebook, but
            the function and arguments must be picklable (a function of an importable module).

    Raises:
        ValueError: an argument is invalid (``mixed_precision``, ``num_processes``,
            ``start_method``, ``node_rank``, ...), or an ``Accelerator`` / ``PartialState``
            already exists in this process (restart the kernel and create it inside
            ``function``).
        RuntimeError: with ``fork``, CUDA is already initialised or this process is in a
            process group; the message names what initialised CUDA where known.
        TypeError: with ``spawn`` / ``forkserver``, the function or an argument cannot be
            pickled.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed;
            the message names its rank and shows its exception.
    """
    mixed_precision = _check_mixed_precision(mixed_precision)
    _check_start_method(start_method)
    args = tuple(args)
    if num_processes is None or num_processes == 1:
        _run_in_process(function, args, mixed_precision)
        return
    num_processes = _check_count("num_processes", num_processes)
    num_nodes = _check_count("num_nodes", num_nodes)
    _check_node_rank(node_rank, num_nodes)
    port = _rendezvous_port(use_port, num_nodes=num_nodes, rdzv_endpoint=rdzv_endpoint)
    _check_can_start(function, args, start_method)

    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_configs["rank"] = node_rank
    use_gpu = is_cuda_available()
    environment: dict[str, Any] = {
        "NPROC": num_processes,
        "NODE_RANK": node_rank,
        "WORLD_SIZE": num_nodes * num_processes,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": port,
        ACCEL_MIXED_PRECISION: mixed_precision,
    }
    if not use_gpu:
        environment[ACCEL_USE_CPU] = "1"
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=rdzv_id,
        rdzv_endpoint=rdzv_endpoint or f"{master_addr}:{port}",
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        log_line_prefix_template=log_line_prefix_template,
    )
    where = "GPUs" if use_gpu else "CPU processes"
    nodes = f" on each of {num_nodes} machines" if num_nodes > 1 else ""
    print(f"Launching training on {num_processes} {where}{nodes} ({start_method}).")
    with patch_environment(**environment):
        _elastic_run(config, function, args)


def _check_start_method(start_method: str) -> None:
    if start_method not in _START_METHODS:
        raise ValueError(
            f"start_method={start_method!r} is not supported: choose one of "
            f"{', '.join(_START_METHODS)}"
        )


def _check_node_rank(node_rank: int, num_nodes: int) -> None:
    if isinstance(node_rank, bool) or not isinstance(node_rank, int):
        raise ValueError(f"node_rank={node_rank!r} is invalid: pass an integer")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"node_rank={node_rank!r} is outside [0, num_nodes={num_nodes}): number the machines "
            "0, 1, ..., num_nodes - 1"
        )


def _rendezvous_port(use_port: str, *, num_nodes: int, rdzv_endpoint: str) -> str:
    """``use_port`` checked, with ``"0"`` replaced by a free port of this machine."""
    port = str(use_port).strip()
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"use_port={use_port!r} is not a TCP port: pass a number like '29500'")
    if port == "0":
        if num_nodes > 1 and not rdzv_endpoint:
            raise ValueError(
                "use_port='0' (pick a free port) only works on one machine: with num_nodes="
                f"{num_nodes} every machine must be given the same port"
            )
        port = str(get_free_port())
    return port


def _check_can_start(
    function: Callable[..., Any], args: tuple[Any, ...], start_method: StartMethod
) -> None:
    """Raise unless workers can be started from this process with ``start_method``."""
    if _state_initialised():
        raise ValueError(
            "An Accelerator or PartialState already exists in this process, so notebook_launcher "
            "cannot start worker processes: the state must be created only inside the launched "
            "function. Restart the kernel and make sure no cell creates an Accelerator, "
            "PartialState or AcceleratorState before calling notebook_launcher."
        )
    if start_method == "fork":
        if torch.cuda.is_initialized():
            raise RuntimeError(_cuda_initialised_message())
        _check_no_process_group("notebook_launcher")
    else:
        _check_picklable(function, args, start_method)


def _elastic_run(config: Any, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run ``function(*args)`` in the workers of ``config``; a failure names every failed rank."""
    from torch.distributed.launcher.api import elastic_launch

    failure_dir = tempfile.mkdtemp(prefix="accel-notebook-launch-")
    try:
        try:
            elastic_launch(config, _ElasticWorker(function, failure_dir))(*args)
        except Exception as err:
            clearer = _with_every_failure(err, failure_dir)
            if clearer is None:
                raise
            raise clearer from err
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)


def _run_in_process(function: Callable[..., Any], args: tuple[Any, ...], precision: str) -> None:
    """Call ``function(*args)`` here, as a one-process launch does."""
    if is_mps_available():
        os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] = "1"
        print("Launching training on MPS.")
    elif is_cuda_available():
        print("Launching training on one GPU.")
    else:
        print("Launching training on CPU.")
    with patch_environment(**{ACCEL_MIXED_PRECISION: precision}):
        function(*args)


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> None:
    """Run a function on several CPU processes of this machine, to test distributed code.

    The processes are forked (so lambdas, closures and notebook functions work) with
    ``torch.multiprocessing.start_processes``. Each gets ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT``, with ``ACCEL_USE_CPU=1``, ``ACCEL_MIXED_PRECISION=no`` and
    ``GLOO_SOCKET_IFNAME=lo`` (unless set), so that ``PartialState()`` or an ``Accelerator``
    inside the function comes up as ``MULTI_CPU`` over gloo. The environment is restored when
    the call returns. Children use one intra-op thread each. Not meant for real training.

    Args:
        function: The function to run in every process.
        args: Arguments passed to the function (``function(*args)``).
        num_processes: How many processes to start.

    Raises:
        ValueError: ``num_processes`` is not an integer of at least 1.
        RuntimeError: this process is itself a member of a process group.
        torch.multiprocessing.ProcessRaisedException: a child raised; the message starts with
            ``Process <rank> terminated with the following error`` and shows its traceback.
        torch.multiprocessing.ProcessExitedException: a child died (for example killed).
    """
    num_processes = _check_count("num_processes", num_processes)
    _check_no_process_group("debug_launcher")
    from torch.multiprocessing import start_processes

    environment: dict[str, Any] = {
        "WORLD_SIZE": num_processes,
        "LOCAL_WORLD_SIZE": num_processes,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": get_free_port(),
        ACCEL_USE_CPU: "1",
        ACCEL_MIXED_PRECISION: "no",
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        environment["GLOO_SOCKET_IFNAME"] = "lo"
    failure_dir = tempfile.mkdtemp(prefix="accel-debug-launch-")
    try:
        with patch_environment(**environment):
            launcher = PrepareForLaunch(function, debug=True)
            launcher._failure_dir = failure_dir
            try:
                start_processes(
                    launcher, args=tuple(args), nprocs=num_processes, join=True, start_method="fork"
                )
            except Exception as err:
                clearer = _first_debug_failure(err, failure_dir)
                if clearer is None:
                    raise
                raise clearer from err
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
