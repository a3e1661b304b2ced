"""Memory budgets: get_max_memory (measured and given) and get_balanced_memory."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from accel_bigmodel import memory
from accel_bigmodel.memory import get_balanced_memory, get_max_memory


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 10)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[int, Any]:
    """Two fake CUDA devices with 1000 and 2000 free bytes (device 1 'integrated' when asked)."""
    devices: dict[int, Any] = {0: 1000, 1: 2000, "integrated": False}
    monkeypatch.setattr(memory, "is_npu_available", lambda: False)
    monkeypatch.setattr(memory, "is_xpu_available", lambda: False)
    monkeypatch.setattr(memory, "is_mps_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (devices[i], 10 * devices[i]))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(is_integrated=devices["integrated"] and i == 1),
    )
    monkeypatch.setattr(memory, "_touch_device", lambda device: None)
    return devices


def test_measured_memory_on_this_machine() -> None:
    budget = get_max_memory()
    assert "cpu" in budget or "mps" in budget
    assert all(value > 0 for value in budget.values())
    assert list(budget)[-1] in ("cpu", "mps")


def test_measured_memory_with_gpus(fake_cuda: dict[int, Any]) -> None:
    budget = get_max_memory()
    assert list(budget) == [0, 1, "cpu"]
    assert budget[0] == 1000
    assert budget[1] == 2000
    assert budget["cpu"] > 0


def test_measured_memory_skips_broken_devices(
    fake_cuda: dict[int, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def touch(device: torch.device) -> None:
        if device.index == 0:
            raise RuntimeError("device 0 is broken")

    monkeypatch.setattr(memory, "_touch_device", touch)
    assert list(get_max_memory()) == [1, "cpu"]


def test_measured_memory_integrated_gpu_has_no_cpu_budget(fake_cuda: dict[int, Any]) -> None:
    fake_cuda["integrated"] = True
    assert list(get_max_memory()) == [0, 1]


def test_measured_memory_mps_replaces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "is_npu_available", lambda: False)
    monkeypatch.setattr(memory, "is_xpu_available", lambda: False)
    monkeypatch.setattr(memory, "is_mps_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1234))
    assert get_max_memory() == {"mps": 1234}


def test_given_memory_is_converted_and_ordered(caplog: pytest.LogCaptureFixture) -> None:
    given: dict[int | str, int | float | str] = {
        "disk": "1000GB",
        "cpu": "2GiB",
        1: "10KB",
        0: 300,
        "mps": 5.5,
    }
    with caplog.at_level(logging.WARNING, logger="accel_bigmodel.memory"):
        budget = get_max_memory(given)
    assert budget == {0: 300, 1: 10_000, "mps": 5.5, "cpu": 2 * 2**30, "disk": 10**12}
    assert list(budget) == [0, 1, "mps", "cpu", "disk"]
    # As in Accelerate, the caller's size strings become bytes (transformers relies on it).
    assert given == {"disk": 10**12, "cpu": 2 * 2**30, 1: 10_000, 0: 300, "mps": 5.5}
    if torch.cuda.device_count() < 2:
        assert "which this machine does not have" in caplog.text


def test_given_memory_empty_dict_stays_empty() -> None:
    assert get_max_memory({}) == {}


@pytest.mark.parametrize("key", ["cuda:0", "gpu", torch.device("cpu"), True, 1.0])
def test_given_memory_unknown_keys(key: Any) -> None:
    with pytest.raises(ValueError, match="integers for accelerator indexes") as raised:
        get_max_memory({key: 100})
    assert repr(key) in str(raised.value)


def test_given_memory_bad_values() -> None:
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\]: size='lots'"):
        get_max_memory({"cpu": "lots"})
    refused: dict[int | str, Any] = {0: "1GB", "cpu": "lots"}
    with pytest.raises(ValueError):
        get_max_memory(refused)
    assert refused == {0: "1GB", "cpu": "lots"}  # nothing converted when a value is refused
    with pytest.raises(TypeError, match=r"max_memory\[0\]=None"):
        get_max_memory({0: None})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="max_memory=.*has type list"):
        get_max_memory([100])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "balanced", "low_zero"),
    [
        ({0: 200, 1: 200}, {0: 200, 1: 200}, {0: 36, 1: 200}),
        ({0: 300, 1: 300}, {0: 215, 1: 300}, {0: 0, 1: 300}),
        ({0: 300, 1: 500}, {0: 215, 1: 500}, {0: 0, 1: 500}),
        ({0: 300, "cpu": 1000}, {0: 300, "cpu": 1000}, {0: 300, "cpu": 1000}),
        ({0: 0, 1: 300, 2: 300}, {0: 0, 1: 215, 2: 300}, {0: 0, 1: 300, 2: 300}),
        ({0: 0, "cpu": 100}, {0: 0, "cpu": 100}, {0: 0, "cpu": 100}),
        ({0: 300, 1: 300, 2: 300}, {0: 175, 1: 175, 2: 300}, {0: 0, 1: 215, 2: 300}),
        ({"cpu": 1000}, {"cpu": 1000}, {"cpu": 1000}),
        ({0: "300KB", 1: "1GB"}, {0: 215, 1: 10**9}, {0: 0, 1: 10**9}),
    ],
)
def test_balanced_memory(
    given: dict[int | str, Any],
    balanced: dict[int | str, int],
    low_zero: dict[int | str, int],
    model_for_test: type[nn.Module],
) -> None:
    model = model_for_test()
    assert get_balanced_memory(model, dict(given)) == balanced
    assert get_balanced_memory(model, dict(given), low_zero=True) == low_zero


def test_balanced_memory_non_contiguous_gpus(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    assert get_balanced_memory(model, {0: 200, 2: 200}) == {0: 200, 2: 200}
    # GPU 2 plays the part GPU 1 plays in {0: 200, 1: 200} (Accelerate raises KeyError).
    assert get_balanced_memory(model, {0: 200, 2: 200}, low_zero=True) == {0: 36, 2: 200}


def test_balanced_memory_with_disk_key(model_for_test: type[nn.Module]) -> None:
    # Accelerate 1.15 raises RuntimeError here (it parses "disk" as a torch device).
    model = model_for_test()
    assert get_balanced_memory(model, {0: 300, 1: 300, "cpu": 10, "disk": 10}) == {
        0: 215,
        1: 300,
        "cpu": 10,
        "disk": 10,
    }


def test_balanced_memory_low_zero_needs_gpu_zero(model_for_test: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match="no GPU 0"):
        get_balanced_memory(model_for_test(), {1: 300, 2: 300}, low_zero=True)


def test_balanced_memory_no_split_margin() -> None:
    model = Stack()
    # total = 320 + 3 * 2 * 288 + 360 = 2408; 3 GPUs -> 802 each before the margin.
    # Last-level modules: embed 320, 6 linears of 288, head 360 -> mean 301; margin 376.
    assert get_balanced_memory(model, {0: 5000, 1: 5000, 2: 5000}) == {
        0: 802 + 376,
        1: 802 + 376,
        2: 5000,
    }
    # A Block (576) is larger than the mean: margin 1.25 * 576 = 720.
    budget = get_balanced_memory(
        model, {0: 5000, 1: 5000, 2: 5000}, no_split_module_classes=["Block", "Missing"]
    )
    assert budget == {0: 802 + 720, 1: 802 + 720, 2: 5000}
    assert get_balanced_memory(
        model, {0: 5000, 1: 5000, 2: 5000}, no_split_module_classes="Block"
    ) == (budget)


def test_balanced_memory_dtype(model_for_test: type[nn.Module]) -> None:
    model = model_for_test()
    # total 122 (num_batches_tracked stays int64) -> 61 per GPU, margin int(1.25 * 40) = 50.
    assert get_balanced_memory(model, {0: 300, 1: 300}, dtype=torch.float16) == {0: 111, 1: 300}


def test_balanced_memory_single_measured_gpu_keeps_ten_percent(
    fake_cuda: dict[int, Any], monkeypatch: pytest.MonkeyPatch, model_for_test: type[nn.Module]
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    budget = get_balanced_memory(model_for_test())
    assert budget[0] == pytest.approx(900)
    assert "cpu" in budget
    # A given budget is used as it is (low_zero is ignored with one GPU).
    assert get_balanced_memory(model_for_test(), {0: 1000, "cpu": 50}, low_zero=True) == {
        0: 1000,
        "cpu": 50,
    }


def test_balanced_memory_converts_the_callers_sizes(model_for_test: type[nn.Module]) -> None:
    # Accelerate's get_balanced_memory converts through get_max_memory, in place.
    given: dict[int | str, int | str] = {0: 300, 1: "300KB"}
    get_balanced_memory(model_for_test(), given)
    assert given == {0: 300, 1: 300_000}


def test_importing_the_package_does_not_import_psutil() -> None:
    # psutil (~85 ms) is imported when free memory is first measured, not by `import`.
    check = "import accel_bigmodel, sys; assert 'psutil' not in sys.modules, 'psutil imported'"
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
