"""``ParallelismConfig``: sizes, validation, mesh dimensions and a real mesh on 2 gloo ranks."""

from __future__ import annotations

import math
import warnings

import pytest

from accel.parallelism_config import (
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from accel_state.testing import run_on_cpu

SIZE_VARIABLES = (
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "PARALLELISM_CONFIG_TP_SIZE",
    "PARALLELISM_CONFIG_CP_SIZE",
    "PARALLELISM_CONFIG_SP_SIZE",
    "PARALLELISM_CONFIG_CP_BACKEND",
    "PARALLELISM_CONFIG_SP_BACKEND",
    "PARALLELISM_CONFIG_CP_COMM_STRATEGY",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE",
    "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION",
)


@pytest.fixture(autouse=True)
def _no_parallelism_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_one_of_everything() -> None:
    config = ParallelismConfig()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 1, 1)
    assert (config.cp_size, config.sp_size) == (1, 1)
    assert (config.cp_backend, config.sp_backend) == ("torch", "deepspeed")
    assert config.total_size == 1
    assert config._get_mesh() == ()
    assert config.build_device_mesh("cpu") is None
    assert (config.tp_handler, config.cp_handler, config.sp_handler) == (None, None, None)


@pytest.mark.parametrize(
    ("sizes", "names", "shape", "flattened"),
    [
        (
            {"dp_replicate_size": 8},
            ("dp_replicate",),
            (8,),
            {"dp": ["dp_replicate"], "dp_cp": ["dp_replicate"]},
        ),
        (
            {"dp_shard_size": 8},
            ("dp_shard",),
            (8,),
            {"dp": ["dp_shard"], "dp_shard_cp": ["dp_shard"], "dp_cp": ["dp_shard"]},
        ),
        (
            {"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
            ("dp_replicate", "dp_shard", "cp", "tp"),
            (2, 2, 2, 2),
            {
                "dp": ["dp_replicate", "dp_shard"],
                "dp_shard_cp": ["dp_shard", "cp"],
                "dp_cp": ["dp_replicate", "dp_shard", "cp"],
            },
        ),
        ({"tp_size": 4}, ("tp",), (4,), {}),
    ],
)
@pytest.mark.torch_feature("context_parallel")
def test_mesh_dimensions(
    sizes: dict[str, int],
    names: tuple[str, ...],
    shape: tuple[int, ...],
    flattened: dict[str, list[str]],
) -> None:
    config = ParallelismConfig(**sizes)  # type: ignore[arg-type]
    assert config._get_mesh() == (names, shape)
    assert config.total_size == math.prod(shape)
    got = {
        "dp": config.dp_dim_names,
        "dp_shard_cp": config.dp_shard_cp_dim_names,
        "dp_cp": config.dp_cp_dim_names,
    }
    assert {key: value for key, value in got.items() if value} == flattened
    assert config.data_parallel_size * config.non_data_parallel_size == config.total_size


def test_sizes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    config = ParallelismConfig()
    assert (config.dp_shard_size, config.tp_size) == (4, 2)
    assert isinstance(config.tp_handler, TorchTensorParallelConfig)
    assert ParallelismConfig(tp_size=1).tp_size == 1  # an argument beats the variable


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_shard_size": 0}, "dp_shard_size must be at least 1, but got 0"),
        ({"tp_size": 1.5}, r"ParallelismConfig\(tp_size=1.5\): must be an integer"),
        ({"cp_size": 2, "sp_size": 2}, "mutually exclusive: got cp_size=2 and sp_size=2"),
        ({"dp_replicate_size": 2, "tp_size": 2}, "cannot be combined with pure replication"),
        ({"cp_backend": "ring"}, "cp_backend must be one of"),
        ({"sp_backend": "ulysses"}, "sp_backend must be one of"),
        ({"tp_size": 2, "tp_handler": object()}, "expected a TorchTensorParallelConfig"),
    ],
)
def test_bad_configs_name_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelismConfig(**kwargs)  # type: ignore[arg-type]


def test_a_size_variable_that_is_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_CP_SIZE='two' is not a whole"):
        ParallelismConfig()


@pytest.mark.torch_feature("context_parallel")
def test_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TorchContextParallelConfig().cp_comm_strategy == "allgather"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    assert DeepSpeedSequenceParallelConfig().sp_seq_length_is_variable is True
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation: eager"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")
    assert (
        DeepSpeedSequenceParallelConfig(
            sp_attn_implementation="kernels-community/flash-attn2"
        ).sp_attn_implementation
        == "kernels-community/flash-attn2"
    )
    with pytest.raises(ValueError, match="needs the sequence length"):
        DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SEQ_LENGTH", "128")
    assert DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False).sp_seq_length == 128
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TorchTensorParallelConfig(enable_async_tp=True)
    assert "not supported" in str(caught[0].message)


def test_deepspeed_sequence_parallelism_builds_no_mesh() -> None:
    assert ParallelismConfig(sp_size=2).build_device_mesh("cpu") is None


@pytest.mark.torch_feature("context_parallel")
def test_to_json_is_plain_data() -> None:
    data = ParallelismConfig(cp_size=2).to_json()
    assert data["cp_size"] == 2 and data["cp_handler"] == {"cp_comm_strategy": "allgather"}
    assert "device_mesh" not in data


def test_get_device_mesh_needs_a_device_type_first() -> None:
    with pytest.raises(ValueError, match="pass the device type"):
        ParallelismConfig(dp_shard_size=2).get_device_mesh()


def _mesh_on_two_ranks(kind: str) -> dict[str, object]:
    sizes = {"dp_shard_size": 2} if kind == "shard" else {"tp_size": 2}
    config = ParallelismConfig(**sizes)  # type: ignore[arg-type]
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        mesh = config.get_device_mesh("cpu")
        assert config.get_device_mesh() is mesh
        out: dict[str, object] = {
            "names": list(mesh.mesh_dim_names),
            "shape": list(mesh.shape),
        }
        if kind == "shard":
            out["dp_shard_cp"] = mesh["dp_shard_cp"].size()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("shard", {"names": ["dp_shard"], "shape": [2], "dp_shard_cp": 2}),
        ("tp", {"names": ["tp"], "shape": [2]}),
    ],
)
def test_a_real_mesh_on_two_gloo_ranks(kind: str, expected: dict[str, object]) -> None:
    assert run_on_cpu(_mesh_on_two_ranks, kind, world_size=2, timeout=90) == [expected] * 2
