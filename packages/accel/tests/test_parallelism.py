"""A ``ParallelismConfig`` run in one process: every bad layout refused before any process group.

The layouts that train are tested on 2 and 4 gloo ranks in ``test_parallelism_multiprocess.py``;
here the checks against the world size (read from the launcher's variables before anything
exists) and the refusals, each naming every size, the world size and the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accel import Accelerator, ParallelismConfig
from accel.parallelism import check_parallelism_config
from accel.utils import FullyShardedDataParallelPlugin, TorchTensorParallelPlugin
from accel_state import AcceleratorState, GradientState, PartialState


def _nothing_started() -> None:
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state == {}
    assert not torch.distributed.is_initialized()


def _world(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The variables torchrun gives rank 0 of ``size`` processes (no group is created)."""
    for name, value in {
        "WORLD_SIZE": size,
        "RANK": 0,
        "LOCAL_RANK": 0,
        "LOCAL_WORLD_SIZE": size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29999,
    }.items():
        monkeypatch.setenv(name, str(value))


def test_one_process_with_a_config_has_no_mesh_and_rank_zero_everywhere() -> None:
    accelerator = Accelerator(parallelism_config=ParallelismConfig())
    assert accelerator.parallelism_config is not None
    assert accelerator.torch_device_mesh is None
    ranks = (
        accelerator.data_parallel_rank,
        accelerator.data_parallel_shard_rank,
        accelerator.tensor_parallel_rank,
        accelerator.context_parallel_rank,
    )
    assert ranks == (0, 0, 0, 0)
    with pytest.raises(NotImplementedError, match="pipeline parallelism is not supported"):
        _ = accelerator.pipeline_parallel_rank


def test_the_ranks_need_a_config() -> None:
    accelerator = Accelerator()
    assert accelerator.parallelism_config is None and accelerator.torch_device_mesh is None
    for name, what in (
        ("data_parallel_rank", "Data parallelism"),
        ("data_parallel_shard_rank", "Shard-based data parallelism"),
        ("tensor_parallel_rank", "Tensor parallelism"),
        ("context_parallel_rank", "Context parallelism"),
    ):
        with pytest.raises(RuntimeError, match=f"{what} is not configured: pass Accelerator"):
            getattr(accelerator, name)


@pytest.mark.torch_feature("fully_shard")
def test_the_sizes_must_multiply_to_the_number_of_processes() -> None:
    with pytest.raises(ValueError) as info:
        Accelerator(
            parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
            fsdp_plugin=FullyShardedDataParallelPlugin(),
        )
    message = str(info.value)
    assert "dp_replicate_size=2, dp_shard_size=2, tp_size=1, cp_size=1, sp_size=1" in message
    assert "needs 4 processes (the product of the sizes), but the run has 1" in message
    assert "make the product 1, or launch 4 processes" in message
    _nothing_started()


def test_sequence_parallelism_is_refused_before_any_group() -> None:
    with pytest.raises(NotImplementedError) as info:
        Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    message = str(info.value)
    assert "ParallelismConfig(sp_size=2) asks for sequence parallelism" in message
    assert "nothing was started" in message and "Set sp_size=1" in message
    _nothing_started()


@pytest.mark.torch_feature("context_parallel")
def test_context_parallelism_on_the_cpu_is_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _world(monkeypatch, 2)
    with pytest.raises(NotImplementedError) as info:
        Accelerator(
            cpu=True,
            parallelism_config=ParallelismConfig(cp_size=2),
            fsdp_plugin=FullyShardedDataParallelPlugin(),
        )
    message = str(info.value)
    assert "ParallelismConfig(cp_size=2) on the CPU" in message
    assert "ring attention" in message and "nothing was started" in message
    assert "Run context parallel jobs on CUDA devices, or set cp_size=1" in message
    _nothing_started()


def test_maybe_context_parallel_without_it_runs_the_block_unchanged() -> None:
    accelerator = Accelerator()
    tokens = torch.arange(8).reshape(1, 8)
    with accelerator.maybe_context_parallel(buffers=[tokens], buffer_seq_dims=[1]):
        assert tokens.shape == (1, 8)
    assert tokens.tolist() == [list(range(8))]


