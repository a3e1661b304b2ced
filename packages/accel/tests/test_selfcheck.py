"""``accel test``'s training checks, in one process (the 2-process run is an integration test).

Each check must pass on a correct accel and fail when what it guards is broken: here the
accumulation division is broken on purpose.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

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
