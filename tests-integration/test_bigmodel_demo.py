"""The big-model demo (README main job) and the big-model benchmark's smoke run.

``python3 tools/dev.py demo`` runs tools/examples/bigmodel_offload.py at its default size; here it
runs on a small checkpoint so that the test takes seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tools" / "examples" / "bigmodel_offload.py"
BENCH = ROOT / "tools" / "bench" / "bigmodel.py"


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


def test_demo_puts_blocks_on_disk_writes_nothing_and_matches_the_in_ram_model(tmp_path) -> None:
    done = run(str(DEMO), "--size-mb", "40", "--dir", str(tmp_path), timeout=120)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "wrote the checkpoint" in out  # first run: generated into --dir
    header = re.search(r"device map: \d+ entries; (.*)", out)
    assert header is not None, out
    assert re.search(r"\bcpu \d+ \(", header.group(1)), out
    assert re.search(r"\bdisk \d+ \(", header.group(1)), out
    assert re.search(r"load_checkpoint_and_dispatch: [\d.]+ s", out), out
    assert "peak memory" in out
    assert "written to the offload folder: 0 bytes in 0 files" in out  # safetensors: read in place
    assert "identical to the in-RAM model: yes" in out
    assert out.rstrip().endswith("big-model demo: OK")

    again = run(str(DEMO), "--size-mb", "40", "--dir", str(tmp_path), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "wrote the checkpoint" not in again.stdout  # the cached checkpoint is reused


def test_demo_fails_when_the_budget_leaves_nothing_on_disk(tmp_path) -> None:
    done = run(
        str(DEMO), "--size-mb", "40", "--cpu-budget-mb", "1000", "--dir", str(tmp_path), timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: expected blocks on both cpu and disk" in done.stdout


@pytest.mark.slow
def test_benchmark_quick_run_prints_the_table(tmp_path) -> None:
    done = run(str(BENCH), "--quick", "--no-accelerate", "--dir", str(tmp_path), timeout=180)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "| measurement | accel | Accelerate 1.15 | raw torch | goal |" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("| all blocks on disk: MB written"))
    assert row.split("|")[2].strip().startswith("**0** in 0 files"), row
    assert "Every worker's logits have the SHA-1 of raw's" in out
