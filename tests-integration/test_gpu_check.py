"""The GPU check's dry run (accel issue 30): every step of tools/gpu_check.py on the CPU.

One run of ``tools/gpu_check.py --dry-run`` (each step a process of its own, small sizes,
accel's side only) must print the one table with a row for every step, judge nothing as
failed, exit 0 and leave a parseable JSON record per step plus ``summary.json``. It covers
tools/bench/offload_gpu.py's dry run (depths 0 and 2, two batch sizes, a CPU-busy run),
tools/bench/gpu_training.py, tools/bench/engines.py (FSDP2, 2 gloo ranks), tools/bench/
disk_read.py and, where their libraries or the sdist are there, the upstream and
load_pretrained steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tools" / "gpu_check.py"
STEPS = (
    "environment",
    "accel-gpu-tests",
    "upstream-gpu",
    "training",
    "engines",
    "offload",
    "pretrained",
    "disk",
)


def run(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(CHECK), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def rows(out: str, start: str) -> list[list[str]]:
    """The cells of every table row whose first cell starts with ``start``."""
    found = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith(f"| {start}")
    ]
    assert found, f"no row {start!r} in:\n{out}"
    return found


@pytest.mark.slow
def test_dry_run_prints_one_table_and_writes_a_record_per_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run("--dry-run", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), timeout=400)
    text = done.stdout
    assert done.returncode == 0, text + done.stderr
    assert text.count("| step | accel | Accelerate 1.15 | goal / ok |") == 1, text
    assert "**FAILED**" not in text, text
    assert f"Command: `python3 tools/gpu_check.py --dry-run --out {out}" in text, text

    assert rows(text, "environment: device, torch")[0][1].startswith("CPU (dry run)")
    tests = rows(text, "accel's tests marked gpu")[0]
    assert tests[1] == "no gpu tests" or tests[1].startswith("0 / 0 / "), tests
    upstream = rows(text, "upstream-gpu") if "| upstream-gpu |" in text else None
    if upstream is not None:  # no sdist here: the reason, not a failure
        assert upstream[0][1].startswith("not run: no sdist"), upstream
    else:
        assert rows(text, "Accelerate 1.15's GPU-gated tests")[0][3].endswith("**ok**")
    for precision in ("fp32", "bf16"):
        diff = rows(text, f"training {precision}: max abs weight diff")[0]
        assert diff[1] == "identical" and diff[3].endswith("**ok**"), diff
        ratio = rows(text, f"training {precision}: optimizer step time")[0]
        assert ratio[1].endswith("ms)") and "not judged in a dry run" in ratio[3], ratio
    resume = rows(text, "training: exact mid-epoch resume")[0]
    assert resume[1] == "bit-identical" and resume[3].endswith("**ok**"), resume
    assert "bytes 1.000×" in rows(text, "engines: FSDP2 step")[0][1]
    speeds = rows(text, "offload: tokens/s at batch 1/4, depth 0 → depth 2")[0][1]
    assert all(part.strip().isdigit() for side in speeds.split("→") for part in side.split("/"))
    assert rows(text, "offload: logits equal")[0][1] == "yes"
    assert rows(text, "offload: tokens/s with 1 CPU-spinning process ÷ idle")[0][1]
    assert "%" in rows(text, "offload: achieved H2D at batch 1")[0][1]
    assert rows(text, "pretrained")[0][1]  # a figure, or why not ("not run: transformers ...")
    disk = rows(text, "disk: cold first forward")[0]
    assert "MB/s" in disk[1], disk
    assert rows(text, "disk: cold forward's logits equal")[0][1] == "yes"

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["dry_run"] is True and summary["failed"] == []
    assert [record["step"] for record in summary["steps"]] == list(STEPS)
    for step in STEPS:
        record = json.loads((out / f"{step}.json").read_text(encoding="utf-8"))
        assert record["status"] in ("ok", "skipped"), record
        assert record["seconds"] < record["timeout"], record
        assert (out / f"{step}.log").is_file()
    figures = json.loads((out / "offload-figures.json").read_text(encoding="utf-8"))
    assert figures["batches"] == [1, 4] and "accel:2:busy1" in figures["runs"]


def test_unknown_steps_are_refused_with_the_list_of_steps(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path), "--steps", "training,warp-drive", timeout=60)
    assert done.returncode == 2
    assert "--steps: unknown ['warp-drive']; the steps are environment, accel-gpu-tests" in (
        done.stderr
    )
    assert not (tmp_path / "summary.json").exists()
