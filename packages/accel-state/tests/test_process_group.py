"""Joining the process group under torchelastic restarts: the per-attempt generation handshake.

The handshake runs here with threads sharing one in-memory store, seeded with the keys an
earlier attempt would have left behind; one real gloo group of one process checks the path
through ``init_process_group``.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from accel_state import ProcessTopology, get_process_topology, process_group
from accel_state.process_group import _restartable, agree_on_generation, init_process_group

SHORT = timedelta(seconds=20)


def _run_ranks(store: dist.Store, world_size: int, timeout: timedelta = SHORT) -> list[object]:
    results: list[object] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = agree_on_generation(store, rank, world_size, timeout)
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout.total_seconds() + 10)
    return results


def test_all_ranks_agree_on_one_fresh_generation() -> None:
    store = dist.HashStore()
    first = _run_ranks(store, 4)
    assert all(isinstance(item, str) and item == first[0] for item in first), first
    second = _run_ranks(store, 4)  # the same store, as torchrun keeps it across restarts
    assert all(item == second[0] for item in second), second
    assert second[0] != first[0]


def test_keys_left_by_an_earlier_attempt_are_not_taken_for_new_ones() -> None:
    store = dist.HashStore()
    # What a dead attempt leaves: its tokens, rank 0's answers and the confirmations.
    for peer in (1, 2):
        store.set(f"accel/generation/join/{peer}", f"old-token-{peer}")
        store.set(f"accel/generation/ack/{peer}", f"old-token-{peer}:old-generation")
        store.set(f"accel/generation/confirm/{peer}", "old-generation")
    results = _run_ranks(store, 3)
    assert results[0] != "old-generation"
    assert all(item == results[0] for item in results), results


def test_a_late_rank_zero_still_answers_the_fresh_tokens() -> None:
    store = dist.HashStore()
    store.set("accel/generation/ack/1", "stale:old-generation")
    results: dict[int, object] = {}

    def peer() -> None:
        results[1] = agree_on_generation(store, 1, 2, SHORT)

    thread = threading.Thread(target=peer)
    thread.start()
    thread.join(timeout=0.3)
    assert thread.is_alive()  # the stale answer was not accepted
    results[0] = agree_on_generation(store, 0, 2, SHORT)
    thread.join(timeout=10)
    assert results[0] == results[1] != "old-generation"


def test_missing_ranks_time_out_with_their_names() -> None:
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\]"):
        agree_on_generation(store, 0, 3, timedelta(seconds=0.2))
    with pytest.raises(TimeoutError, match="rank 1 waited .* rank 0"):
        agree_on_generation(dist.HashStore(), 1, 2, timedelta(seconds=0.2))


def _topology(max_restarts: int) -> ProcessTopology:
    return ProcessTopology(0, 2, 0, 2, 1, "127.0.0.1", 29500, "torchrun", 0, max_restarts)


@pytest.mark.parametrize(
    ("max_restarts", "init_method", "kwargs", "expected"),
    [
        (0, None, {}, False),
        (1, None, {}, True),
        (1, "env://", {}, True),
        (1, "tcp://127.0.0.1:1234", {}, False),
        (1, None, {"store": object()}, False),
    ],
    ids=["no-restarts", "restarts", "env-url", "tcp-url", "own-store"],
)
def test_only_env_rendezvous_with_restarts_uses_the_handshake(
    max_restarts: int, init_method: str | None, kwargs: dict[str, object], expected: bool
) -> None:
    assert _restartable(_topology(max_restarts), init_method, kwargs) is expected


def test_topology_reads_the_restart_variables() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    topo = get_process_topology(environ=env)
    assert (topo.restart_count, topo.max_restarts) == (2, 3)
    slurm = get_process_topology(environ={"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert (slurm.restart_count, slurm.max_restarts) == (0, 0)
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT=-1"):
        get_process_topology(environ={**env, "TORCHELASTIC_RESTART_COUNT": "-1"})


def test_a_restartable_group_is_built_on_a_prefixed_store(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for name, value in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        monkeypatch.setenv(name, str(value))  # what the group exports, removed after the test
    seen: dict[str, object] = {}
    real_agree = process_group.agree_on_generation
    real_init = dist.init_process_group

    def agree(*args: object) -> str:
        seen["generation"] = real_agree(*args)  # type: ignore[arg-type]
        return str(seen["generation"])

    def init(**kwargs: object) -> None:
        seen.update(kwargs)
        real_init(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(process_group, "agree_on_generation", agree)
    monkeypatch.setattr(dist, "init_process_group", init)
    topology = ProcessTopology(0, 1, 0, 1, 1, "127.0.0.1", port, "torchrun", 1, 1)
    init_process_group(topology, "gloo", timedelta(seconds=30))
    assert dist.is_initialized() and "init_method" not in seen
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    assert tensor.item() == 1.0
    store = seen["store"]
    assert isinstance(store, dist.PrefixStore)
    store.set("probe", "1")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert client.check([f"accel/generation/{seen['generation']}/probe"])
