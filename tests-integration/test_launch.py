"""``accel launch`` end to end: real processes, failures, signals, restarts, bad input.

Every launch runs ``python -m accel_launch launch --cpu ...`` as a subprocess with a timeout;
after each one the process table is checked for leftover ranks.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

PROBE = str(Path(__file__).resolve().parent / "scripts" / "launch_probe.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def accel(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel_launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or ENV,
    )


def probes(output: str) -> list[dict[str, object]]:
    found = []
    for line in output.splitlines():
        if "PROBE {" in line:
            found.append(json.loads(line.split("PROBE ", 1)[1]))
    return found


def leftovers() -> list[psutil.Process]:
    mine = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if any("launch_probe.py" in part for part in cmdline):
            mine.append(process)
    return mine


def workers() -> list[psutil.Process]:
    """The ranks themselves (not the launcher, whose command line names the script too)."""
    found = []
    for process in leftovers():
        try:
            if not any("accel_launch" in part for part in process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def wait_for_lines(
    process: subprocess.Popen[str], marker: str, count: int, timeout: float
) -> list[str]:
    """The first ``count`` lines of ``process``'s stdout holding ``marker`` (fewer on timeout).

    A thread reads the pipe, so the wait has a deadline even while no line comes; it keeps
    draining the pipe until the process closes it.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="launcher-stdout", daemon=True).start()
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < count:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if marker in line:
            found.append(line.strip())
    return found


def assert_no_orphans() -> None:
    deadline = time.time() + 10
    while leftovers() and time.time() < deadline:
        time.sleep(0.2)
    assert not leftovers(), [p.info for p in leftovers()]


