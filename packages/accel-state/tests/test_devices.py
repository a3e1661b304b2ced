"""Device helpers that can be checked without an accelerator."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accel_state import devices
from accel_state.devices import (
    backend_for_device_type,
    clear_device_cache,
    parse_cpu_list,
    parse_device,
    pin_to_numa_node_of,
)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list("0-x")


def test_pinning_ignores_non_cuda_devices() -> None:
    assert pin_to_numa_node_of(torch.device("cpu")) is None


def test_backend_choice_and_refusals() -> None:
    assert backend_for_device_type("cpu") == "gloo"
    assert backend_for_device_type("cuda") == "nccl"
    assert backend_for_device_type("cpu", "mpi") == "mpi"
    with pytest.raises(ValueError, match=r"backend='nccl' cannot run on device type 'cpu'.*'gloo'"):
        backend_for_device_type("cpu", "nccl")
    with pytest.raises(ValueError, match="pass cpu=True"):
        backend_for_device_type("mps")


def test_parse_device_names_the_source() -> None:
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="ACCEL_TORCH_DEVICE='gpu0'"):
        parse_device("gpu0")


def test_clear_device_cache_on_cpu_runs_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[bool] = []

    def fake_collect(*args: Any) -> int:
        collected.append(True)
        return 0

    monkeypatch.setattr(devices.gc, "collect", fake_collect)
    clear_device_cache()
    assert collected == []
    clear_device_cache(garbage_collection=True)
    assert collected == [True]


def test_clear_device_cache_empties_cuda_only_when_initialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emptied: list[bool] = []
    monkeypatch.setattr(devices, "is_cuda_available", lambda: True)
    monkeypatch.setattr(devices, "is_xpu_available", lambda: False)
    monkeypatch.setattr(devices, "is_npu_available", lambda: False)
    monkeypatch.setattr(devices, "is_mps_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    clear_device_cache()
    assert emptied == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    clear_device_cache()
    assert emptied == [True]
