"""What a checkpoint holds for an exact resume, besides the objects' own states.

Every process saves, in ``random_states_<rank>.pkl``, Accelerate's random-state keys (Python,
numpy, torch, CUDA, XPU and the engine's own) plus accel's gradient-accumulation counters; a
checkpoint taken in the middle of an accumulation window also holds that process's partial
gradients. :mod:`accel.checkpointing` writes and reads the files; this module builds their
content and puts it back into the run.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import torch

from accel_state.imports import is_numpy_available

if TYPE_CHECKING:
    from pathlib import Path

    from .run_state import RunState

__all__ = ["collect_gradients", "restore_resume_states", "rng_state"]

# The logger of the checkpoint module, whose messages these are.
logger = logging.getLogger("accel.checkpointing")


def rng_state(run: RunState) -> dict[str, Any]:
    """Accelerate's random-state keys, plus accel's accumulation counters."""
    states: dict[str, Any] = {
        "step": run.gradient_state.step,
        "random_state": random.getstate(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if is_numpy_available():
        import numpy as np

        states["numpy_random_seed"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        states["torch_xpu_manual_seed"] = xpu.get_rng_state_all()
    states.update(run.engine.rng_states())
    states["accel_gradient_state"] = run.gradient_state.state_dict()
    states["accel_accumulator"] = run.accumulator.state_dict()
    return states


def collect_gradients(run: RunState) -> dict[str, torch.Tensor]:
    """The partial gradients of an open accumulation window, by ``<model index>.<name>``."""
    layout = run.engine.checkpoint_layout()
    if layout is not None:
        return dict(layout.pending_gradients(run.models))
    grads: dict[str, torch.Tensor] = {}
    for index, model in enumerate(run.models):
        for name, param in model.named_parameters():
            if param.grad is not None:
                grads[f"{index}.{name}"] = param.grad.detach().contiguous()
    return grads


def restore_resume_states(
    run: RunState,
    rng: dict[str, Any] | None,
    grads: dict[str, torch.Tensor] | None,
    rng_path: Path,
) -> dict[str, Any]:
    """Put the saved gradients, random states and counters back; return the overrides.

    Args:
        run: The run to restore.
        rng: The content of this process's random-state file, or ``None`` when it is missing
            (a warning naming ``rng_path`` is logged and the random states stay as they are).
        grads: The saved partial gradients, or ``None``: then every gradient is cleared.
        rng_path: The random-state file, for the warning.

    Returns:
        The attributes the caller sets on the run: ``{"step": ...}`` when ``rng`` is given.
    """
    _restore_gradients(run, grads)
    if rng is None:
        logger.warning(f"{rng_path} is missing: random states were not restored")
        return {}
    _restore_rng(rng, run)
    run.engine.restore_rng_states(rng)
    saved = rng.get("accel_accumulator")
    if isinstance(saved, dict):
        run.accumulator.load_state_dict(saved, device=run.device)
    return {"step": int(rng.get("step", 0))}


def _restore_gradients(run: RunState, grads: dict[str, torch.Tensor] | None) -> None:
    layout = run.engine.checkpoint_layout()
    if layout is not None:
        layout.restore_pending_gradients(run.models, grads)
        return
    for index, model in enumerate(run.models):
        for name, param in model.named_parameters():
            key = f"{index}.{name}"
            if grads is not None and key in grads:
                param.grad = grads[key].to(device=param.device, dtype=param.dtype).clone()
            else:
                param.grad = None


def _restore_rng(states: dict[str, Any], run: RunState) -> None:
    try:
        random.setstate(states["random_state"])
        torch.set_rng_state(states["torch_manual_seed"])
        if "numpy_random_seed" in states and is_numpy_available():
            import numpy as np

            np.random.set_state(states["numpy_random_seed"])
        if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
        xpu = getattr(torch, "xpu", None)
        if "torch_xpu_manual_seed" in states and xpu is not None and xpu.is_available():
            xpu.set_rng_state_all(states["torch_xpu_manual_seed"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        logger.warning(f"could not restore the random states: {error}")
    counters = states.get("accel_gradient_state")
    if isinstance(counters, dict):
        run.gradient_state.load_state_dict(counters)
