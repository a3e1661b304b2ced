"""The training checks of ``accel test``: what ``accelerate test`` proves, in accel's words.

``accel test`` (accel-launch) starts 2 processes (or what the config file says), checks the
collectives, then runs every ``accel.selfchecks`` entry point; this module is the one the
``accel`` package registers. On every process it trains small regressions and compares:

* DDP over the processes against plain PyTorch in one process on the global batch (the same
  weights after an epoch), with the batch sharded and with ``split_batches=True``;
* two accumulation steps against one step on the batch twice as large;
* bf16 and fp16 mixed precision (fp16 where torch supports it on the device): the layers
  compute in the low precision, the weights stay float32, fp16 has a gradient scaler, and
  training ends where plain PyTorch ends under the same autocast (and scaler).

The first three run in the precision of the launch (``Accelerator()`` reads it from the
config file or ``--mixed_precision``), so a bf16 config is checked in bf16. Each result is
compared with plain PyTorch computing in the same precision (``torch.autocast``, and a
``GradScaler`` for fp16), within a tolerance set by that precision: 1e-5 in float32, the
dtype's machine epsilon in bf16 or fp16, where summing the batch over several processes
rounds differently than in one (about 5e-4 for bf16 here) while a real fault (a doubled
step, an undivided accumulation) moves the weights by more than 0.1.

Any difference raises ``AssertionError`` naming the check, so the launcher reports the rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accel_amp import GradScalerKwargs
from accel_state import AcceleratorState, GradientState, PartialState

__all__ = ["run_checks"]

SAMPLES = 96
PER_PROCESS_BATCH = 4
LEARNING_RATE = 0.05
#: fp16's first loss scale, here and in the reference: low enough that no step overflows, so
#: no process skips a step the others take (the default, 65536, overflows on some shards).
INITIAL_LOSS_SCALE = 2.0**8
#: The dtype the layers compute in, per mixed precision the plain-PyTorch reference can mirror.
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


def _tolerance(precision: str) -> float:
    """How far the weights may drift from the reference in ``precision`` (see the module)."""
    dtype = _COMPUTE_DTYPES.get(precision)
    return 1e-5 if dtype is None else float(torch.finfo(dtype).eps)


def _one_process(batch_size: int, precision: str = "no") -> torch.Tensor:
    """Plain PyTorch: one epoch in order, ``batch_size`` samples per step, in ``precision``.

    bf16 and fp16 run the forward under ``torch.autocast`` and compute the loss in float32,
    as the Accelerator does; fp16 scales the loss with a ``GradScaler``. Any other precision
    runs in float32.
    """
    device = PartialState().device
    model = _model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dtype = _COMPUTE_DTYPES.get(precision)
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler(device.type, init_scale=INITIAL_LOSS_SCALE)
    for x, y in DataLoader(_data(), batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        autocast = (
            torch.autocast(device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            output = model(x)
        loss = F.mse_loss(output.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


def _accel(
    batch_size: int, **accelerator_kwargs: Any
) -> tuple[torch.Tensor, list[torch.dtype], tuple[Any, float, str]]:
    """One epoch through an ``Accelerator``.

    Returns the weights, the dtypes the first layer computed in, and (the gradient scaler,
    the final loss on the whole data set, the Accelerator's mixed precision).
    """
    from .accelerator import Accelerator

    AcceleratorState._reset_state()
    GradientState._reset_state()
    scaling = GradScalerKwargs(init_scale=INITIAL_LOSS_SCALE)
    accelerator = Accelerator(kwargs_handlers=[scaling], **accelerator_kwargs)
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
    scaler = (accelerator.scaler, _loss(unwrapped), str(accelerator.mixed_precision))
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return weights, dtypes, scaler


def _loss(model: torch.nn.Module) -> float:
    """The float32 loss of ``model`` on the whole data set."""
    x, y = _data().tensors
    with torch.no_grad():
        return float(F.mse_loss(model.float().cpu()(x), y))


def _close(name: str, got: torch.Tensor, want: torch.Tensor, precision: str) -> str:
    atol = _tolerance(precision)
    difference = float((got - want).abs().max())
    assert difference <= atol, (
        f"accel test: {name}: the weights differ from one-process PyTorch in {precision} by "
        f"{difference:.3g} (allowed {atol:g})"
    )
    return f"{name}: max |difference| {difference:.2g} ({precision})"


def _distribution_checks(reference: Callable[[int, str], torch.Tensor]) -> list[str]:
    """DDP, ``split_batches`` and accumulation, in the launch's precision."""
    processes = PartialState().num_processes
    global_batch = PER_PROCESS_BATCH * processes
    weights, _, (_, _, precision) = _accel(PER_PROCESS_BATCH)
    lines = [
        _close(
            f"DDP on {processes} process(es) = one process",
            weights,
            reference(global_batch, precision),
            precision,
        )
    ]
    weights, _, (_, _, precision) = _accel(global_batch, split_batches=True)
    lines.append(
        _close(
            "split_batches=True = one process",
            weights,
            reference(global_batch, precision),
            precision,
        )
    )
    weights, _, (_, _, precision) = _accel(PER_PROCESS_BATCH, gradient_accumulation_steps=2)
    lines.append(
        _close(
            "2 accumulation steps = a batch twice as large",
            weights,
            reference(2 * global_batch, precision),
            precision,
        )
    )
    return lines


def run_checks() -> list[str]:
    """Run every check on this process; return one line per check (or raise)."""
    state = PartialState()
    processes = state.num_processes
    global_batch = PER_PROCESS_BATCH * processes
    if SAMPLES % (2 * global_batch):
        return [f"training checks skipped: {processes} processes do not divide {SAMPLES} samples"]
    references: dict[tuple[int, str], torch.Tensor] = {}

    def reference(batch_size: int, precision: str) -> torch.Tensor:
        key = (batch_size, precision if precision in _COMPUTE_DTYPES else "no")
        if key not in references:
            references[key] = _one_process(*key)
        return references[key]

    start = _loss(_model())
    lines = _distribution_checks(reference)
    for precision, dtype in _COMPUTE_DTYPES.items():
        try:
            weights, dtypes, extra = _accel(PER_PROCESS_BATCH, mixed_precision=precision)
        except ValueError as error:  # fp16 autocast that torch lacks on this device
            lines.append(f"{precision}: not available here ({error})")
            continue
        scaler, loss, _ = extra
        assert set(dtypes) == {dtype}, f"accel test: {precision}: the layers gave {set(dtypes)}"
        assert precision != "fp16" or scaler is not None, "accel test: fp16 without a scaler"
        assert bool(torch.isfinite(weights).all()), f"accel test: {precision}: weights not finite"
        assert loss < start, (
            f"accel test: {precision}: the loss went from {start:.3g} to {loss:.3g}"
        )
        _close(f"{precision} training", weights, reference(global_batch, precision), precision)
        lines.append(f"{precision} training: the loss went from {start:.3g} to {loss:.3g}")
    return lines