def test_the_old_tensor_parallel_plugin_is_tensor_parallelism() -> None:
    with (
        pytest.warns(FutureWarning, match=r"parallelism_config=ParallelismConfig\(tp_size=2\)"),
        pytest.raises(ValueError, match=r"tp_size=2.*needs 2 processes"),
    ):
        Accelerator(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    with pytest.raises(TypeError, match="expected a TorchTensorParallelPlugin"):
        Accelerator(torch_tp_plugin=object())
    with pytest.raises(ValueError, match="pass only parallelism_config"):
        Accelerator(
            torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2),
            parallelism_config=ParallelismConfig(),
        )
    with pytest.raises(TypeError, match="expected an accel.ParallelismConfig"):
        Accelerator(parallelism_config={"dp_shard_size": 2})
    _nothing_started()


def test_the_environment_asks_for_a_config_with_its_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    with pytest.raises(ValueError, match=r"dp_shard_size=2.*needs 2 processes"):
        Accelerator()
    _nothing_started()
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    assert Accelerator().parallelism_config == ParallelismConfig()


@pytest.mark.parametrize(
    ("config", "engine", "expected"),
    [
        (
            {"dp_shard_size": 2},
            {},
            "shards the model, which the FSDP2 engine does: pass fsdp_plugin=",
        ),
        (
            {"dp_replicate_size": 2},
            {"fsdp": True},
            "no dimension is left for FSDP2 to shard over (dp_shard_size and cp_size are 1). Set "
            "dp_shard_size (e.g. dp_shard_size=2)",
        ),
        ({"dp_shard_size": 2}, {"deepspeed": True}, "DeepSpeed shards by its ZeRO stage"),
        ({"tp_size": 2}, {"deepspeed": True}, "does not train accel's tensor- or context-par"),
        ({"dp_shard_size": 4}, {"fsdp": True}, "needs 4 processes"),
        (
            {"tp_size": 2},
            {"fsdp": True},
            "no dimension is left for FSDP2 to shard over (dp_shard_size and cp_size are 1). "
            "Set dp_shard_size (e.g. dp_shard_size=1)",
        ),
        (
            {"cp_size": 2},
            {},
            "ParallelismConfig(cp_size=2) splits each sequence over 2 ranks, whose gradients "
            "FSDP2 averages",
        ),
    ],
)
@pytest.mark.torch_feature("fully_shard")
def test_each_layout_the_engine_cannot_run_is_refused(
    monkeypatch: pytest.MonkeyPatch, config: dict[str, int], engine: dict[str, bool], expected: str
) -> None:
    _world(monkeypatch, 2)
    flags: dict[str, Any] = {"fsdp": False, "deepspeed": False, **engine}
    with pytest.raises(ValueError) as info:
        check_parallelism_config(ParallelismConfig(**config), **flags)  # type: ignore[arg-type]
    assert expected in str(info.value)
    _nothing_started()


def test_tensor_parallelism_beside_pure_replication_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _world(monkeypatch, 4)
    with pytest.raises(ValueError) as info:
        ParallelismConfig(dp_replicate_size=2, tp_size=2)
    message = str(info.value)
    assert "tp_size=2 / cp_size=1 cannot be combined with pure replication" in message
    assert "set dp_shard_size > 1" in message
    accepted = ParallelismConfig(dp_shard_size=2, tp_size=2)
    check_parallelism_config(accepted, fsdp=True, deepspeed=False)  # FSDP2 x TP
    check_parallelism_config(ParallelismConfig(tp_size=4), fsdp=False, deepspeed=False)


def test_every_size_one_makes_every_process_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    _world(monkeypatch, 4)
    config = ParallelismConfig()
    check_parallelism_config(config, fsdp=False, deepspeed=False)
    assert (config.dp_replicate_size, config.total_size) == (4, 4)
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    check_parallelism_config(hsdp, fsdp=True, deepspeed=False)  # accepted as given
    assert (hsdp.dp_replicate_size, hsdp.dp_shard_size) == (2, 2)


@pytest.fixture(autouse=True)
def _fresh_state() -> Any:
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
