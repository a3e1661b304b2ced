"""The training checks of ``accel test``: what ``accelerate test`` proves, in accel's words.

``accel test`` (accel-launch) starts 2 processes (or what the config file says), checks the
collectives, then runs every ``accel.selfchecks`` entry point; this module is the one the
``accel`` package registers. On every process it trains small regressions and compares:

* DDP over the processes against plain PyTorch in one process on the global batch (the same
  weights after an epoch), with the batch sharded and with ``split_batches=True``;
* two accumulation steps against one step on the batch twice as large;
* bf16 and fp16 mixed precision (fp16 where torch supports it on the device): the layers
  compute in the low precision, the weights stay float32, fp16 has a gradient scaler, and
  training ends near the float32 result.

Any difference raises ``AssertionError`` naming the check, so the launcher reports the rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_state import AcceleratorState, GradientState, PartialState

__all__ = ["run_checks"]

SAMPLES = 96
PER_PROCESS_BATCH = 4
LEARNING_RATE = 0.05


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.3 + 0.01 * torch.randn(SAMPLES, 1)
    return TensorDataset(x, y)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def _one_process(batch_size: int) -> torch.Tensor:
    """Plain PyTorch: one epoch in order, ``batch_size`` samples per step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for x, y in DataLoader(_data(), batch_size=batch_size):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


def _accel(
    batch_size: int, **accelerator_kwargs: Any
) -> tuple[torch.Tensor, list[torch.dtype], tuple[Any, float]]:
    """One epoch through an ``Accelerator``.

    Returns the weights, the dtypes the first layer computed in, and (the gradient scaler,
    the final loss on the whole data set).
    """
    from .accelerator import Accelerator

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(**accelerator_kwargs)
    model = _model()
    dtypes: list[torch.dtype] = []  # what the first layer computes in (the output is float32)
    first = next(iter(model.children()))
    first.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(_data(), batch_size=batch_size)
    )
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    weights = _weights(unwrapped)
    scaler = (accelerator.scaler, _loss(unwrapped))
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return weights, dtypes, scaler


def _loss(model: torch.nn.Module) -> float:
    """The float32 loss of ``model`` on the whole data set."""
    x, y = _data().tensors
    with torch.no_grad():
        return float(F.mse_loss(model.float()(x), y))


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> str:
    difference = float((got - want).abs().max())
    assert difference <= atol, (
        f"accel test: {name}: the weights differ from one-process PyTorch by {difference:.3g} "
        f"(allowed {atol:g})"
    )
    return f"{name}: max |difference| {difference:.2g}"


def run_checks() -> list[str]:
    """Run every check on this process; return one line per check (or raise)."""
    state = PartialState()
    processes = state.num_processes
    global_batch = PER_PROCESS_BATCH * processes
    if SAMPLES % (2 * global_batch):
        return [f"training checks skipped: {processes} processes do not divide {SAMPLES} samples"]
    reference = _one_process(global_batch)
    start = _loss(_model())
    lines = []
    weights, _, _ = _accel(PER_PROCESS_BATCH)
    lines.append(_close(f"DDP on {processes} process(es) = one process", weights, reference, 1e-5))
    weights, _, _ = _accel(global_batch, split_batches=True)
    lines.append(_close("split_batches=True = one process", weights, reference, 1e-5))
    weights, _, _ = _accel(PER_PROCESS_BATCH, gradient_accumulation_steps=2)
    twice = _one_process(2 * global_batch)
    lines.append(_close("2 accumulation steps = a batch twice as large", weights, twice, 1e-5))
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            weights, dtypes, extra = _accel(PER_PROCESS_BATCH, mixed_precision=precision)
        except ValueError as error:  # fp16 autocast that torch lacks on this device
            lines.append(f"{precision}: not available here ({error})")
            continue
        scaler, loss = extra
        assert set(dtypes) == {dtype}, f"accel test: {precision}: the layers gave {set(dtypes)}"
        assert precision != "fp16" or scaler is not None, "accel test: fp16 without a scaler"
        assert bool(torch.isfinite(weights).all()), f"accel test: {precision}: weights not finite"
        assert loss < start, (
            f"accel test: {precision}: the loss went from {start:.3g} to {loss:.3g}"
        )
        if precision == "bf16":  # fp16's scaler skips the first steps while it calibrates
            _close("bf16 training", weights, reference, 5e-2)
        lines.append(f"{precision} training: the loss went from {start:.3g} to {loss:.3g}")
    return lines
