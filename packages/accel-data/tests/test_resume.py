"""Exact mid-epoch resume: state_dict() in one process, load_state_dict() in a new one.

The resuming process seeds torch differently from the saving one, so only the saved state can
put the order back. Its remaining batches of the interrupted epoch, and the epochs after, must
be exactly those of an uninterrupted run.

One process shuffling without a generator of its own draws every epoch's order from torch's
RNG, exactly as plain PyTorch does: the loader state puts the interrupted epoch back, and the
epochs after follow torch's RNG, so that kind's checkpoint is the loader state plus torch's RNG
state (which ``Accelerator.save_state`` keeps too).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accel_data import prepare_data_loader
from accel_state import PartialState
from accel_state.testing import run_on_cpu

LENGTH = 40
BATCH = 4
K = 3  # batches of the interrupted epoch seen before saving
EPOCHS = 3
SEED_SAVE = 1234
SEED_RESUME = 98765


class Stream(IterableDataset):  # type: ignore[type-arg]
    """A deterministic stream of ints."""

    def __iter__(self) -> Any:
        return iter(range(LENGTH))


def build(config: dict[str, Any]) -> Any:
    """A prepared loader for ``config`` (kind, workers, num_processes, rank)."""
    kind = config["kind"]
    workers = config.get("workers", 0)
    n, rank = config.get("num_processes", 1), config.get("rank", 0)
    if kind == "iterable":
        original = DataLoader(Stream(), batch_size=BATCH, num_workers=workers)
        return prepare_data_loader(original, num_processes=n, process_index=rank)
    generator = torch.Generator().manual_seed(7) if kind == "generator" else None
    original = DataLoader(
        list(range(LENGTH)),
        batch_size=BATCH,
        shuffle=kind != "sequential",
        generator=generator,
        num_workers=workers,
    )
    return prepare_data_loader(
        original,
        num_processes=n,
        process_index=rank,
        use_seedable_sampler=kind.startswith("seedable"),
        data_seed=3 if kind == "seedable" else None,
    )


def tolists(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def uninterrupted(config: dict[str, Any]) -> list[list[list[int]]]:
    torch.manual_seed(SEED_SAVE)
    loader = build(config)
    return [tolists(loader) for _ in range(EPOCHS)]


def follows_torch_rng(config: dict[str, Any]) -> bool:
    """Whether the epochs' order comes from torch's RNG, as with plain PyTorch."""
    return config["kind"] == "shuffle" and config.get("num_processes", 1) == 1


def checkpoint(config: dict[str, Any], loader: Any) -> Any:
    """What a checkpoint of ``loader`` holds: its state, and torch's RNG when it needs that."""
    rng = torch.get_rng_state() if follows_torch_rng(config) else None
    return loader.state_dict(), rng


def interrupted(config: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], Any]:
    """Epoch 0 in full, then K batches of epoch 1 and the checkpoint taken right there."""
    torch.manual_seed(SEED_SAVE)
    loader = build(config)
    first = tolists(loader)
    seen = []
    saved = None
    for batch in loader:
        seen.append(batch.tolist())
        if len(seen) == K:
            saved = checkpoint(config, loader)
            break
    return first, seen, saved


def resume(config: dict[str, Any], saved: Any, seed: int) -> tuple[list[list[int]], ...]:
    """Build the loader anew, load the checkpoint; the rest of its epoch, then the next one."""
    state, rng = saved
    torch.manual_seed(seed)
    loader = build(config)
    loader.load_state_dict(state)
    if rng is not None:
        torch.set_rng_state(rng)
    rest = tolists(loader)
    return rest, tolists(loader)


def resume_in_child(jobs_path: str, results_path: str) -> None:
    """Entry point of the resuming process (run with ``sys.executable``)."""
    jobs = pickle.loads(Path(jobs_path).read_bytes())
    results = [resume(config, saved, SEED_RESUME) for config, saved in jobs]
    Path(results_path).write_bytes(pickle.dumps(results))


_CHILD = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('resume_child', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules['resume_child'] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.resume_in_child(sys.argv[2], sys.argv[3])\n"
)

CONFIGS = [
    {"kind": kind, "workers": workers}
    for kind in ("shuffle", "generator", "seedable", "seedable-unseeded", "sequential")
    for workers in (0, 2)
] + [
    {"kind": "iterable", "workers": 0},
    {"kind": "iterable", "workers": 2},
    {"kind": "iterable", "num_processes": 2, "rank": 0},
    {"kind": "iterable", "num_processes": 2, "rank": 1},
    {"kind": "shuffle", "num_processes": 2, "rank": 1},
    {"kind": "seedable", "num_processes": 2, "rank": 0},
]


