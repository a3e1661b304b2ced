"""Process topology: this process's rank, the world size and the local layout.

The topology is read from whichever launcher started the process, in this order:

1. torchrun / torchelastic (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``),
2. SLURM's ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``/``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``, ``SLURM_NNODES``, ``SLURM_JOB_NODELIST``),
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
    "get_cpu_distributed_information",
    "get_process_topology",
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
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    source: str

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
        job_id = _int(environ, "SLURM_JOB_ID") if source == "slurm" else None
        # Every rank of a SLURM job derives the same port from the job id.
        port = 10000 + job_id % 20000 if job_id is not None else _DEFAULT_MASTER_PORT
    return addr, port


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
            ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
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
        if world_size == 1:
            return ProcessTopology(0, 1, 0, 1, 1, None, None, source)
        addr, port = _master(env, local_world, world_size, source)
        return ProcessTopology(
            rank, world_size, local_rank, local_world, num_nodes, addr, port, source
        )
    return ProcessTopology(0, 1, 0, 1, 1, None, None, "none")


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
