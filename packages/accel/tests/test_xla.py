"""The XLA path on the fake torch_xla of ``fake_torch_xla/`` (torch_xla cannot be installed
beside torch 2.13): one CPU "device" per process, collectives that really exchange tensors,
a preloader thread that runs ahead of the loop, and a log of every call.

Oracle for training: one plain-torch process on the global batch (both ranks' batches, as the
script recorded them), the same AdamW and clipping. Two processes started by ``accel launch
--tpu`` must end within ``TOLERANCE`` of it, average gradients once per optimizer step (never
on accumulation micro-steps), resume from a mid-epoch checkpoint where the loop (not the
preloader) stood, run ``mark_step`` before writing the checkpoint, and gather each evaluation
sample once. The one-process checks cover the state, the switches that keep XLA off, the bf16
variables, the refusals, re-pointing an optimizer whose parameters the move replaced, the
loader wrapper and the XLA seed in checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
FAKE = HERE / "fake_torch_xla"
SCRIPTS = HERE / "xla_scripts"
sys.path.insert(0, str(SCRIPTS))
import xla_train  # noqa: E402

# Two ranks' gradients are averaged in another order than one process's mean over both.
TOLERANCE = 1e-6


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL", "FAKE_XLA"))}
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _accel_launch() -> list[str]:
    return [sys.executable, "-m", "accel_launch"]


@pytest.mark.torch_feature("fully_shard")
def test_one_process_state_refusals_and_prepare() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "xla_checks.py")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["torch_xla_imported_by_import_accel"] is False
    assert seen["state"] == ["DistributedType.XLA", "xla", "cpu"]
    assert seen["topology_source"] == "xla"
    assert seen["USE_TORCH_XLA=false"] == "DistributedType.NO"
    assert seen["ACCEL_USE_CPU=true"] == "DistributedType.NO"
    assert seen["bf16"] == ["1", "0"]
    assert seen["bf16_downcast"] == ["0", "1", True]
    assert "ACCEL_DOWNCAST_BF16=true" in seen["downcast_without_bf16"]
    assert "mixed_precision='no'" in seen["downcast_without_bf16"]
    assert "FSDP (fully sharded data parallel)" in seen["fsdp_on_xla"]
    assert "USE_TORCH_XLA=false" in seen["fsdp_on_xla"]
    assert seen["state_after_refusal"] is True
    assert "before putting the model on the device" in seen["devices_differ"]
    assert seen["parameters_replaced"] and seen["optimizer_repointed"]
    assert seen["moved_model_trains"]
    assert seen["loader"] == "MpDeviceLoaderWrapper"
    assert "dispatch_batches=False" in seen["dispatch"]
    assert seen["skip_first_batches"] == ["MpDeviceLoaderWrapper", [[4.0, 5.0], [6.0, 7.0]]]
    assert seen["xm_seed_saved"] == 101


def _windows(per_epoch: int, epochs: int) -> list[list[int]]:
    """The micro-steps of each optimizer step: pairs, and an epoch's odd last batch alone."""
    windows = []
    for epoch in range(epochs):
        start = epoch * per_epoch
        windows += [
            list(range(b, min(b + 2, start + per_epoch)))
            for b in range(start, start + per_epoch, 2)
        ]
    return windows