def config_id(config: dict[str, Any]) -> str:
    return "-".join(f"{value}" for value in config.values())


@pytest.fixture(scope="module")
def resumed_in_new_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Save every configuration here, resume all of them in one new Python process."""
    saved = {}
    jobs = []
    for config in CONFIGS:
        first, seen, checkpointed = interrupted(config)
        saved[config_id(config)] = {"first": first, "seen": seen, "state": checkpointed[0]}
        jobs.append((config, checkpointed))
    folder = tmp_path_factory.mktemp("resume")
    jobs_path, results_path = folder / "jobs.pkl", folder / "results.pkl"
    jobs_path.write_bytes(pickle.dumps(jobs))
    subprocess.run(
        [sys.executable, "-c", _CHILD, __file__, str(jobs_path), str(results_path)],
        check=True,
        timeout=180,
    )
    results = pickle.loads(results_path.read_bytes())
    for config, (rest, following) in zip(CONFIGS, results, strict=True):
        saved[config_id(config)].update(rest=rest, following=following)
    return saved


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_resume_in_a_new_process_continues_exactly(
    resumed_in_new_process: dict[str, Any], config: dict[str, Any]
) -> None:
    expected = uninterrupted(config)
    run = resumed_in_new_process[config_id(config)]
    assert run["first"] == expected[0]
    assert run["seen"] == expected[1][:K]
    assert run["state"]["epoch"] == 1 and run["state"]["batches_yielded"] == K
    assert run["rest"] == expected[1][K:]
    assert run["following"] == expected[2]
    if config["kind"] not in ("sequential", "iterable"):
        assert expected[0] != expected[1]  # the order changes between epochs


def test_resuming_without_the_state_would_not_match() -> None:
    """The resuming seed alone gives another order: the state is what restores it."""
    config = {"kind": "shuffle"}
    expected = uninterrupted(config)
    torch.manual_seed(SEED_RESUME)
    assert tolists(build(config)) != expected[0]


def test_one_process_shuffle_draws_every_epoch_as_plain_pytorch() -> None:
    """A migrated single-process run sees the batches it saw without accel."""
    torch.manual_seed(SEED_SAVE)
    plain = DataLoader(list(range(LENGTH)), batch_size=BATCH, shuffle=True)
    expected = [tolists(plain) for _ in range(EPOCHS)]
    assert uninterrupted({"kind": "shuffle"}) == expected
    assert torch.equal(torch.get_rng_state(), _rng_after_plain_epochs())


def _rng_after_plain_epochs() -> torch.Tensor:
    torch.manual_seed(SEED_SAVE)
    plain = DataLoader(list(range(LENGTH)), batch_size=BATCH, shuffle=True)
    for _ in range(EPOCHS):
        tolists(plain)
    return torch.get_rng_state()


def test_one_process_shuffle_loader_state_alone_restores_the_interrupted_epoch() -> None:
    """Without torch's RNG the rest of the epoch is exact; the next one follows the RNG."""
    config = {"kind": "shuffle"}
    expected = uninterrupted(config)
    _, _, (state, _) = interrupted(config)
    torch.manual_seed(SEED_RESUME)
    loader = build(config)
    loader.load_state_dict(state)
    rng = torch.get_rng_state()
    assert tolists(loader) == expected[1][K:]
    assert torch.equal(torch.get_rng_state(), rng)  # the replayed epoch drew nothing new
    following = tolists(loader)
    torch.set_rng_state(rng)
    assert following == tolists(DataLoader(list(range(LENGTH)), batch_size=BATCH, shuffle=True))


# -- states taken between epochs, and bad states ---------------------------------------------


@pytest.mark.parametrize("kind", ["shuffle", "generator", "seedable-unseeded", "iterable"])
def test_state_after_an_epoch_resumes_at_the_next_epoch(kind: str) -> None:
    config = {"kind": kind}
    expected = uninterrupted(config)
    torch.manual_seed(SEED_SAVE)
    loader = build(config)
    tolists(loader)
    tolists(loader)
    saved = checkpoint(config, loader)
    assert saved[0]["epoch"] == 2 and saved[0]["batches_yielded"] == 0
    rest, _ = resume(config, saved, SEED_RESUME)
    assert rest == expected[2]


