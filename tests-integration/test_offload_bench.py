"""Smoke run of the offload-engine benchmark (accel issue 9).

``tools/bench/offload.py --quick`` runs every part of the CPU benchmark (raw load, warm-cache
workers at prefetch depths 0-2, cold-cache workers with the page cache dropped) on a tiny
checkpoint. The GPU benchmark, ``tools/bench/offload_gpu.py --dry-run``, runs inside
``tools/gpu_check.py --dry-run`` (tests-integration/test_gpu_check.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench" / "offload.py"


def run(*command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def row(out: str, start: str) -> list[str]:
    """The cells of the table row whose label starts with ``start``."""
    line = next((ln for ln in out.splitlines() if ln.startswith(f"| {start}")), None)
    assert line is not None, f"no row {start!r} in:\n{out}"
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_offload_benchmark_quick_run_prints_the_table(tmp_path) -> None:
    done = run(str(BENCH), "--quick", "--no-accelerate", "--dir", str(tmp_path), timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    header = (
        "| measurement | accel, prefetch_depth=0 | accel, prefetch_depth=1 | "
        "accel, prefetch_depth=2 | goal |"
    )
    assert header in out, out
    written = row(out, "warm: MB written to the offload folder")
    assert all(cell.startswith("**0** in 0 files") for cell in written[1:4]), written
    anon = row(out, "warm: anonymous RSS peak")
    assert all("bound" in cell for cell in anon[1:4]), anon
    assert row(out, "warm: forward 1×16 tokens")[1].endswith("×**)")
    if sys.platform.startswith("linux"):  # posix_fadvise + mincore: the cold-cache rows
        cold = row(out, "cold: forward ÷ max(compute, I/O)")
        assert cold[1].startswith("**") and cold[3] == "—", cold  # depth 2 is warm-only
        read = row(out, "cold: MB read from storage per forward")
        assert " of " in read[1], read
    assert "Every offloaded forward's logits were torch.equal to the in-RAM model's" in out
    assert "Command: `python tools/bench/offload.py --quick --no-accelerate --dir" in out