def test_cpu_with_two_processes_really_starts_two() -> None:
    done = accel("launch", "--cpu", "--num_processes", "2", PROBE, "report")
    assert done.returncode == 0, done.stdout + done.stderr
    reports = sorted(probes(done.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world"] == 2 and r["type"] == "MULTI_CPU" for r in reports)
    assert_no_orphans()


def test_settings_table_names_the_source_of_each_value(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
        "mixed_precision: fp16\nuse_cpu: true\ndebug: false\n"
    )
    env = {**ENV, "ACCEL_MIXED_PRECISION": "bf16"}
    args = ["launch", "--config_file", str(config), "--num-processes", "2"]
    done = accel(*args, "--show_settings", PROBE, "report", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stderr
    assert "num_processes" in table and "flag" in table
    assert "mixed_precision" in table and "ACCEL_MIXED_PRECISION" in table
    assert all(r["mixed_precision"] == "bf16" for r in probes(done.stdout))
    # Without --show_settings: one line; with -q: nothing of the launcher's own.
    summary = accel(*args, PROBE, "report", env=env)
    assert summary.returncode == 0, summary.stderr
    assert "accel launch: 2 processes on 1 machine (cpu), mixed precision bf16" in summary.stderr
    assert "ACCEL_MIXED_PRECISION" not in summary.stderr
    quiet = accel("launch", "--config_file", str(config), "-q", PROBE, "report")
    assert "num_processes" not in quiet.stderr and "accel launch" not in quiet.stderr


def test_the_ranks_output_is_shown_as_the_script_wrote_it(tmp_path: Path) -> None:
    """No rank prefixes unless --tee asks for them; each rank's log is kept all the same."""
    done = accel(
        "launch", "--cpu", "--num_processes", "2", "--log_dir", str(tmp_path), PROBE, "report"
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "PROBE" in line]
    assert len(lines) == 2 and all(line.startswith("PROBE {") for line in lines), done.stdout
    kept = sorted(tmp_path.glob("*/attempt_0/*/stdout.log"))
    assert len(kept) == 2 and all("PROBE {" in path.read_text() for path in kept)
    prefixed = accel("launch", "--cpu", "--num_processes", "2", "--tee", "3", PROBE, "report")
    assert prefixed.returncode == 0, prefixed.stderr
    assert "[default0]:PROBE {" in prefixed.stdout and "[default1]:PROBE {" in prefixed.stdout


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (("exit", "1", "3"), "rank 1 exited with code 3"),
        (("kill", "1"), "rank 1 was killed by SIGKILL"),
    ],
    ids=["exit-code", "sigkill"],
)
def test_a_failing_rank_stops_the_others_and_is_named(
    action: tuple[str, ...], expected: str, tmp_path: Path
) -> None:
    start = time.time()
    done = accel(
        "launch", "--cpu", "--num_processes", "2", "--log_dir", str(tmp_path), PROBE, *action
    )
    assert done.returncode != 0
    assert time.time() - start < 60  # the surviving rank (sleeping 120 s) was stopped
    last = done.stderr.strip().splitlines()[-1]
    assert expected in last, done.stderr
    assert str(tmp_path) in last  # where the failed rank's log is
    assert "mixed_precision" in done.stderr and "default" in done.stderr  # the table, on failure
    assert_no_orphans()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_ends_every_rank(signum: signal.Signals) -> None:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accel_launch",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            PROBE,
            "sleep",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    # Both ranks print the marker once they have joined the group and gone to sleep.
    sleeping = wait_for_lines(launcher, "PROBE sleeping", count=2, timeout=60)
    assert len(sleeping) == 2, f"ranks that said they sleep: {sleeping}"
    assert len(workers()) == 2
    launcher.send_signal(signum)
    code = launcher.wait(timeout=60)
    assert code != 0
    assert_no_orphans()


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_max_restarts_restarts_a_group_whose_rank_crashed_once(
    backend: str, tmp_path: Path
) -> None:
    # Rank 1 exits with 5 after a collective on the first attempt; torchrun restarts both
    # ranks, and on the second attempt (rank 0 starting late, so rank 1 meets the first
    # attempt's keys in torchrun's store) they form a new gloo group and finish a collective.
    marker = tmp_path / "crashed-once"
    done = accel(
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--max_restarts",
        "1",
        "--rdzv_backend",
        backend,
        "--log_dir",
        str(tmp_path / "logs"),
        "-q",
        PROBE,
        "crash-once",
        str(marker),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert marker.read_text() == "crashed"
    reports = sorted(probes(done.stdout), key=lambda r: (r["restarts"], r["rank"]))
    finished = [r for r in reports if r["restarts"] == 1]
    assert [r["rank"] for r in finished] == [0, 1], done.stdout
    assert all(r["sum"] == 3.0 for r in finished)  # a real all-reduce of 1 + 2
    assert {r["restarts"] for r in reports} <= {0, 1}
    # torchrun logs each attempt in its own folder: exactly two attempts ran.
    attempts = sorted(path.name for path in (tmp_path / "logs").glob("*/attempt_*"))
    assert attempts == ["attempt_0", "attempt_1"], attempts
    assert_no_orphans()


def test_max_restarts_is_handed_to_torchrun() -> None:
    done = accel(
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--max_restarts",
        "1",
        "--dry_run",
        PROBE,
        "report",
    )
    assert done.returncode == 0, done.stderr
    assert "--max_restarts 1" in done.stdout
    assert not probes(done.stdout)


def _srun_job_id() -> int:
    """A SLURM job id whose derived rendezvous port (10000 + id % 20000) is free here."""
    for port in random.Random().sample(range(10000, 30000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 10000
    raise RuntimeError("no free port between 10000 and 30000")


def test_srun_tasks_each_run_one_process_of_the_group() -> None:
    # What `srun --nodes 1 --ntasks 2 accel launch --cpu probe.py` gives each of its tasks.
    job_id = _srun_job_id()
    base = {
        key: value
        for key, value in ENV.items()
        if not key.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))
        and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    srun = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NODEID": "0",
    }
    tasks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accel_launch",
                "launch",
                "--cpu",
                "--show_settings",
                PROBE,
                "report",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **srun, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
        )
        for task in (0, 1)
    ]
    outputs = [task.communicate(timeout=120) for task in tasks]
    for task, (out, err) in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, out + err
    table = outputs[1][1]
    assert "env SLURM_STEP_NUM_TASKS" in table and "env SLURM_JOB_ID" in table
    assert "srun task 1 of 2" in table
    reports = sorted((r for out, _ in outputs for r in probes(out)), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world"] == 2 and r["type"] == "MULTI_CPU" for r in reports)
    assert_no_orphans()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_machines_on_localhost(backend: str) -> None:
    port = str(_free_port())
    common = [
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
        "--rdzv_backend",
        backend,
        "-q",
    ]
    machines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accel_launch",
                *common,
                "--machine_rank",
                str(rank),
                PROBE,
                "report",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for rank in (0, 1)
    ]
    outputs = [machine.communicate(timeout=120) for machine in machines]
    for machine, (out, err) in zip(machines, outputs, strict=True):
        assert machine.returncode == 0, out + err
    reports = [r for out, _ in outputs for r in probes(out)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world"] == 2 for r in reports)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "--num_processes", "0"], "num_processes"),
        (["--cpu", "--num_processes", "2", "--main_process_port", "-5"], "main_process_port"),
        (["--cpu", "--multi_gpu"], "at most one"),
        (["--use_megatron_lm"], "Megatron-LM was requested by --use_megatron_lm"),
        (["--cpu", "--zero_stage", "2"], "--zero_stage is a setting of deepspeed"),
    ],
    ids=["zero-processes", "negative-port", "conflicting", "megatron", "stray-engine-flag"],
)
def test_bad_input_fails_before_any_process_starts(args: list[str], message: str) -> None:
    done = accel("launch", *args, PROBE, "report")
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert not probes(done.stdout)


def test_a_missing_script_and_a_busy_port_are_clear_errors(tmp_path: Path) -> None:
    missing = accel("launch", "--cpu", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        done = accel(
            "launch", "--cpu", "--num_processes", "2", "--main_process_port", port, PROBE, "report"
        )
    assert done.returncode == 2 and "already in use" in done.stderr
    assert not probes(done.stdout)


def test_accel_test_runs_the_self_check() -> None:
    """What ``accelerate test`` proves: collectives, DDP = one process, bf16 and fp16."""
    done = accel("test")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 process(es), MULTI_CPU, backend gloo: gather, reduce, broadcast" in done.stdout
    for check in (
        "DDP on 2 process(es) = one process",
        "split_batches=True = one process",
        "2 accumulation steps = a batch twice as large",
        "bf16 training: the loss went from",
        "fp16 training: the loss went from",
    ):
        assert f"accel test: {check}" in done.stdout, done.stdout
    assert "Test is a success!" in done.stdout
