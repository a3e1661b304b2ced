"""The example training script reaches its target loss on 2 processes under torchrun.

This is the README's main job (``python3 tools/dev.py demo`` runs the same script).
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[1] / "tools" / "examples" / "train.py")


def test_two_process_training_reaches_the_target_loss(run_torchrun) -> None:
    done = run_torchrun(TRAIN, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training on 2 process(es), MULTI_CPU" in done.stdout
    assert "on 500 samples" in done.stdout  # gather_for_metrics: every sample exactly once
    assert "reached target" in done.stdout


def test_bf16_with_gradient_accumulation_reaches_the_target_loss(run_torchrun) -> None:
    done = run_torchrun(
        TRAIN, "--mixed-precision", "bf16", "--gradient-accumulation-steps", "2", timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "accel precision: bf16 | autocast bfloat16 on cpu" in done.stdout
    assert "reached target" in done.stdout


def test_ddp_under_torchrun_equals_one_process_with_the_global_batch(run_torchrun) -> None:
    done = run_torchrun("ddp_equivalence.py", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        for mode in ("shard", "split", "dispatch", "shard+accumulation"):
            assert line[mode] < 1e-5, (mode, line)
