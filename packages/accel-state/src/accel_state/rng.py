"""Random number generators: seeding every library at once and keeping ranks in step.

``set_seed`` seeds Python's ``random``, numpy (when installed) and torch on every device.
``synchronize_rng_state(s)`` copies rank 0's generator state to every process, which is how
the samplers of all ranks shuffle identically.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable

import torch

from .enums import RNGType
from .imports import is_cuda_available, is_numpy_available, is_xpu_available
from .process_group import collective_failure
from .state import TORCH_DISTRIBUTED_TYPES, PartialState

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, numpy and torch (all devices) for reproducible runs.

    Args:
        seed: The seed.
        device_specific: Add the process index to the seed, so that each process draws
            different numbers.
        deterministic: Also ask torch for deterministic algorithms (slower; some operations
            then raise instead of running nondeterministically).

    Raises:
        TypeError: ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed(seed={seed!r}): the seed must be an int")
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    if is_numpy_available():
        import numpy as np

        np.random.seed(seed % 2**32)
    # Seeds the CPU generator and the default generator of every initialised device type.
    torch.manual_seed(seed)
    if is_cuda_available():
        torch.cuda.manual_seed_all(seed)
    if is_xpu_available():
        torch.xpu.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _get_state(rng_type: RNGType, generator: torch.Generator | None) -> torch.Tensor:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.CUDA:
        return torch.cuda.get_rng_state()
    if rng_type == RNGType.XPU:
        return torch.xpu.get_rng_state()
    if rng_type == RNGType.GENERATOR:
        if generator is None:
            raise ValueError(
                "synchronize_rng_state(rng_type='generator') needs the generator: pass "
                "generator=<torch.Generator>"
            )
        return generator.get_state()
    module = getattr(torch, str(rng_type.value), None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise ValueError(
            f"rng_type={rng_type.value!r} is not available in this torch build: use one of "
            "'torch', 'cuda', 'xpu' or 'generator'"
        )
    return module.get_rng_state()


def _set_state(rng_type: RNGType, state: torch.Tensor, generator: torch.Generator | None) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.CUDA:
        torch.cuda.set_rng_state(state)
    elif rng_type == RNGType.XPU:
        torch.xpu.set_rng_state(state)
    elif rng_type == RNGType.GENERATOR:
        assert generator is not None
        generator.set_state(state)
    else:
        getattr(torch, str(rng_type.value)).set_rng_state(state)


def synchronize_rng_state(
    rng_type: RNGType | str | None = None, generator: torch.Generator | None = None
) -> None:
    """Copy the main process's state of one random generator to every process.

    Args:
        rng_type: ``"torch"`` (default), ``"cuda"``, ``"xpu"``, other device names, or
            ``"generator"`` together with ``generator``.
        generator: The generator to synchronise when ``rng_type="generator"``.

    Raises:
        ValueError: ``rng_type`` is unknown, or ``"generator"`` comes without a generator.
        DistributedOperationException: the broadcast failed or timed out.
    """
    kind = RNGType(rng_type if rng_type is not None else RNGType.TORCH)
    state = PartialState()
    rng_state = _get_state(kind, generator)
    if state.distributed_type in TORCH_DISTRIBUTED_TYPES and state.num_processes > 1:
        # nccl only moves device tensors; gloo moves CPU ones.
        on_device = state.backend not in ("gloo", "mpi", None)
        payload = rng_state.to(state.device) if on_device else rng_state.clone()
        try:
            torch.distributed.broadcast(payload, src=0)
        except RuntimeError as err:
            raise collective_failure("synchronize_rng_state", err) from err
        rng_state = payload.cpu()
    _set_state(kind, rng_state, generator)


def synchronize_rng_states(
    rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None
) -> None:
    """Call :func:`synchronize_rng_state` for each of ``rng_types``."""
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)
