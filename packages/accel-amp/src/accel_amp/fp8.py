"""FP8 training through torchao: backend detection, the recipe, and the model conversion.

``mixed_precision="fp8"`` swaps eligible ``nn.Linear`` layers for torchao's float8 linears
(the rest of the model autocasts to bfloat16). torchao is optional: without it, asking for
fp8 raises an ImportError with the install command. Transformer Engine and MS-AMP, which
Accelerate also drives, are not supported by accel; asking for them is a clear error.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, Literal

import torch

from accel_state.kwargs import KwargsHandler

__all__ = ["AORecipeKwargs", "FP8Backend", "convert_model_to_fp8", "resolve_fp8_backend"]

FP8Backend = Literal["AO"]
_INSTALL = 'pip install "accel-amp[fp8]"  (installs torchao)'
_UNSUPPORTED = {"TE": "Transformer Engine", "MSAMP": "MS-AMP"}


def resolve_fp8_backend(backend: str | None = None) -> FP8Backend:
    """Return the FP8 backend to use.

    Args:
        backend: ``"AO"`` (torchao) or ``None`` to use torchao when it is installed.

    Raises:
        ImportError: torchao is not installed; the message gives the pip command.
        ValueError: ``backend`` names a backend accel does not drive.
    """
    name = (backend or "AO").upper()
    if name in _UNSUPPORTED:
        raise ValueError(
            f"fp8_backend={backend!r}: accel drives FP8 through torchao only, not "
            f"{_UNSUPPORTED[name]}; use fp8_backend='AO' ({_INSTALL})"
        )
    if name != "AO":
        raise ValueError(f"fp8_backend={backend!r} is not an FP8 backend: use 'AO' (torchao)")
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            "mixed_precision='fp8' needs an FP8 backend and none is installed: "
            f"{_INSTALL}, or choose mixed_precision='bf16'"
        )
    return "AO"


@dataclasses.dataclass
class AORecipeKwargs(KwargsHandler):
    """How torchao converts a model to float8 training.

    Args:
        config: A ``torchao.float8.Float8LinearConfig``; ``None`` uses torchao's default
            (dynamic tensor-wise scaling).
        module_filter_func: ``(module, fully_qualified_name) -> bool`` choosing which linears
            to convert; ``None`` converts every ``nn.Linear`` except the first and the last and
            those whose dimensions are not multiples of 16 (float8 matmuls need that).
    """

    config: Any = None
    module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None


def _default_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    linears = [
        name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
    ]
    edges = {linears[0], linears[-1]} if linears else set()

    def keep(module: torch.nn.Module, name: str) -> bool:
        if name in edges:
            return False
        if isinstance(module, torch.nn.Linear):
            return module.in_features % 16 == 0 and module.out_features % 16 == 0
        return True

    return keep


def convert_model_to_fp8(
    model: torch.nn.Module, recipe: AORecipeKwargs | None = None
) -> torch.nn.Module:
    """Swap ``model``'s eligible linears for torchao float8 linears, in place; return it.

    Raises:
        ImportError: torchao is not installed.
    """
    resolve_fp8_backend("AO")
    float8 = importlib.import_module("torchao.float8")
    recipe = recipe if recipe is not None else AORecipeKwargs()
    keep = recipe.module_filter_func or _default_filter(model)
    converted: torch.nn.Module = float8.convert_to_float8_training(
        model, module_filter_fn=keep, config=recipe.config
    )
    return converted
