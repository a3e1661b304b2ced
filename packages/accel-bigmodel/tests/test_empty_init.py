"""init_empty_weights / init_on_device: parameters created on meta (or a device), cheaply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from accel_bigmodel.empty_init import init_empty_weights, init_on_device


class TaggedParameter(nn.Parameter):
    """A Parameter subclass (like bitsandbytes' or torchao's) whose class must survive."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        return super().__new__(cls, data, requires_grad)


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("stats", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        tagged = TaggedParameter(torch.ones(2))
        tagged.quant_state = "nf4"  # type: ignore[attr-defined]
        self.tagged = tagged


def test_parameters_on_meta_buffers_kept() -> None:
    with init_empty_weights():
        model = WithBuffers()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.stats.device.type == "cpu" and torch.equal(model.stats, torch.ones(4))
    assert model.cache.device.type == "cpu"


def test_include_buffers() -> None:
    with init_empty_weights(include_buffers=True):
        model = WithBuffers()
        inside = torch.ones(1)
    assert model.stats.device.type == "meta" and model.cache.device.type == "meta"
    assert inside.device.type == "meta"
    assert torch.ones(1).device.type == "cpu"


def test_include_buffers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        model = WithBuffers()
    assert model.stats.device.type == "meta"
    with init_empty_weights(include_buffers=False):
        model = WithBuffers()
    assert model.stats.device.type == "cpu"


def test_parameter_class_attributes_and_requires_grad_are_kept() -> None:
    with init_empty_weights():
        model = WithBuffers()
    assert type(model.tagged) is TaggedParameter
    assert model.tagged.quant_state == "nf4"  # type: ignore[attr-defined]
    assert model.tagged.device.type == "meta"
    assert not model.frozen.requires_grad
    assert model.linear.weight.requires_grad
    assert type(model.linear.weight) is nn.Parameter


def test_init_on_device_cpu_and_torch_device() -> None:
    with init_on_device("cpu"):
        model = nn.Linear(2, 2)
    assert model.weight.device.type == "cpu"
    with init_on_device(torch.device("meta")):
        model = nn.Linear(2, 2)
    assert model.weight.device.type == "meta"


def test_patch_is_restored_even_when_the_block_raises() -> None:
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="inside"):
        with init_empty_weights():
            nn.Linear(2, 2)
            raise RuntimeError("inside")
    assert nn.Module.register_parameter is original
    assert nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(RuntimeError, match="inside"):
        with init_empty_weights(include_buffers=True):
            raise RuntimeError("inside")
    assert torch.ones(1).device.type == "cpu"


def test_nested_blocks_restore_in_order() -> None:
    original = nn.Module.register_parameter
    with init_empty_weights():
        with init_empty_weights():
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
    assert inner.weight.device.type == "meta" and outer.weight.device.type == "meta"
    assert nn.Module.register_parameter is original
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_bad_devices() -> None:
    with pytest.raises(ValueError, match="device='disk'"):
        with init_on_device("disk"):
            pass
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        with init_on_device("gpu"):
            pass
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_registering_none_parameters() -> None:
    with init_empty_weights():
        model = nn.Linear(2, 2, bias=False)
    assert model.bias is None


def test_ties_made_in_init_survive() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 3)
            self.head = nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight

    with init_empty_weights():
        model = Tied()
    assert model.head.weight is model.embed.weight