def test_state_before_any_iteration_resumes_at_the_start() -> None:
    config = {"kind": "shuffle"}
    expected = uninterrupted(config)
    torch.manual_seed(SEED_SAVE)
    saved = checkpoint(config, build(config))
    rest, following = resume(config, saved, SEED_RESUME)
    assert [rest, following] == expected[:2]


def test_state_taken_at_the_last_batch_resumes_with_nothing_left() -> None:
    config = {"kind": "generator"}
    expected = uninterrupted(config)
    torch.manual_seed(SEED_SAVE)
    loader = build(config)
    state = None
    for index, _ in enumerate(loader):
        if index == len(expected[0]) - 1:
            state = checkpoint(config, loader)
    rest, following = resume(config, state, SEED_RESUME)
    assert rest == []
    assert following == expected[1]


def test_state_of_another_sampler_kind_is_refused_and_changes_nothing() -> None:
    torch.manual_seed(SEED_SAVE)
    sequential = build({"kind": "sequential"})
    tolists(sequential)
    foreign = sequential.state_dict()
    torch.manual_seed(SEED_SAVE)
    loader = build({"kind": "shuffle"})
    torch.manual_seed(SEED_SAVE)
    twin = build({"kind": "shuffle"})
    before = loader.state_dict()
    with pytest.raises(ValueError, match="sampler"):
        loader.load_state_dict(foreign)
    with pytest.raises(ValueError, match="state"):
        loader.load_state_dict({"epoch": 3})
    after = loader.state_dict()
    assert after["epoch"] == before["epoch"] == 0
    assert after["order"]["kind"] == before["order"]["kind"] == "generator"
    assert torch.equal(after["order"]["state"], before["order"]["state"])
    assert loader.iteration == 0
    rng = torch.get_rng_state()
    from_loader = tolists(loader)
    torch.set_rng_state(rng)
    assert from_loader == tolists(twin)


def test_seedable_sampler_order_does_not_depend_on_the_number_of_processes() -> None:
    single = build({"kind": "seedable"})
    ranks = [build({"kind": "seedable", "num_processes": 2, "rank": r}) for r in range(2)]
    for _epoch in range(EPOCHS):
        order = [x for batch in tolists(single) for x in batch]
        per_rank = [tolists(loader) for loader in ranks]
        merged = [x for step in zip(*per_rank, strict=True) for batch in step for x in batch]
        assert merged == order
        assert sorted(order) == list(range(LENGTH))


# -- 2 real processes ------------------------------------------------------------------------

MP_MODES = ("shard", "split", "dispatch", "seedable", "iterable", "iterable-dispatch")


def build_mp(mode: str) -> Any:
    dispatch = mode.endswith("dispatch")
    if mode.startswith("iterable"):
        original = DataLoader(Stream(), batch_size=BATCH)
    else:
        original = DataLoader(list(range(LENGTH)), batch_size=BATCH, shuffle=True)
    return prepare_data_loader(
        original,
        put_on_device=True,
        device="cpu",
        dispatch_batches=dispatch,
        split_batches=mode == "split",
        use_seedable_sampler=mode == "seedable",
        data_seed=3,
        rng_types=None if mode == "seedable" else ["generator"],
    )


def _save_on_two_processes() -> dict[str, Any]:
    rank = PartialState().process_index
    out = {}
    for mode in MP_MODES:
        torch.manual_seed(SEED_SAVE + rank)
        loader = build_mp(mode)
        full = [tolists(loader) for _ in range(EPOCHS)]
        torch.manual_seed(SEED_SAVE + rank)
        loader = build_mp(mode)
        first = tolists(loader)
        seen, state = [], None
        for batch in loader:
            seen.append(batch.tolist())
            if len(seen) == K:
                state = loader.state_dict()
                break
        out[mode] = {"full": full, "first": first, "seen": seen, "state": state}
    return out


def _resume_on_two_processes(states: dict[str, list[Any]]) -> dict[str, Any]:
    rank = PartialState().process_index
    out = {}
    for mode in MP_MODES:
        torch.manual_seed(SEED_RESUME + 17 * rank)
        loader = build_mp(mode)
        loader.load_state_dict(states[mode][rank])
        rest = tolists(loader)
        out[mode] = {"rest": rest, "following": tolists(loader)}
    return out


