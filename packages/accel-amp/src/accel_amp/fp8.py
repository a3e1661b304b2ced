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

__all__ = [
    "AORecipeKwargs",
    "FP8Backend",
    "FP8RecipeKwargs",
    "MSAMPRecipeKwargs",
    "TERecipeKwargs",
    "convert_model_to_fp8",
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
    "has_transformer_engine_layers",
    "resolve_fp8_backend",
]

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


class _Refused(KwargsHandler):
    """An FP8 recipe of a backend accel does not drive: building one says so."""

    _backend = ""

    def __post_init__(self) -> None:
        raise ValueError(
            f"{type(self).__name__}: accel drives FP8 through torchao only, not "
            f"{self._backend}; use AORecipeKwargs with mixed_precision='fp8' ({_INSTALL})"
        )


@dataclasses.dataclass
class TERecipeKwargs(_Refused):
    """Accelerate's Transformer Engine recipe (fields kept); building one raises ValueError."""

    _backend = "Transformer Engine"
    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None


@dataclasses.dataclass
class MSAMPRecipeKwargs(_Refused):
    """Accelerate's MS-AMP recipe (fields kept); building one raises ValueError."""

    _backend = "MS-AMP"
    opt_level: str | None = None


@dataclasses.dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Accelerate's deprecated TE / MS-AMP recipe (fields kept); building one raises ValueError."""

    _backend = "Transformer Engine or MS-AMP"
    backend: str | None = None


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The qualified names of ``model``'s first and last ``nn.Linear`` (None when it has none)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """Whether ``module`` (named ``fqn``) may become float8.

    Not when ``fqn`` is listed, nor for a linear whose dimensions are not multiples of 16
    (float8 matmuls need that).
    """
    if fqn in layers_to_filter:
        return False
    if isinstance(module, torch.nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """Accelerate's filter that looks for the first and last linear inside ``module`` itself.

    Called with one candidate layer at a time (as torchao does), it finds nothing to skip; the
    model-level default of :func:`convert_model_to_fp8_ao` skips the model's first and last
    linears instead.
    """
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, [name for name in (first, last) if name is not None])


def _default_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    edges = [name for name in find_first_last_linear_layers(model) if name is not None]

    def keep(module: torch.nn.Module, name: str) -> bool:
        return filter_linear_layers(module, name, edges)

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


def convert_model_to_fp8_ao(
    model: torch.nn.Module,
    config: Any = None,
    module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None,
) -> torch.nn.Module:
    """Accelerate's name: :func:`convert_model_to_fp8` with a torchao config and filter.

    Without ``module_filter_func`` every ``nn.Linear`` except the model's first and last (and
    those whose dimensions are not multiples of 16) becomes a torchao ``Float8Linear``.

    Raises:
        ImportError: torchao is not installed.
    """
    return convert_model_to_fp8(
        model, AORecipeKwargs(config=config, module_filter_func=module_filter_func)
    )


def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds torchao float8 linears.

    Raises:
        ImportError: torchao is not installed.
    """
    resolve_fp8_backend("AO")
    float8_linear = importlib.import_module("torchao.float8.float8_linear")
    return any(isinstance(module, float8_linear.Float8Linear) for module in model.modules())


def has_transformer_engine_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds Transformer Engine layers (accel never converts to them).

    False without Transformer Engine installed.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    te = importlib.import_module("transformer_engine.pytorch")
    kinds = tuple(getattr(te, name) for name in ("LayerNorm", "Linear", "TransformerLayer"))
    return any(isinstance(module, kinds) for module in model.modules())
