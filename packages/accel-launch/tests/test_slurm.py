"""``accel launch`` under ``srun``: the job step's variables, as srun sets them, are resolved.

srun is faked by its environment variables; nothing here starts a process (``--dry_run`` and
``plan_launch``). tests-integration/test_launch.py runs two faked srun tasks for real.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from accel_launch import settings as settings_module
from accel_launch.cli import build_parser, main
from accel_launch.config import ClusterConfig
from accel_launch.launch import plan_launch
from accel_launch.settings import resolve_launch_settings


def srun_env(
    tasks: int, nodes: int, task: int, node: int, local: int, job_id: int = 4242
) -> dict[str, str]:
    """What srun exports to one of its tasks (the variables accel reads, and some others)."""
    nodelist = "cn[07-08]" if nodes > 1 else "cn07"
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_NTASKS": str(tasks),
        "SLURM_NPROCS": str(tasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks // nodes}(x{nodes})",
        "SLURM_TASKS_PER_NODE": f"{tasks // nodes}(x{nodes})",
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": f"cn0{7 + node}",
    }


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(settings_module, "_physical_cores", lambda: 8)


def _resolve(environ: dict[str, str], config: ClusterConfig | None = None) -> dict[str, object]:
    settings = resolve_launch_settings({"use_cpu": True}, environ, config, "cfg.yaml", 0)
    return {key: (item.value, item.source) for key, item in settings.items()}


def test_one_node_two_tasks_each_task_is_a_process() -> None:
    resolved = _resolve(srun_env(tasks=2, nodes=1, task=1, node=0, local=1))
    assert resolved["num_processes"] == (2, "env SLURM_STEP_NUM_TASKS")
    assert resolved["num_machines"] == (1, "env SLURM_STEP_NUM_NODES")
    assert resolved["machine_rank"] == (0, "env SLURM_NODEID")
    assert resolved["main_process_ip"] == ("127.0.0.1", "srun: one node")
    assert resolved["main_process_port"] == (10000 + 4242 % 20000, "env SLURM_JOB_ID")


def test_one_task_per_node_leaves_the_process_count_to_the_launcher() -> None:
    resolved = _resolve(srun_env(tasks=2, nodes=2, task=1, node=1, local=0))
    assert resolved["num_processes"] == (2, "default")  # one CPU process per machine
    assert resolved["num_machines"] == (2, "env SLURM_STEP_NUM_NODES")
    assert resolved["machine_rank"] == (1, "env SLURM_NODEID")
    assert resolved["main_process_ip"] == ("cn07", "env SLURM_STEP_NODELIST")


def test_flags_and_master_variables_win_over_the_step() -> None:
    environ = {**srun_env(2, 1, 0, 0, 0), "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "23456"}
    settings = resolve_launch_settings({"main_process_port": 29999}, environ, None, None, 0)
    assert (settings["main_process_port"].value, settings["main_process_port"].source) == (
        29999,
        "flag",
    )
    assert settings["main_process_ip"].value == "10.1.2.3"
    assert settings["main_process_ip"].source == "env MASTER_ADDR"


def test_the_step_wins_over_the_config_file() -> None:
    config = ClusterConfig(distributed_type="MULTI_CPU", num_processes=8, num_machines=4)
    resolved = _resolve(srun_env(2, 1, 0, 0, 0), config)
    assert resolved["num_processes"] == (2, "env SLURM_STEP_NUM_TASKS")
    assert resolved["num_machines"] == (1, "env SLURM_STEP_NUM_NODES")


def test_an_sbatch_script_or_salloc_shell_is_not_an_srun_task() -> None:
    # The batch step sets SLURM_NTASKS/SLURM_PROCID for the whole allocation, not srun's
    # step variables: `accel launch` run there must not think it is one of 8 tasks.
    batch = {key: value for key, value in srun_env(8, 1, 0, 0, 0).items() if "STEP" not in key}
    resolved = _resolve(batch)
    assert resolved["num_processes"] == (1, "default")
    assert resolved["main_process_port"] == (None, "default")


def _plan(argv: list[str]) -> dict[str, object]:
    args: argparse.Namespace = build_parser().parse_args(["launch", *argv])
    return plan_launch(args, os.environ)


def test_each_srun_task_runs_the_script_as_its_process(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in srun_env(tasks=2, nodes=1, task=1, node=0, local=1).items():
        monkeypatch.setenv(key, value)
    plan = _plan(["--cpu", script, "--lr", "1"])
    assert plan["command"][1:] == [script, "--lr", "1"]  # python script: no torchrun
    env = plan["env"]
    assert isinstance(env, dict)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "14242")
    assert main(["launch", "--cpu", "--dry_run", script]) == 0
    captured = capsys.readouterr()
    assert "--nproc_per_node" not in captured.out
    assert "num_processes" in captured.err and "env SLURM_STEP_NUM_TASKS" in captured.err
    assert "srun task 1 of 2" in captured.err


def test_one_task_per_node_runs_torchrun_for_its_node(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in srun_env(tasks=2, nodes=2, task=1, node=1, local=0).items():
        monkeypatch.setenv(key, value)
    assert main(["launch", "--cpu", "--num_processes", "4", "-q", "--dry_run", script]) == 0
    command = capsys.readouterr().out.split()

    def after(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert (after("--nnodes"), after("--nproc_per_node"), after("--node_rank")) == ("2", "2", "1")
    assert (after("--master_addr"), after("--master_port")) == ("cn07", "14242")


def test_a_process_count_that_contradicts_the_step_is_refused(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in srun_env(tasks=2, nodes=1, task=0, node=0, local=0).items():
        monkeypatch.setenv(key, value)
    assert main(["launch", "--cpu", "--num_processes", "4", "--dry_run", script]) == 2
    err = capsys.readouterr().err
    assert "num_processes=4 (from flag)" in err and "SLURM_STEP_NUM_TASKS" in err
    assert "--ntasks-per-node 1" in err


def test_inconsistent_srun_variables_are_named(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in srun_env(tasks=2, nodes=1, task=5, node=0, local=0).items():
        monkeypatch.setenv(key, value)
    assert main(["launch", "--cpu", "--dry_run", script]) == 2
    assert "SLURM_PROCID=5 of SLURM_STEP_NUM_TASKS=2" in capsys.readouterr().err
