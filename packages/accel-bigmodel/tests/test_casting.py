"""Layerwise casting: storage dtype between calls, compute dtype during the forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accel_bigmodel.casting import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    LayerwiseCastingHook,
    attach_layerwise_casting_hooks,
)
from accel_bigmodel.hooks import ModelHook, SequentialHook, add_hook_to_module

# Tiny tensors: intra-op threads only add waits (conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).transpose(1, 2)
        return self.head(self.norm(y))


def _model() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet().eval()


X = torch.randn(2, 2, 6, generator=torch.Generator().manual_seed(0))


def test_supported_layers_match_accelerate() -> None:
    assert SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING == (
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.Linear,
    )


def test_storage_and_compute_dtypes() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    for layer in (reference.conv, reference.head[0], reference.head[2]):
        for param in layer.parameters():
            param.data = param.data.to(torch.bfloat16).to(torch.float32)
    attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32)
    assert model.conv.weight.dtype == torch.bfloat16
    assert model.head[2].bias.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32  # not a supported layer
    seen: list[torch.dtype] = []
    original = model.head[0].__dict__["_old_forward"]

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(model.head[0].weight.dtype)
        return original(x)

    model.head[0].__dict__["_old_forward"] = spy
    assert torch.equal(model(X), reference(X))
    assert seen == [torch.float32]
    assert model.head[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("pattern", ["head", ["head"], ("^head",)])
def test_skip_modules_pattern(pattern: str | list[str] | tuple[str, ...]) -> None:
    model = _model()
    attach_layerwise_casting_hooks(
        model, torch.float16, torch.float32, skip_modules_pattern=pattern
    )
    assert model.conv.weight.dtype == torch.float16
    assert model.head[0].weight.dtype == torch.float32
    assert not hasattr(model.head[0], "_hf_hook")


def test_a_single_string_pattern_is_not_split_into_characters() -> None:
    model = _model()
    # Accelerate iterates over a string pattern character by character ("c" matches "conv").
    attach_layerwise_casting_hooks(model, torch.float16, torch.float32, skip_modules_pattern="cx")
    assert model.conv.weight.dtype == torch.float16


def test_skip_modules_classes() -> None:
    model = _model()
    attach_layerwise_casting_hooks(
        model, torch.float16, torch.float32, skip_modules_classes=(nn.Conv1d,)
    )
    assert model.conv.weight.dtype == torch.float32
    assert model.head[2].weight.dtype == torch.float16
    skipped_container = _model()
    attach_layerwise_casting_hooks(
        skipped_container, torch.float16, torch.float32, skip_modules_classes=(nn.Sequential,)
    )
    assert skipped_container.head[0].weight.dtype == torch.float32


def test_chains_after_an_existing_hook() -> None:
    model = _model()
    add_hook_to_module(model.head[0], ModelHook())
    attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32, non_blocking=True)
    hook = model.head[0]._hf_hook
    assert isinstance(hook, SequentialHook)
    assert isinstance(hook.hooks[1], LayerwiseCastingHook)
    assert hook.hooks[1].non_blocking
    model(X)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="storage_dtype=torch.int8 is not a floating-point"):
        attach_layerwise_casting_hooks(_model(), torch.int8, torch.float32)
    with pytest.raises(TypeError, match="compute_dtype='bf16'"):
        LayerwiseCastingHook(torch.float16, "bf16", False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_modules_pattern"):
        attach_layerwise_casting_hooks(
            _model(),
            torch.float16,
            torch.float32,
            skip_modules_pattern=[1],  # type: ignore[list-item]
        )
    with pytest.raises(TypeError, match="skip_modules_classes"):
        attach_layerwise_casting_hooks(
            _model(),
            torch.float16,
            torch.float32,
            skip_modules_classes=("Linear",),  # type: ignore[arg-type]
        )


def test_repr() -> None:
    assert repr(LayerwiseCastingHook(torch.float16, torch.float32, False)) == (
        "LayerwiseCastingHook(storage_dtype=torch.float16, compute_dtype=torch.float32, "
        "non_blocking=False)"
    )
