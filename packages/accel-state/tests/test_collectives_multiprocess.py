"""Collectives and state on 2 real gloo processes (spawned with accel_state.testing.run_on_cpu).

Each worker function runs on both ranks and returns what the test asserts on; spawning costs
a few seconds, so related checks share one run.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch

from accel_state import (
    DistributedType,
    PartialState,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    get_logger,
    pad_across_processes,
    reduce,
    synchronize_rng_state,
)
from accel_state.testing import MultiProcessError, run_on_cpu

pytestmark = pytest.mark.multiprocess

Pair = collections.namedtuple("Pair", ["first", "second"])


def _describe_state() -> dict[str, object]:
    state = PartialState()
    return {
        "type": state.distributed_type,
        "n": state.num_processes,
        "rank": state.process_index,
        "local": state.local_process_index,
        "backend": state.backend,
        "device": str(state.device),
        "main": state.is_main_process,
        "last": state.is_last_process,
        "distributed": state.use_distributed,
        "gathered": gather(torch.tensor([state.process_index])).tolist(),
    }


@pytest.mark.parametrize("topology", ["torchrun", "slurm", "openmpi", "pmi"])
def test_bare_partial_state_joins_a_gloo_group(topology: str) -> None:
    results = run_on_cpu(_describe_state, topology=topology)
    for rank, info in enumerate(results):
        assert info["type"] == DistributedType.MULTI_CPU
        assert info["n"] == 2
        assert info["rank"] == rank and info["local"] == rank
        assert info["backend"] == "gloo"
        assert info["device"] == "cpu"
        assert info["main"] == (rank == 0) and info["last"] == (rank == 1)
        assert info["distributed"] is True
        assert info["gathered"] == [0, 1]


def _gather_structures() -> dict[str, object]:
    rank = PartialState().process_index
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    nested = {
        "plain": base,
        "non_contiguous": base.t(),
        "scalar": torch.tensor(float(rank)),
        "ints": [torch.tensor([rank, rank], dtype=torch.int64)],
        "flags": (torch.tensor([rank == 0]),),
        "pair": Pair(torch.tensor([rank]), torch.tensor([[rank, -rank]])),
        "half": torch.tensor([rank], dtype=torch.bfloat16),
    }
    out = gather(nested)
    return {
        "plain": out["plain"].tolist(),
        "non_contiguous": out["non_contiguous"].tolist(),
        "scalar": out["scalar"].tolist(),
        "ints": out["ints"][0].tolist(),
        "ints_is_list": isinstance(out["ints"], list),
        "flags": out["flags"][0].tolist(),
        "flags_is_tuple": isinstance(out["flags"], tuple),
        "pair_type": type(out["pair"]).__name__,
        "pair": (out["pair"].first.tolist(), out["pair"].second.tolist()),
        "half": out["half"].float().tolist(),
        "half_dtype": str(out["half"].dtype),
    }


def test_gather_nested_structures_non_contiguous_and_0d() -> None:
    first, second = run_on_cpu(_gather_structures)
    assert first == second
    assert first["plain"] == [[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]]
    assert first["non_contiguous"] == [[0, 3], [1, 4], [2, 5], [10, 13], [11, 14], [12, 15]]
    assert first["scalar"] == [0.0, 1.0]
    assert first["ints"] == [0, 0, 1, 1] and first["ints_is_list"]
    assert first["flags"] == [True, False] and first["flags_is_tuple"]
    assert first["pair_type"] == "Pair"
    assert first["pair"] == ([0, 1], [[0, 0], [1, -1]])
    assert first["half"] == [0.0, 1.0] and first["half_dtype"] == "torch.bfloat16"


def _objects_and_broadcast() -> dict[str, object]:
    rank = PartialState().process_index
    objects = gather_object([{"rank": rank}, f"r{rank}"])
    not_lists = gather_object({"rank": rank})
    tensor = torch.full((2, 2), float(rank))
    broadcast(tensor, from_process=1)
    structure = broadcast(
        {"a": torch.tensor([rank]), "b": [torch.tensor([[rank] * 3]).t()]}, from_process=1
    )
    items = [f"from {rank}", rank]
    broadcast_object_list(items, from_process=1)
    owned = copy_tensor_to_devices(torch.tensor([7.0, 8.0]) if rank == 1 else None)
    return {
        "objects": objects,
        "not_lists": not_lists,
        "tensor": tensor.tolist(),
        "structure": (structure["a"].tolist(), structure["b"][0].tolist()),
        "items": items,
        "owned": owned.tolist(),
    }


def test_gather_object_and_broadcast_from_rank_1() -> None:
    for result in run_on_cpu(_objects_and_broadcast):
        assert result["objects"] == [{"rank": 0}, "r0", {"rank": 1}, "r1"]
        assert result["not_lists"] == [{"rank": 0}, {"rank": 1}]
        assert result["tensor"] == [[1.0, 1.0], [1.0, 1.0]]
        assert result["structure"] == ([1], [[1], [1], [1]])
        assert result["items"] == ["from 1", 1]
        assert result["owned"] == [7.0, 8.0]


def _reductions() -> dict[str, object]:
    rank = PartialState().process_index
    value = torch.tensor([1.0 + rank, 10.0 - rank])
    original = value.clone()
    result = {
        "sum": reduce(value, "sum").tolist(),
        "mean": reduce(value, "mean").tolist(),
        "max": reduce(value, "max").tolist(),
        "min": reduce(value, "min").tolist(),
        "scaled": reduce(value, "sum", scale=0.5).tolist(),
        "int_mean": reduce(torch.tensor([rank + 1]), "mean").tolist(),
        "nested": reduce({"x": [torch.tensor(float(rank))]}, "sum")["x"][0].item(),
        "untouched": torch.equal(value, original),
    }
    return result


def test_reduce_sum_mean_max() -> None:
    for result in run_on_cpu(_reductions):
        assert result["sum"] == [3.0, 19.0]
        assert result["mean"] == [1.5, 9.5]
        assert result["max"] == [2.0, 10.0]
        assert result["min"] == [1.0, 9.0]
        assert result["scaled"] == [1.5, 9.5]
        assert result["int_mean"] == [1.5]
        assert result["nested"] == 1.0
        assert result["untouched"] is True


def _padding() -> dict[str, object]:
    rank = PartialState().process_index
    tensor = torch.arange(2 + rank, dtype=torch.float32) + 1  # rank 0: [1, 2]; rank 1: [1, 2, 3]
    matrix = torch.ones(2, 1 + 2 * rank)
    return {
        "back": pad_across_processes(tensor).tolist(),
        "front": pad_across_processes(tensor, pad_index=-1, pad_first=True).tolist(),
        "dim1": pad_across_processes(matrix, dim=1, pad_index=9).tolist(),
        "missing_dim": pad_across_processes(tensor, dim=3).tolist(),
        "gathered": gather(pad_across_processes(tensor)).tolist(),
    }


def test_pad_across_processes_back_front_and_dims() -> None:
    first, second = run_on_cpu(_padding)
    assert first["back"] == [1.0, 2.0, 0.0]
    assert first["front"] == [-1.0, 1.0, 2.0]
    assert second["back"] == second["front"] == [1.0, 2.0, 3.0]
    assert first["dim1"] == [[1.0, 9.0, 9.0], [1.0, 9.0, 9.0]]
    assert second["dim1"] == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert first["missing_dim"] == [1.0, 2.0]
    assert first["gathered"] == second["gathered"] == [1.0, 2.0, 0.0, 1.0, 2.0, 3.0]


def _splits() -> dict[str, object]:
    state = PartialState()
    out: dict[str, object] = {}
    with state.split_between_processes(["A", "B", "C"]) as part:
        out["list"] = part
    with state.split_between_processes(["A", "B", "C"], apply_padding=True) as part:
        out["padded"] = part
    with state.split_between_processes({"a": [1, 2, 3, 4], "b": ["w", "x", "y", "z"]}) as part:
        out["dict"] = part
    with state.split_between_processes(torch.arange(5), apply_padding=True) as part:
        out["tensor"] = part.tolist()
    return out


def test_split_between_processes_on_two_processes() -> None:
    first, second = run_on_cpu(_splits)
    assert first["list"] == ["A", "B"] and second["list"] == ["C"]
    assert first["padded"] == ["A", "B"] and second["padded"] == ["C", "C"]
    assert first["dict"] == {"a": [1, 2], "b": ["w", "x"]}
    assert second["dict"] == {"a": [3, 4], "b": ["y", "z"]}
    assert first["tensor"] == [0, 1, 2] and second["tensor"] == [3, 4, 4]


def _ordering_and_decorators() -> dict[str, object]:
    state = PartialState()
    events: list[str] = []
    with state.main_process_first():
        events.append(f"inside {time.monotonic():.6f}")
    timestamps = gather_object([float(events[0].split()[1])])
    ran: list[str] = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=1)(lambda: ran.append("p1"))()
    state.on_local_main_process(lambda: ran.append("local main"))()
    state.on_local_process(local_process_index=1)(lambda: ran.append("local p1"))()
    state.wait_for_everyone()
    return {"main_first": timestamps[0] <= timestamps[1], "ran": ran}


def test_main_process_first_and_on_process_decorators() -> None:
    first, second = run_on_cpu(_ordering_and_decorators)
    assert first["main_first"] and second["main_first"]
    assert first["ran"] == ["main", "local main"]
    assert second["ran"] == ["last", "p1", "local p1"]


def _logging_and_rng(path: str) -> dict[str, object]:
    import logging

    state = PartialState()
    handler = logging.FileHandler(path)
    logger = get_logger("accel_state_test")
    logger.logger.addHandler(handler)
    logger.logger.setLevel(logging.INFO)
    logger.info("main only")
    logger.info("everyone", main_process_only=False)
    logger.info("ordered", in_order=True)
    handler.close()
    torch.manual_seed(state.process_index)
    synchronize_rng_state("torch")
    generator = torch.Generator().manual_seed(100 + state.process_index)
    synchronize_rng_state("generator", generator=generator)
    return {"draw": torch.rand(3).tolist(), "gen": torch.rand(2, generator=generator).tolist()}


def test_logger_and_rng_synchronisation(tmp_path) -> None:
    log = tmp_path / "log.txt"
    first, second = run_on_cpu(_logging_and_rng, str(log))
    assert first["draw"] == second["draw"]
    assert first["gen"] == second["gen"]
    lines = log.read_text().splitlines()
    assert lines.count("[RANK 0] main only") == 1 and "[RANK 1] main only" not in lines
    assert "[RANK 0] everyone" in lines and "[RANK 1] everyone" in lines
    ordered = [line for line in lines if line.endswith("ordered")]
    assert ordered == ["[RANK 0] ordered", "[RANK 1] ordered"]


def _skip_gather() -> None:
    state = PartialState()
    start = time.monotonic()
    try:
        if state.process_index == 0:
            gather(torch.ones(1000))
        else:
            state.wait_for_everyone()
    finally:
        elapsed = time.monotonic() - start
        print(f"rank {state.process_index} failed after {elapsed:.1f}s")


def test_hang_guard_rank_skipping_gather_fails_both_ranks_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as info:
        run_on_cpu(_skip_gather, collective_timeout=3.0, timeout=60.0)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert set(failures) == {0, 1}
    assert all(kind == "DistributedOperationException" for kind, _, _ in failures.values())
    assert "`gather` failed on rank 0" in failures[0][1]
    assert "`wait_for_everyone` failed on rank 1" in failures[1][1]
    assert "ACCEL_DEBUG_MODE=1" in failures[0][1]
    assert elapsed < 45, f"the guard took {elapsed:.0f}s; the timeout was 3s"


def test_debug_mode_names_the_skipped_gather_on_every_rank() -> None:
    with pytest.raises(MultiProcessError) as info:
        run_on_cpu(_skip_gather, collective_timeout=10.0, env={"ACCEL_DEBUG_MODE": "1"})
    for kind, message, _ in info.value.failures.values():
        assert kind == "DistributedOperationException"
        assert "Process 0: `gather`" in message
        assert "Process 1: `wait_for_everyone`" in message


def _mismatched_shapes() -> None:
    rank = PartialState().process_index
    gather(torch.ones(2, 3 + rank))


def test_debug_mode_reports_shapes_per_rank() -> None:
    with pytest.raises(MultiProcessError) as info:
        run_on_cpu(_mismatched_shapes, env={"ACCEL_DEBUG_MODE": "1"})
    for kind, message, _ in info.value.failures.values():
        assert kind == "DistributedOperationException"
        assert "Operation: `gather`" in message
        assert "Process 0: ((2, 3), 'float32', 'cpu')" in message
        assert "Process 1: ((2, 4), 'float32', 'cpu')" in message


def _mismatched_broadcast() -> None:
    rank = PartialState().process_index
    broadcast(torch.ones(2, 3 + rank))


def test_accelerates_debug_variable_turns_debug_mode_on() -> None:
    # A job script written for Accelerate sets ACCELERATE_DEBUG_MODE: the same checks run.
    with pytest.raises(MultiProcessError) as info:
        run_on_cpu(_mismatched_broadcast, env={"ACCELERATE_DEBUG_MODE": "1"})
    for kind, message, _ in info.value.failures.values():
        assert kind == "DistributedOperationException"
        assert "Operation: `broadcast`" in message
        assert "Process 1: ((2, 4), 'float32', 'cpu')" in message


def _raise_on_rank_1() -> int:
    rank = PartialState().process_index
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_run_on_cpu_reraises_with_the_rank() -> None:
    with pytest.raises(
        MultiProcessError, match=r"rank 1 raised ValueError: boom on purpose"
    ) as info:
        run_on_cpu(_raise_on_rank_1)
    assert set(info.value.failures) == {1}
