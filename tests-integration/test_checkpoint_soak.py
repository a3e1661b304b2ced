"""Soak: 1,000 DDP steps with an asynchronous checkpoint every 50, watched for leaks.

``scripts/soak_run.py`` on 2 gloo processes under torchrun (``total_limit=3``): after warm-up
(the first 200 steps: the snapshot buffers, allocator pools and the agreement group are made
there) each process's resident memory must stay flat (the least-squares slope, printed with
``-s``, times the remaining steps under the main process's snapshot size, 12 MB: a save that
leaked its snapshot would show 16 of them) and its open file descriptors constant; at the end
exactly the three newest checkpoints are left, no hidden temporary folder, and after
``end_training`` no thread that was not there before the Accelerator was built. (Run for
3,000 steps, the memory of both processes stays within 357-406 MB, without a trend.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiprocess

STEPS = 1000
EVERY = 50
WARM_UP = 200


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return covariance / sum((x - mean_x) ** 2 for x, _ in points)


def test_a_thousand_steps_with_async_checkpoints_leak_nothing(
    tmp_path: Path, run_torchrun: Any
) -> None:
    done = run_torchrun(
        "soak_run.py",
        "--project-dir",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--report-dir",
        str(tmp_path),
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("soak_*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    # The main process snapshots the weights and optimizer; the other only its random states.
    snapshot = reports[0]["snapshot_bytes"]
    assert snapshot > 10e6
    for report in reports:
        late = [s for s in report["samples"] if s["step"] > WARM_UP]
        slope = _slope([(s["step"], s["rss"]) for s in late])
        growth = slope * (STEPS - WARM_UP)
        print(
            f"rank {report['rank']}: RSS slope {slope:.0f} B/step ({growth / 1e6:.2f} MB over "
            f"{STEPS - WARM_UP} steps), snapshot {report['snapshot_bytes'] / 1e6:.1f} MB, "
            f"fds {sorted({s['fds'] for s in late})}, threads after {report['threads_after']}"
        )
        assert growth < snapshot, report["rank"]
        assert len({s["fds"] for s in late}) == 1, late
        assert report["threads_after"] == report["threads_before"]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"checkpoint_{n}" for n in range(STEPS // EVERY - 3, STEPS // EVERY)]
    assert not [p for p in tmp_path.rglob("*") if ".incomplete" in p.name]
