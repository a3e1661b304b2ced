"""ZeRO-Offload's CPU optimizers: the DeepSpeed class that stands for a torch optimizer.

With ``offload_optimizer: {"device": "cpu"}`` DeepSpeed steps the optimizer on the CPU and,
unless the config says ``"zero_force_ds_cpu_optimizer": false``, insists on one of its own
vectorised CPU optimizers. :func:`map_pytorch_optim_to_deepspeed` (Accelerate's name and
behaviour) builds that optimizer from a torch (or bitsandbytes) one:

* ``torch.optim.Adagrad`` (or a 32-bit bitsandbytes ``Adagrad``) becomes
  ``DeepSpeedCPUAdagrad``;
* a 32-bit bitsandbytes ``Lion`` becomes ``DeepSpeedCPULion``;
* anything else becomes ``DeepSpeedCPUAdam``, in AdamW mode (decoupled weight decay) for
  ``torch.optim.AdamW`` and a 32-bit bitsandbytes ``AdamW``, in Adam mode (L2 penalty)
  otherwise.

The new optimizer is built over the same ``param_groups`` (the very dicts), so each group keeps
its own settings (``betas``, ``eps``, ...) and a scheduler made on the torch optimizer still
drives its learning rate; the optimizer's default ``lr`` and ``weight_decay`` are passed on.
Accelerate also passes ``adamw_mode`` to the Adagrad and Lion classes, which do not take it
(a ``TypeError``); here only ``DeepSpeedCPUAdam`` gets it.

DeepSpeed's CPU optimizers JIT-compile a C++ op when built (a minute the first time), so this
module imports DeepSpeed only inside the function.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["map_pytorch_optim_to_deepspeed"]


def _bitsandbytes_kind(optimizer: Any) -> tuple[str, bool] | None:
    """``(family, 32-bit)`` of a bitsandbytes optimizer; None for any other optimizer.

    Only an optimizer whose class comes from bitsandbytes makes this import bitsandbytes.
    """
    if not type(optimizer).__module__.startswith("bitsandbytes"):
        return None
    import bitsandbytes.optim as bnb_optim

    families = {
        "adamw": ("AdamW", "AdamW32bit"),
        "adagrad": ("Adagrad", "Adagrad32bit"),
        "lion": ("Lion", "Lion32bit"),
    }
    for family, names in families.items():
        classes = tuple(getattr(bnb_optim, name) for name in names if hasattr(bnb_optim, name))
        if classes and isinstance(optimizer, classes):
            bits = getattr(optimizer, "optim_bits", None)
            if bits is None:
                bits = getattr(getattr(optimizer, "args", None), "optim_bits", None)
            return family, bits == 32
    return None


def map_pytorch_optim_to_deepspeed(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's CPU optimizer (``deepspeed.ops``) standing for ``optimizer`` (ZeRO-Offload).

    See the module docstring for the class chosen. Building it JIT-compiles DeepSpeed's CPU
    op the first time.

    Args:
        optimizer: A torch optimizer (or a bitsandbytes one) over the model's parameters.

    Returns:
        A ``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad`` or ``DeepSpeedCPULion`` over the same
        parameter groups.

    Raises:
        TypeError: ``optimizer`` is not an optimizer (it has no ``param_groups``).
        ImportError: DeepSpeed is not installed (the message has the install command).
    """
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "defaults"):
        raise TypeError(
            f"map_pytorch_optim_to_deepspeed(optimizer={optimizer!r}): pass a torch optimizer "
            "(such as torch.optim.AdamW(model.parameters()))"
        )
    from .deepspeed import import_deepspeed

    import_deepspeed()  # the install command when it is missing
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    kind = _bitsandbytes_kind(optimizer)
    if isinstance(optimizer, torch.optim.Adagrad) or kind == ("adagrad", True):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(optimizer.param_groups, **kwargs)
    if kind == ("lion", True):
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(optimizer.param_groups, **kwargs)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    adamw = isinstance(optimizer, torch.optim.AdamW) or kind == ("adamw", True)
    return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=adamw, **kwargs)
