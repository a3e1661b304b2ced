"""Process topology: this process's rank, the world size and the local layout.

The topology is read from whichever launcher started the process, in this order:

1. torchrun / torchelastic (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
   ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS`` say which attempt this is),
2. SLURM's ``srun`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
   ``SLURM_NNODES``, ``SLURM_JOB_NODELIST``; an ``sbatch`` script without ``srun`` is one
   process),
3. Open MPI (``OMPI_COMM_WORLD_*``), MVAPICH (``MV2_COMM_WORLD_*``) and PMI-based MPIs such as
   Intel MPI and MPICH (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``).

"Rank" is the index of a process among all processes of the run, "local rank" its index on
its node and "world size" the number of processes. Nothing here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping

__all__ = [
    "CPUInformation",
    "ProcessTopology",
    "SlurmStep",
    "check_os_kernel",
    "get_cpu_distributed_information",
    "get_free_port",
    "get_process_topology",
    "get_slurm_step",
    "is_port_in_use",
]

_DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class ProcessTopology:
    """Where this process sits in the run.

    Attributes:
        rank: Global index of this process.
        world_size: Number of processes in the run.
        local_rank: Index of this process on its node.
        local_world_size: Number of processes on this node.
        num_nodes: Number of nodes.
        master_addr: Address of rank 0's rendezvous, or ``None`` when single-process.
        master_port: Port of rank 0's rendezvous, or ``None`` when single-process.
        source: Which launcher's variables were read: ``torchrun``, ``slurm``, ``openmpi``,
            ``mvapich``, ``pmi`` or ``none``.
        restart_count: How many times torchelastic restarted this process's worker group
            before starting it (0 on the first attempt and outside torchelastic). It is counted
            per machine: on a multi-machine run the machines' counts can differ.
        max_restarts: How many restarts torchelastic allows this run (``--max_restarts``; 0
            outside torchelastic).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    source: str
    restart_count: int = 0
    max_restarts: int = 0

    @property
    def is_distributed(self) -> bool:
        """True when the run has more than one process."""
        return self.world_size > 1


