"""Device helpers that can be checked without an accelerator."""

from __future__ import annotations

import pytest
import torch

from accel_state.devices import (
    backend_for_device_type,
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