@pytest.fixture(scope="module")
def two_process_runs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    saved = run_on_cpu(_save_on_two_processes, timeout=120)
    states = {mode: [ranks[mode]["state"] for ranks in saved] for mode in MP_MODES}
    resumed = run_on_cpu(_resume_on_two_processes, states, timeout=120)
    return saved, resumed


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MP_MODES)
def test_resume_on_two_processes(
    two_process_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]], mode: str
) -> None:
    saved, resumed = two_process_runs
    for rank in range(2):
        full = saved[rank][mode]["full"]
        assert saved[rank][mode]["first"] == full[0]
        assert saved[rank][mode]["seen"] == full[1][:K]
        assert resumed[rank][mode]["rest"] == full[1][K:]
        assert resumed[rank][mode]["following"] == full[2]
    epoch1 = [s[mode]["full"][1] for s in saved]
    merged = [x for step in zip(*epoch1, strict=True) for batch in step for x in batch]
    assert sorted(merged) == list(range(LENGTH))


@pytest.mark.multiprocess
def test_seedable_order_is_the_same_on_one_and_two_processes(
    two_process_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    saved, _ = two_process_runs
    single = build({"kind": "seedable"})
    for epoch in range(EPOCHS):
        order = [x for batch in tolists(single) for x in batch]
        per_rank = [ranks["seedable"]["full"][epoch] for ranks in saved]
        merged = [x for step in zip(*per_rank, strict=True) for batch in step for x in batch]
        assert merged == order


class _SeedReporter(torch.utils.data.Dataset[Any]):
    """Each item reports the torch seed of the process that loaded it (worker or main)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, torch.initial_seed()


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_epoch_keeps_the_global_random_stream_and_worker_seeds(workers: int) -> None:
    def make() -> DataLoader[Any]:
        loader = DataLoader(_SeedReporter(), batch_size=4, shuffle=True, num_workers=workers)
        return prepare_data_loader(loader)

    torch.manual_seed(7)
    reference = make()
    batches, draws = [], []
    for index, batch in enumerate(reference):
        batches.append(batch)
        draws.append(torch.rand(1).item())  # e.g. dropout, drawn from the global generator
        if index == 2:  # a checkpoint after the third step
            state, rng = reference.state_dict(), torch.get_rng_state()

    torch.manual_seed(123)  # a new process: a different global generator ...
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # ... restored as load_state does
    rest, rest_draws = [], []
    for batch in resumed:
        rest.append(batch)
        rest_draws.append(torch.rand(1).item())
    # The remaining batches and the global random stream continue exactly.
    assert [b[0].tolist() for b in rest] == [b[0].tolist() for b in batches[3:]]
    assert rest_draws == draws[3:]
    # The workers get the original epoch's seeds (base seed + worker id). Which worker loads
    # which batch restarts at worker 0, so randomness *inside* workers is not replayed.
    original_seeds = {seed for b in batches for seed in b[1].tolist()}
    assert {seed for b in rest for seed in b[1].tolist()} <= original_seeds
    if workers == 0:
        assert [b[1].tolist() for b in rest] == [b[1].tolist() for b in batches[3:]]


@pytest.mark.parametrize("kind", ["shuffle", "generator", "sequential"])
def test_a_state_loaded_and_saved_again_before_iterating_is_the_loaded_one(kind: str) -> None:
    # load_state then save_state with no step between (a converted or re-saved checkpoint):
    # the second state must be the first, not where an earlier iteration had stopped.
    config = {"kind": kind}
    torch.manual_seed(SEED_SAVE)
    loader = build(config)
    iterator = iter(loader)
    for _ in range(K):
        next(iterator)
    saved = loader.state_dict()
    for _ in range(2):
        next(iterator)  # the run moves on, then is rolled back
    loader.load_state_dict(saved)
    again = loader.state_dict()
    assert again["batches_yielded"] == K and again["epoch"] == saved["epoch"]
    rng = torch.get_rng_state()
    assert resume(config, (again, rng), SEED_RESUME) == resume(config, (saved, rng), SEED_RESUME)
    assert len(resume(config, (again, rng), SEED_RESUME)[0]) == LENGTH // BATCH - K
    # A state taken between epochs, loaded over a loader stopped mid-epoch, stays between
    # epochs.
    between = build(config)
    tolists(between)
    boundary = between.state_dict()
    loader.load_state_dict(boundary)
    assert loader.state_dict()["in_epoch"] is False
