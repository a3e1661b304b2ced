"""Reading the process topology from each launcher's environment variables."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from accel_state import (
    DistributedType,
    PartialState,
    ProcessTopology,
    get_cpu_distributed_information,
    get_process_topology,
)
from accel_state.topology import _first_host_of_nodelist, get_slurm_step, is_port_in_use

TOPOLOGY_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_",
    "MASTER_",
    "GROUP_",
    "SLURM_",
    "OMPI_",
    "MV2_",
    "PMI_",
    "MPI_",
)


def test_no_launcher_means_a_single_process() -> None:
    topo = get_process_topology(environ={})
    assert topo == ProcessTopology(0, 1, 0, 1, 1, None, None, "none")
    assert topo.is_distributed is False


def test_unrelated_variables_are_ignored() -> None:
    topo = get_process_topology(environ={"HOME": "/root", "NODE_RANK": "3", "RANK": "1"})
    assert (topo.rank, topo.world_size, topo.source) == (0, 1, "none")


def test_topology_is_frozen() -> None:
    topo = get_process_topology(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.rank = 1  # type: ignore[misc]


def test_torchrun_single_node() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(1, 2, 1, 2, 1, "127.0.0.1", 29500, "torchrun")
    assert topo.is_distributed


def test_torchrun_multi_node_reads_master_and_group_size() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(3, 4, 1, 2, 2, "10.0.0.1", 1234, "torchrun")


def test_torchrun_with_only_local_rank_is_single_process() -> None:
    topo = get_process_topology(environ={"LOCAL_RANK": "0"})
    assert topo == ProcessTopology(0, 1, 0, 1, 1, None, None, "torchrun")


def test_torchrun_wins_over_slurm_when_both_are_set() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
    }
    topo = get_process_topology(environ=env)
    assert (topo.source, topo.rank, topo.world_size) == ("torchrun", 1, 2)


def test_slurm_single_node() -> None:
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "1",
    }
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(1, 2, 1, 2, 1, "127.0.0.1", 29500, "slurm")


def test_sbatch_script_without_srun_is_one_process() -> None:
    # What an sbatch script with --ntasks=4 sees (no srun step): the allocation's task count
    # must not make a plain `python train.py` wait for 3 peers that never start.
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    topo = get_process_topology(environ=env)
    assert (topo.world_size, topo.rank, topo.source) == (1, 0, "none")


def test_slurm_step_num_tasks_takes_precedence_over_ntasks() -> None:
    env = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_LOCALID": "2",
        "SLURM_NNODES": "1",
    }
    topo = get_process_topology(environ=env)
    assert topo.world_size == 3
    assert topo.rank == 2


def test_slurm_step_num_tasks_bounds_the_rank() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "3"}
    with pytest.raises(ValueError, match="SLURM_PROCID=5"):
        get_process_topology(environ=env)


def _slurm_two_nodes(rank: int, local_rank: int, job_id: str = "123456") -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "6",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": str(local_rank),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[03-05,9]",
        "SLURM_JOB_ID": job_id,
    }


def test_slurm_multi_node_master_from_nodelist_and_port_from_job_id() -> None:
    topo = get_process_topology(environ=_slurm_two_nodes(rank=4, local_rank=1))
    assert topo.rank == 4
    assert topo.world_size == 6
    assert topo.local_rank == 1
    assert topo.local_world_size == 3
    assert topo.num_nodes == 2
    assert topo.master_addr == "node03"
    assert topo.master_port == 10000 + 123456 % 20000
    assert topo.source == "slurm"


def test_slurm_every_rank_derives_the_same_master() -> None:
    masters = {
        (topo.master_addr, topo.master_port)
        for rank in range(6)
        for topo in [get_process_topology(environ=_slurm_two_nodes(rank, rank % 3))]
    }
    assert masters == {("node03", 13456)}
    other_job = get_process_topology(environ=_slurm_two_nodes(0, 0, job_id="20001"))
    assert other_job.master_port == 10001


def test_slurm_explicit_master_wins_over_nodelist_and_job_id() -> None:
    env = {**_slurm_two_nodes(0, 0), "MASTER_ADDR": "head", "MASTER_PORT": "4321"}
    topo = get_process_topology(environ=env)
    assert (topo.master_addr, topo.master_port) == ("head", 4321)


def test_slurm_multi_node_uses_slurm_nodelist_fallback() -> None:
    env = _slurm_two_nodes(0, 0)
    env["SLURM_NODELIST"] = env.pop("SLURM_JOB_NODELIST")
    assert get_process_topology(environ=env).master_addr == "node03"


def test_slurm_multi_node_without_nodelist_or_master_addr() -> None:
    env = _slurm_two_nodes(0, 0)
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        get_process_topology(environ=env)


def _srun(tasks: int, nodes: int, task: int, node: int) -> dict[str, str]:
    nodelist = "cn[07-08]" if nodes > 1 else "cn07"
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task % (tasks // nodes)),
        "SLURM_NODEID": str(node),
    }


def test_slurm_step_of_one_node_with_two_tasks() -> None:
    step = get_slurm_step(_srun(tasks=2, nodes=1, task=1, node=0))
    assert step is not None
    assert (step.num_tasks, step.num_nodes, step.task_rank, step.node_rank) == (2, 1, 1, 0)
    assert (step.local_rank, step.master_addr, step.master_port) == (1, "127.0.0.1", 14242)
    assert step.tasks_are_processes
    assert step.sources["num_tasks"] == "SLURM_STEP_NUM_TASKS"
    assert step.sources["master_port"] == "SLURM_JOB_ID"
    # The topology of the same task agrees with what the launcher reads.
    topo = get_process_topology(environ=_srun(tasks=2, nodes=1, task=1, node=0))
    assert (topo.rank, topo.world_size, topo.master_port, topo.source) == (1, 2, 14242, "slurm")


def test_slurm_step_with_one_task_per_node() -> None:
    step = get_slurm_step(_srun(tasks=2, nodes=2, task=1, node=1))
    assert step is not None and not step.tasks_are_processes
    assert (step.master_addr, step.sources["master_addr"]) == ("cn07", "SLURM_STEP_NODELIST")


def test_no_slurm_step_outside_srun() -> None:
    assert get_slurm_step({}) is None
    batch = {k: v for k, v in _srun(8, 1, 0, 0).items() if "STEP" not in k}
    assert get_slurm_step(batch) is None  # an sbatch script or salloc shell


def test_slurm_step_errors_name_the_variables() -> None:
    with pytest.raises(ValueError, match="SLURM_PROCID=3 of SLURM_STEP_NUM_TASKS=2"):
        get_slurm_step(_srun(tasks=2, nodes=1, task=3, node=0))
    env = _srun(tasks=4, nodes=2, task=0, node=0)
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        del env[key]
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        get_slurm_step(env)


def test_partial_state_in_a_one_task_srun_step(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(TOPOLOGY_PREFIXES)]:
        monkeypatch.delenv(key)
    for key, value in _srun(tasks=1, nodes=1, task=0, node=0).items():
        monkeypatch.setenv(key, value)
    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.distributed_type == DistributedType.NO
    assert state.topology.source == "slurm"


def test_openmpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "host0",
    }
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(2, 4, 0, 2, 2, "host0", 29500, "openmpi")


def test_mvapich() -> None:
    env = {
        "MV2_COMM_WORLD_RANK": "1",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
    }
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(1, 2, 1, 2, 1, "127.0.0.1", 29500, "mvapich")


def test_pmi() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    topo = get_process_topology(environ=env)
    assert topo == ProcessTopology(1, 3, 1, 3, 1, "127.0.0.1", 29500, "pmi")


def test_pmi_without_local_variables_assumes_one_node() -> None:
    topo = get_process_topology(environ={"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (topo.local_rank, topo.local_world_size, topo.num_nodes) == (2, 3, 1)


def test_multi_node_mpi_without_master_addr_is_refused() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(ValueError, match="MASTER_ADDR") as info:
        get_process_topology(environ=env)
    assert "openmpi" in str(info.value)


@pytest.mark.parametrize(
    ("rank", "world"),
    [("2", "2"), ("5", "2"), ("-1", "2"), ("0", "0")],
)
def test_rank_outside_the_world_is_refused(rank: str, world: str) -> None:
    with pytest.raises(ValueError, match="inconsistent") as info:
        get_process_topology(environ={"RANK": rank, "WORLD_SIZE": world})
    assert f"RANK={rank}" in str(info.value)
    assert f"WORLD_SIZE={world}" in str(info.value)


def test_world_size_without_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK"):
        get_process_topology(environ={"OMPI_COMM_WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "one", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "2.0"},
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x"},
        {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "zero"},
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"},
    ],
)
def test_non_integer_names_the_variable(env: dict[str, str]) -> None:
    bad_key, bad_value = next((k, v) for k, v in env.items() if not v.lstrip("-").isdigit())
    with pytest.raises(ValueError, match="not an integer") as info:
        get_process_topology(environ=env)
    assert f"{bad_key}={bad_value!r}" in str(info.value)


def test_blank_variables_count_as_unset() -> None:
    topo = get_process_topology(
        environ={"RANK": "", "WORLD_SIZE": " ", "PMI_RANK": "0", "PMI_SIZE": "1"}
    )
    assert topo.source == "pmi"
    assert topo.world_size == 1


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[03-05,9]", "node03"),
        ("node[9,03-05]", "node9"),
        ("gpu1", "gpu1"),
        ("gpu1,gpu2", "gpu1"),
        ("node[1-2],gpu[3]", "node1"),
        ("a-b-c[010-012]", "a-b-c010"),
        ("  host.example.org  ", "host.example.org"),
    ],
)
def test_first_host_of_nodelist(nodelist: str, first: str) -> None:
    assert _first_host_of_nodelist(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "[1-2]", ",node1"])
def test_unreadable_nodelist_asks_for_master_addr(nodelist: str) -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _first_host_of_nodelist(nodelist)


def test_get_process_topology_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith(TOPOLOGY_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert get_process_topology().rank == 1
    info = get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 2, 1, 2)


def test_is_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert is_port_in_use(port) is True
    assert is_port_in_use(port) is False