@dataclasses.dataclass(frozen=True)
class CPUInformation:
    """Rank information in the shape Accelerate's ``get_cpu_distributed_information`` returns."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _int(environ: Mapping[str, str], key: str) -> int | None:
    raw = environ.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {key}={raw!r} is not an integer: the launcher that started "
            "this process set it wrongly, or it leaked from another job; unset it"
        ) from None


def _first_int(environ: Mapping[str, str], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = _int(environ, key)
        if value is not None:
            return value
    return None


def _first_host_of_nodelist(nodelist: str) -> str:
    """Return the first host of a SLURM node list such as ``node[03-05,9],gpu1``."""
    nodelist = nodelist.strip()
    match = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}: set MASTER_ADDR")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def _master(
    environ: Mapping[str, str], local_world_size: int, world_size: int, source: str
) -> tuple[str, int]:
    port = _int(environ, "MASTER_PORT")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        if local_world_size >= world_size:
            addr = "127.0.0.1"
        elif source == "slurm" and (
            environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        ):
            addr = _first_host_of_nodelist(
                environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
            )
        else:
            raise ValueError(
                f"this {source} run spans several nodes ({world_size} processes, "
                f"{local_world_size} on this node) but MASTER_ADDR is not set: export "
                "MASTER_ADDR=<address of the node running rank 0> on every node"
            )
    if port is None:
        port = _slurm_job_port(environ) if source == "slurm" else None
        if port is None:
            port = _DEFAULT_MASTER_PORT
    return addr, port


def _slurm_job_port(environ: Mapping[str, str]) -> int | None:
    """The rendezvous port every task of a SLURM job derives alike from the job id."""
    job_id = _int(environ, "SLURM_JOB_ID")
    return None if job_id is None else 10000 + job_id % 20000


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """What ``srun`` tells each task it starts about the job step.

    Attributes:
        num_tasks: Tasks of the step, on all nodes.
        num_nodes: Nodes of the step.
        task_rank: This task's index in the step (``SLURM_PROCID``).
        node_rank: This task's node's index in the step (``SLURM_NODEID``).
        local_rank: This task's index on its node (``SLURM_LOCALID``).
        master_addr: Where rank 0's rendezvous is: ``MASTER_ADDR`` when set, ``127.0.0.1`` on
            one node, else the first host of the step's node list.
        master_port: ``MASTER_PORT`` when set, else a port derived from ``SLURM_JOB_ID`` (the
            same in every task of the job), else 29500.
        sources: The variable each attribute was read from, by attribute name (``"one node"``
            or ``"default"`` where no variable was needed).
    """

    num_tasks: int
    num_nodes: int
    task_rank: int
    node_rank: int
    local_rank: int
    master_addr: str
    master_port: int
    sources: Mapping[str, str]

    @property
    def tasks_are_processes(self) -> bool:
        """True when srun started several tasks per node: each task is one process of the run.

        With one task per node, each task is rather a per-node launcher (``srun
        --ntasks-per-node 1 accel launch ...``) that starts the node's processes itself.
        """
        return self.num_tasks > self.num_nodes


def get_slurm_step(environ: Mapping[str, str] | None = None) -> SlurmStep | None:
    """Read the ``srun`` job step this process is a task of, or None outside ``srun``.

    Only ``srun`` sets the step variables (``SLURM_STEP_NUM_TASKS``), so a process run from an
    ``sbatch`` script or an ``salloc`` shell, where ``SLURM_NTASKS`` describes the whole
    allocation, is not mistaken for one task of a step.

    Args:
        environ: The environment to read (default: ``os.environ``).

    Raises:
        ValueError: a variable is not an integer, the task or node index lies outside the
            step, or a multi-node step has no node list and no ``MASTER_ADDR``.
    """
    env = os.environ if environ is None else environ
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    task_rank = _int(env, "SLURM_PROCID")
    if tasks is None or task_rank is None:
        return None
    sources = {"num_tasks": "SLURM_STEP_NUM_TASKS", "task_rank": "SLURM_PROCID"}
    nodes = None
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        nodes = _int(env, key)
        if nodes is not None:
            sources["num_nodes"] = key
            break
    if nodes is None:
        nodes, sources["num_nodes"] = 1, "default"
    node_rank = _int(env, "SLURM_NODEID")
    sources["node_rank"] = "SLURM_NODEID" if node_rank is not None else "default"
    local_rank = _int(env, "SLURM_LOCALID")
    sources["local_rank"] = "SLURM_LOCALID" if local_rank is not None else "default"
    node_rank = node_rank or 0
    local_rank = local_rank or 0
    if tasks < 1 or nodes < 1 or not 0 <= task_rank < tasks or not 0 <= node_rank < nodes:
        raise ValueError(
            f"SLURM_PROCID={task_rank} of SLURM_STEP_NUM_TASKS={tasks} and SLURM_NODEID="
            f"{node_rank} of {sources['num_nodes']}={nodes} are inconsistent: indexes must lie "
            "in [0, count); they come from srun, so unset them when not running under srun"
        )
    addr = env.get("MASTER_ADDR") or None
    if addr is not None:
        sources["master_addr"] = "MASTER_ADDR"
    elif nodes == 1:
        addr, sources["master_addr"] = "127.0.0.1", "one node"
    else:
        for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(key):
                addr, sources["master_addr"] = _first_host_of_nodelist(env[key]), key
                break
        if addr is None:
            raise ValueError(
                f"this srun step spans {nodes} nodes but neither MASTER_ADDR nor a SLURM node "
                "list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) is set: export "
                "MASTER_ADDR=<address of the first node>"
            )
    port = _int(env, "MASTER_PORT")
    if port is not None:
        sources["master_port"] = "MASTER_PORT"
    else:
        port = _slurm_job_port(env)
        sources["master_port"] = "SLURM_JOB_ID" if port is not None else "default"
        if port is None:
            port = _DEFAULT_MASTER_PORT
    return SlurmStep(tasks, nodes, task_rank, node_rank, local_rank, addr, port, sources)


def get_process_topology(environ: Mapping[str, str] | None = None) -> ProcessTopology:
    """Read the process topology from the launcher's environment variables.

    Args:
        environ: The environment to read (default: ``os.environ``).

    Raises:
        ValueError: a variable is malformed, the rank is outside the world, or a multi-node
            run lacks ``MASTER_ADDR``.
    """
    env = os.environ if environ is None else environ
    families: tuple[
        tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...
    ]
    families = (
        ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
        (
            "slurm",
            ("SLURM_PROCID",),
            # Only srun sets the step's task count: inside an sbatch script or an salloc shell
            # SLURM_NTASKS describes the allocation (and SLURM_PROCID is 0), so a plain
            # `python train.py` there is one process, not rank 0 of an allocation-wide group.
            ("SLURM_STEP_NUM_TASKS",),
            ("SLURM_LOCALID",),
            (),
        ),
        (
            "openmpi",
            ("OMPI_COMM_WORLD_RANK",),
            ("OMPI_COMM_WORLD_SIZE",),
            ("OMPI_COMM_WORLD_LOCAL_RANK",),
            ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        ),
        (
            "mvapich",
            ("MV2_COMM_WORLD_RANK",),
            ("MV2_COMM_WORLD_SIZE",),
            ("MV2_COMM_WORLD_LOCAL_RANK",),
            ("MV2_COMM_WORLD_LOCAL_SIZE",),
        ),
        ("pmi", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    )
    for source, rank_keys, world_keys, local_keys, local_world_keys in families:
        world_size = _first_int(env, world_keys)
        rank = _first_int(env, rank_keys)
        if world_size is None:
            # torchrun with a single process sets LOCAL_RANK but may be read before RANK.
            if source == "torchrun" and _int(env, "LOCAL_RANK") is not None:
                world_size, rank = 1, 0
            else:
                continue
        if rank is None:
            rank = 0 if world_size == 1 else None
        if rank is None:
            raise ValueError(
                f"{world_keys[0]}={world_size} is set but {rank_keys[0]} is not: both come from "
                f"the {source} launcher; start the process through it or unset {world_keys[0]}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"{rank_keys[0]}={rank} and {world_keys[0]}={world_size} are inconsistent: the "
                "rank must lie in [0, world size)"
            )
        local_rank = _first_int(env, local_keys)
        num_nodes = _slurm_num_nodes(env) if source == "slurm" else None
        local_world = _first_int(env, local_world_keys) if local_world_keys else None
        if local_world is None:
            if num_nodes:
                local_world = max(1, world_size // num_nodes)
            elif local_rank is None:
                local_world = world_size
            else:
                local_world = _int(env, "LOCAL_WORLD_SIZE") or world_size
        if local_rank is None:
            local_rank = rank % local_world
        if num_nodes is None:
            num_nodes = _int(env, "GROUP_WORLD_SIZE") or max(1, -(-world_size // local_world))
        restarts = _elastic_restarts(env) if source == "torchrun" else (0, 0)
        if world_size == 1:
            return ProcessTopology(0, 1, 0, 1, 1, None, None, source, *restarts)
        addr, port = _master(env, local_world, world_size, source)
        return ProcessTopology(
            rank, world_size, local_rank, local_world, num_nodes, addr, port, source, *restarts
        )
    return ProcessTopology(0, 1, 0, 1, 1, None, None, "none")


def _elastic_restarts(env: Mapping[str, str]) -> tuple[int, int]:
    """``(restart_count, max_restarts)`` from torchelastic's variables (0 when unset)."""
    count = _int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    allowed = _int(env, "TORCHELASTIC_MAX_RESTARTS") or 0
    if count < 0 or allowed < 0:
        raise ValueError(
            f"TORCHELASTIC_RESTART_COUNT={count} and TORCHELASTIC_MAX_RESTARTS={allowed} must "
            "not be negative: torchrun sets them; unset them when not running under torchrun"
        )
    return count, allowed


def _slurm_num_nodes(env: Mapping[str, str]) -> int | None:
    return _first_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))


def get_cpu_distributed_information() -> CPUInformation:
    """Return rank, world size, local rank and local world size read from the environment."""
    topo = get_process_topology()
    return CPUInformation(topo.rank, topo.world_size, topo.local_rank, topo.local_world_size)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``port`` (default ``29500``) on localhost."""
    port = _DEFAULT_MASTER_PORT if port is None else port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port)) == 0


def get_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a single-machine rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_os_kernel() -> None:
    """Log a warning on a Linux kernel older than 5.5, where processes can hang."""
    import logging
    import platform

    from packaging.version import InvalidVersion, parse

    info = platform.uname()
    if info.system != "Linux":
        return
    release = info.release.split("-", 1)[0]
    try:
        too_old = parse(release) < parse("5.5.0")
    except InvalidVersion:
        return
    if too_old:
        logging.getLogger(__name__).warning(
            f"Linux kernel {release} is older than 5.5.0, the minimum recommended: processes "
            "may hang; upgrade the kernel"
        )
