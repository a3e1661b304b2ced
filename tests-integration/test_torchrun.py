"""accel-state under the real launcher: torchrun with 2 CPU processes."""

from __future__ import annotations

import json


def test_bare_partial_state_under_torchrun_is_multi_cpu(run_torchrun, tmp_path) -> None:
    done = run_torchrun("state_report.py", str(tmp_path))
    assert done.returncode == 0, done.stderr
    files = sorted(tmp_path.glob("rank*.json"))
    reports = [json.loads(path.read_text()) for path in files]
    assert [r["process_index"] for r in reports] == [0, 1]
    for report in reports:
        assert report["distributed_type"] == "MULTI_CPU"
        assert report["num_processes"] == 2
        assert report["local_process_index"] == report["process_index"]
        assert report["backend"] == "gloo"
        assert report["device"] == "cpu"
        assert report["gathered"] == [0, 1]
        assert report["names"] == ["rank0", "rank1"]


def test_demo_runs_and_reports_ok(run_torchrun) -> None:
    done = run_torchrun("demo.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo: OK" in done.stdout
    assert "[RANK 0] my share of the work: [1, 2, 3, 4, 5]" in done.stdout
    assert "[RANK 1] my share of the work: [6, 7, 8, 9, 10]" in done.stdout
    assert "99 samples gathered, each of the 99 exactly once: True" in done.stdout