def _oracle(
    seen: list[list[list[int]]], windows: list[list[int]]
) -> tuple[dict[str, Any], list[float]]:
    """One process, the global batch of every micro-step, one optimizer step per window."""
    model = xla_train.net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y, _ = xla_train.data().tensors
    norms = []
    for window in windows:
        for micro in window:
            index = torch.tensor(seen[0][micro] + seen[1][micro])
            # accumulate() divides every micro-step's loss by the accumulation steps (2),
            # the lone last one of an epoch too, as Accelerate does.
            loss = nn.functional.mse_loss(model(x[index]), y[index]) / 2
            loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((torch.tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in b)


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_train_like_one_on_the_global_batch(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *_accel_launch(),
            "launch",
            "--tpu",
            "--main_training_function",
            "train",
            str(SCRIPTS / "xla_train.py"),
            str(tmp_path),
        ],
        env=_env(FAKE_XLA_DEVICES="2", FAKE_XLA_LOG=str(tmp_path / "log")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world"]) == (rank, 2)
        assert result["distributed_type"] == "DistributedType.XLA"
        assert result["loader"] == "MpDeviceLoaderWrapper"
        assert result["objects"] == [0, 1]
        assert result["collectives"] == {
            "sum": [3.0],
            "mean": [1.5],
            "max": [2.0],
            "broadcast": [10.0],
            "objects": ["rank 1"],
            "padded": [2],
        }
        assert sorted(result["metric_ids"]) == list(range(xla_train.NUM_SAMPLES))
        assert "random_states_1.pkl" in result["checkpoint_files"]
    # backward(loss, num_items=n) over uneven micro-batches: the gradient of the loss summed
    # over every rank's items, divided by their number.
    probe = nn.Linear(4, 1)
    probe.load_state_dict({k: torch.tensor(v) for k, v in ranks[0]["probe"].items()})
    x, y, _ = xla_train.data().tensors
    index = torch.tensor([i for rank in xla_train.NUM_ITEMS_BATCHES for b in rank for i in b])
    (((probe(x[index]) - y[index]) ** 2).sum() / len(index)).backward()
    for result in ranks:
        for name, param in probe.named_parameters():
            got = torch.tensor(result["num_items_grads"][name])
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-6)
    per_epoch = ranks[0]["batches_per_epoch"]
    assert per_epoch == xla_train.NUM_SAMPLES // (2 * xla_train.PER_RANK_BATCH)
    seen = [result["seen"] for result in ranks]
    # The ranks' shards of each epoch are disjoint and cover the data.
    for epoch in range(xla_train.EPOCHS):
        batches = [s[epoch * per_epoch : (epoch + 1) * per_epoch] for s in seen]
        flat = sorted(i for rank in batches for batch in rank for i in batch)
        assert flat == list(range(xla_train.NUM_SAMPLES))
    assert per_epoch % 2 == 1 and per_epoch > 8  # a lone last batch; longer than the preload
    windows = _windows(per_epoch, xla_train.EPOCHS)
    # The step is taken at each window's last micro-step: the loop's own position decides
    # end_of_dataloader, not the preloader thread's, which reaches the end 8 batches earlier.
    syncs = [False] * (xla_train.EPOCHS * per_epoch)
    for window in windows:
        syncs[window[-1]] = True
    expected, norms = _oracle(seen, windows)
    for result in ranks:
        assert result["syncs"] == syncs
        assert all(result["active"]) and len(result["active"]) == len(syncs)
        assert _max_difference(result["final"], expected) <= TOLERANCE
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
    # The restored checkpoint resumes after the batches the loop had used (not the ones
    # the preloader had read), and trains the rest of the epoch to the same weights.
    epoch, used = xla_train.SAVE_AT
    rest = slice(epoch * per_epoch + used, (epoch + 1) * per_epoch)
    for result in ranks:
        assert result["again"] == result["seen"][rest]
        assert result["again_syncs"] == syncs[rest]
        assert _max_difference(result["resumed"], result["final"]) == 0.0
    log = _log(tmp_path / "log.0")
    gradient_reduces = [
        entry for entry in log if entry["call"] == "all_reduce" and entry["scale"] == 0.5
    ]
    # One all-reduce of every gradient per optimizer step: the windows, then those of the
    # resumed rest of the epoch (the model's 4 gradients); none on accumulation micro-steps;
    # then the probe's window (2 gradients), reduced once although clipped before its step.
    sizes = [entry["tensors"] for entry in gradient_reduces]
    assert sizes == [4] * (len(windows) + sum(syncs[rest])) + [2]
    calls = [entry["call"] for entry in log]
    saving = calls[calls.index("before_save_state") : calls.index("after_save_state")]
    assert "mark_step" in saving
    assert calls.count("MpDeviceLoader") == 2  # the training and the evaluation loader
    assert log[0] == {"call": "spawn", "nprocs": None, "world": 2}  # the launcher's process


def test_missing_training_function_is_named(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("def main():\n    pass\n")
    done = subprocess.run(
        [*_accel_launch(), "launch", "--tpu", "--main_training_function", "train", str(script)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "has no function 'train'" in done.stderr
    assert "--main_training_function" in done.stderr
