"""``accel test``'s training checks, in one process, and ``accel test`` on a bf16 config.

Each check must pass on a correct accel and fail when what it guards is broken: here the
accumulation division is broken on purpose, in float32 and in bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import yaml

from accel import selfcheck


def test_checks_pass_and_say_what_they_compared() -> None:
    lines = selfcheck.run_checks()
    assert [line.split(":")[0] for line in lines] == [
        "DDP on 1 process(es) = one process",
        "split_batches=True = one process",
        "2 accumulation steps = a batch twice as large",
        "bf16 training",
        "fp16 training",
    ]


def test_registered_for_accel_test() -> None:
    (entry,) = [e for e in entry_points(group="accel.selfchecks") if e.name == "training"]
    assert entry.load() is selfcheck.run_checks


def test_accumulation_that_forgets_to_divide_the_loss_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accel.accelerator import Accelerator

    real = Accelerator.backward

    def undivided(self: Accelerator, loss: torch.Tensor, **kwargs: object) -> None:
        if self.gradient_accumulation_steps > 1:
            loss = loss * self.gradient_accumulation_steps
        real(self, loss, **kwargs)

    monkeypatch.setattr(Accelerator, "backward", undivided)
    with pytest.raises(AssertionError, match="2 accumulation steps = a batch twice as large"):
        selfcheck.run_checks()
    # The looser bf16 tolerance still catches it.
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    with pytest.raises(AssertionError, match=r"accumulation steps .* in bf16 by 0\.[1-9]"):
        selfcheck.run_checks()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_launch_precision_is_checked_against_pytorch_in_that_precision(
    monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", precision)  # what a bf16 config file sets
    lines = selfcheck.run_checks()
    distribution = lines[:3]
    assert all(line.endswith(f"({precision})") for line in distribution), distribution
    # One process computes exactly what plain PyTorch computes under the same autocast.
    assert (
        distribution[0] == f"DDP on 1 process(es) = one process: max |difference| 0 ({precision})"
    )


@pytest.mark.multiprocess
def test_accel_test_passes_on_the_bf16_config_accel_config_default_writes(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(ACCEL_HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")

    def accel(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "accel_launch", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    config = tmp_path / "bf16.yaml"
    written = accel("config", "default", "--mixed_precision", "bf16", "--config_file", str(config))
    assert written.returncode == 0, written.stderr
    settings = yaml.safe_load(config.read_text())
    assert (settings["mixed_precision"], settings["num_processes"]) == ("bf16", 1)
    # The same file on 2 CPU processes, so that DDP is checked in bf16 as well.
    settings.update(distributed_type="MULTI_CPU", num_processes=2)
    config.write_text(yaml.safe_dump(settings))
    done = accel("test", "--config_file", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DDP on 2 process(es) = one process: max |difference|" in done.stdout
    assert "(bf16)" in done.stdout and "Test is a success!" in done.stdout
