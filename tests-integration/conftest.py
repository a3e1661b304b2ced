"""Shared helpers for the cross-package and launcher tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def torchrun(
    script: str,
    *args: str,
    nproc: int = 2,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` under torchrun with ``nproc`` CPU processes, with a timeout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(SCRIPTS / script),
        *args,
    ]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT
    )


@pytest.fixture
def run_torchrun():
    """The :func:`torchrun` helper as a fixture."""
    return torchrun
