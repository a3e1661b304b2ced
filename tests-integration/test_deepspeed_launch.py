"""``accel launch --use_deepspeed`` reaches the DeepSpeed engine on every rank (2 CPU processes).

Runs where deepspeed is installed (the ``deepspeed`` nox session); the integration session,
without it, checks instead that each rank stops with the install command
(test_engine_refusal.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.multiprocess

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "engine_train.py")


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **env}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=240, env=environ
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["-m", "accel_launch", "launch", "--use_deepspeed", "--zero_stage", "3",
          "--num_processes", "2", SCRIPT], {}),
        (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT],
         {"ACCELERATE_USE_DEEPSPEED": "true"}),
    ],
    ids=["launch-flag", "accelerate-switch"],
)  # fmt: skip
def test_deepspeed_requests_train_with_deepspeed_on_every_rank(
    args: list[str], env: dict[str, str]
) -> None:
    done = _run(args, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = re.findall(r"TRAINED (\d+) (\w+) (\w+)", done.stdout)
    assert sorted(rank for rank, _, _ in reports) == ["0", "1"]
    assert {kind for _, _, kind in reports} == {"DEEPSPEED"}  # honoured, not swapped
    assert len({digest for _, digest, _ in reports}) == 1
    # no gloo group is left for interpreter finalization (it could abort the finished run)
    if Path("/proc/self/task").is_dir():  # the script reads Linux's /proc
        exits = sorted(re.findall(r"EXIT-THREADS (\d+) (\S+)", done.stdout))
        assert exits == [("0", "-"), ("1", "-")]
