"""The Accelerator under DDP on 2 gloo CPU ranks (``MULTI_CPU``).

Training through ``accelerator.prepare(model, optimizer, loader)`` on 2 ranks with per-rank
batch ``b`` must end with the same weights as a plain single-process torch loop with batch
``2b`` (``4b`` with 2 accumulation steps) over the same global sample order, in shard, split,
dispatch and seeded-shuffle modes. The global order is recorded while training (each step's
sample ids are gathered, rank-major), so the reference does not depend on how a mode orders
its data. Also: ``no_sync`` / ``accumulate`` keep gradients rank-local, bf16 autocast,
``check_trigger``, the ``hf_device_map`` refusal, ``join_uneven_inputs`` and the basic
collectives.

Each worker call covers many checks (a start costs seconds); tests read their part.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel_data import DataLoaderConfiguration
from accel_state import DistributedType
from accel_state.testing import run_on_cpu

pytestmark = pytest.mark.multiprocess

NUM_SAMPLES = 64
PER_RANK_BATCH = 4
EPOCHS = 3
LR = 0.1

# name -> (DataLoaderConfiguration kwargs, shuffle, loader batch = per-rank batch * factor)
MODES: dict[str, tuple[dict[str, Any], bool, int]] = {
    "shard": ({}, False, 1),
    "split": ({"split_batches": True}, False, 2),
    "dispatch": ({"dispatch_batches": True}, False, 1),
    "seedable-shuffle": ({"use_seedable_sampler": True}, True, 1),
}
ACCUMULATION = (1, 2)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    weight = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    y = x @ weight + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return x, y


def _model() -> nn.Sequential:
    torch.manual_seed(7)  # identical initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _params(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _grads(model: nn.Module) -> list[float]:
    grads: list[float] = []
    for p in model.parameters():
        assert p.grad is not None
        grads.extend(p.grad.flatten().tolist())
    return grads


def _reference(global_batches: list[list[int]], group: int) -> list[list[float]]:
    """Plain torch, one process: one SGD step per ``group`` consecutive global batches."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for start in range(0, len(global_batches), group):
        ids = torch.tensor([i for batch in global_batches[start : start + group] for i in batch])
        loss = F.mse_loss(model(x[ids]), y[ids])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return _params(model)


def _train(mode: str, accumulation: int) -> dict[str, Any]:
    config_kwargs, shuffle, factor = MODES[mode]
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=accumulation,
        dataloader_config=DataLoaderConfiguration(**config_kwargs),
    )
    x, y = _data()
    dataset = TensorDataset(torch.arange(NUM_SAMPLES), x, y)
    loader = DataLoader(dataset, batch_size=PER_RANK_BATCH * factor, shuffle=shuffle)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    global_batches: list[list[int]] = []
    local_sizes: set[int] = set()
    for _ in range(EPOCHS):
        for ids, inputs, targets in loader:
            local_sizes.add(len(ids))
            global_batches.append(accelerator.gather(ids).tolist())
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return {
        "wrapped": type(model).__name__,
        "distributed_type": accelerator.distributed_type.value,
        "local_sizes": sorted(local_sizes),
        "global_batches": global_batches,
        "params": _params(accelerator.unwrap_model(model)),
        "reference": _reference(global_batches, accumulation),
        "initial": _params(_model()),
    }


def _local_gradients() -> dict[str, Any]:
    """Gradients on rank-specific data inside and outside no_sync / accumulate."""
    rank = int(torch.distributed.get_rank())
    x, y = _data()
    mine = slice(8 * rank, 8 * rank + 8)
    out: dict[str, Any] = {}

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_model())
    with accelerator.no_sync(model):
        F.mse_loss(model(x[mine]), y[mine]).backward()
    out["no_sync"] = _grads(model)
    model.zero_grad()
    F.mse_loss(model(x[mine]), y[mine]).backward()
    out["synced"] = _grads(model)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(_model())
    sync_flags = []
    for key in ("accumulate_first", "accumulate_second"):
        with accelerator.accumulate(model):
            sync_flags.append(accelerator.sync_gradients)
            accelerator.backward(F.mse_loss(model(x[mine]), y[mine]))
        out[key] = _grads(model)
    out["sync_flags"] = sync_flags
    return out


def _per_rank_results() -> list[dict[str, Any]]:
    """Every training configuration, then the gradient-locality checks, on one rank."""
    results = [
        {"mode": mode, "accumulation": steps, **_train(mode, steps)}
        for steps in ACCUMULATION
        for mode in MODES
    ]
    results.append({"mode": "gradients", **_local_gradients()})
    return results


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    return run_on_cpu(_per_rank_results, timeout=120)


def _close(got: Any, want: Any, rtol: float, atol: float) -> None:
    for got_tensor, want_tensor in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(got_tensor), torch.tensor(want_tensor), rtol=rtol, atol=atol
        )


CASES = [(mode, steps) for steps in ACCUMULATION for mode in MODES]


def _result(ranks: list[list[dict[str, Any]]], rank: int, mode: str, steps: int) -> dict[str, Any]:
    return next(r for r in ranks[rank] if r["mode"] == mode and r.get("accumulation") == steps)


@pytest.mark.parametrize(("mode", "steps"), CASES, ids=[f"{m}-accum{s}" for m, s in CASES])
def test_two_rank_training_equals_one_process_with_the_global_batch(
    ranks: list[list[dict[str, Any]]], mode: str, steps: int
) -> None:
    first, second = (_result(ranks, rank, mode, steps) for rank in range(2))
    assert first["wrapped"] == "DistributedDataParallel"
    assert first["distributed_type"] == DistributedType.MULTI_CPU.value
    assert first["local_sizes"] == [PER_RANK_BATCH]
    # Both ranks saw the same global batches: 2b distinct samples per step, each sample once
    # per epoch.
    assert first["global_batches"] == second["global_batches"]
    steps_per_epoch = NUM_SAMPLES // (2 * PER_RANK_BATCH)
    assert len(first["global_batches"]) == EPOCHS * steps_per_epoch
    for epoch in range(EPOCHS):
        epoch_batches = first["global_batches"][
            epoch * steps_per_epoch : (epoch + 1) * steps_per_epoch
        ]
        ids = [i for batch in epoch_batches for i in batch]
        assert sorted(ids) == list(range(NUM_SAMPLES))
        if not MODES[mode][1]:
            assert ids == list(range(NUM_SAMPLES))  # unshuffled: the dataset order
    # DDP keeps the replicas identical, and they match the single-process reference.
    assert first["params"] == second["params"]
    _close(first["params"], first["reference"], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # training moved the weights
        _close(first["params"], first["initial"], rtol=1e-3, atol=1e-4)


def test_seedable_shuffle_changes_order_between_epochs(
    ranks: list[list[dict[str, Any]]],
) -> None:
    batches = _result(ranks, 0, "seedable-shuffle", 1)["global_batches"]
    steps_per_epoch = NUM_SAMPLES // (2 * PER_RANK_BATCH)
    epochs = [
        [i for batch in batches[e * steps_per_epoch : (e + 1) * steps_per_epoch] for i in batch]
        for e in range(EPOCHS)
    ]
    assert epochs[0] != list(range(NUM_SAMPLES))
    assert epochs[0] != epochs[1]


def test_no_sync_and_accumulate_keep_gradients_rank_local(
    ranks: list[list[dict[str, Any]]],
) -> None:
    first, second = (next(r for r in ranks[rank] if r["mode"] == "gradients") for rank in range(2))
    # Inside no_sync: each rank keeps the gradient of its own (different) data.
    assert first["no_sync"] != second["no_sync"]
    # Outside: all-reduced, identical, and the mean of the two local gradients.
    assert first["synced"] == second["synced"]
    mean = [(a + b) / 2 for a, b in zip(first["no_sync"], second["no_sync"], strict=True)]
    _close([first["synced"]], [mean], rtol=1e-5, atol=1e-7)
    # accumulate with 2 steps: the first micro-batch does not sync (loss / 2, local) ...
    assert first["sync_flags"] == second["sync_flags"] == [False, True]
    assert first["accumulate_first"] != second["accumulate_first"]
    for result in (first, second):
        half = [g / 2 for g in result["no_sync"]]
        _close([result["accumulate_first"]], [half], rtol=1e-5, atol=1e-7)
    # ... the second one all-reduces the accumulated sum: the mean gradient on both ranks.
    assert first["accumulate_second"] == second["accumulate_second"]
    _close([first["accumulate_second"]], [mean], rtol=1e-5, atol=1e-7)


# -- triggers, device maps, collectives, bf16 ------------------------------------------------


class _Dispatched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.hf_device_map = {"a": 0, "b": "cpu"}


def _misc() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # First: the first Accelerator fixes the process-wide mixed precision; the later ones
    # (mixed_precision=None) inherit bf16, which the remaining checks do not depend on.
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=PER_RANK_BATCH)
    model = _model()
    inner_dtypes: list[str] = []
    model[0].register_forward_hook(lambda *args: inner_dtypes.append(str(args[2].dtype)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    output_dtypes, losses = set(), []
    for _ in range(2):
        for inputs, targets in loader:
            outputs = model(inputs)
            output_dtypes.add(str(outputs.dtype))
            loss = F.mse_loss(outputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
    out["bf16"] = {
        "mixed_precision": accelerator.mixed_precision,
        "wrapped": type(model).__name__,
        "output_dtypes": sorted(output_dtypes),
        "inner_dtypes": sorted(set(inner_dtypes)),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "losses": losses,
        "params": _params(accelerator.unwrap_model(model)),
        "initial": _params(_model()),
    }

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index

    triggers = [accelerator.check_trigger()]
    if rank == 1:
        accelerator.set_trigger()
    triggers += [accelerator.check_trigger(), accelerator.check_trigger()]
    out["triggers"] = triggers

    dispatched = _Dispatched()
    out["verify_device_map"] = accelerator.verify_device_map(dispatched)
    try:
        accelerator.prepare(dispatched)
    except ValueError as err:
        out["device_map_error"] = str(err)

    mine = torch.tensor([rank, 10 + rank])
    out["gather"] = accelerator.gather(mine).tolist()
    out["gather_nested"] = accelerator.gather({"a": mine, "b": [mine * 2]})["b"][0].tolist()
    out["reduce_sum"] = accelerator.reduce(mine.float(), "sum").tolist()
    out["reduce_mean"] = accelerator.reduce(mine.float(), "mean").tolist()
    ragged = torch.full((rank + 1, 2), rank + 1)
    out["pad"] = accelerator.pad_across_processes(ragged, dim=0, pad_index=-1).tolist()
    out["pad_first"] = accelerator.pad_across_processes(ragged, pad_index=-1, pad_first=True)[
        0
    ].tolist()

    return out


@pytest.fixture(scope="module")
def misc() -> list[dict[str, Any]]:
    return run_on_cpu(_misc, timeout=60)


def test_check_trigger_set_on_one_rank_is_seen_by_all_then_reset(
    misc: list[dict[str, Any]],
) -> None:
    assert [r["triggers"] for r in misc] == [[False, True, False]] * 2


def test_prepare_refuses_a_model_dispatched_over_several_devices(
    misc: list[dict[str, Any]],
) -> None:
    for result in misc:
        assert result["verify_device_map"] is True
        assert "hf_device_map" in result.get("device_map_error", "")


def test_collectives_concatenate_reduce_and_pad_in_rank_order(
    misc: list[dict[str, Any]],
) -> None:
    for result in misc:
        assert result["gather"] == [0, 10, 1, 11]
        assert result["gather_nested"] == [0, 20, 2, 22]
        assert result["reduce_sum"] == [1.0, 21.0]
        assert result["reduce_mean"] == [0.5, 10.5]
    assert misc[0]["pad"] == [[1, 1], [-1, -1]]
    assert misc[1]["pad"] == [[2, 2], [2, 2]]
    assert misc[0]["pad_first"] == [-1, -1]
    assert misc[1]["pad_first"] == [2, 2]


def test_bf16_autocast_under_ddp_trains_identical_fp32_replicas(
    misc: list[dict[str, Any]],
) -> None:
    first, second = (r["bf16"] for r in misc)
    assert first["mixed_precision"] == "bf16"
    assert first["wrapped"] == "DistributedDataParallel"
    assert first["inner_dtypes"] == ["torch.bfloat16"]  # autocast is active on CPU
    assert first["output_dtypes"] == ["torch.float32"]  # outputs converted back
    assert first["param_dtypes"] == ["torch.float32"]  # master weights stay fp32
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (first, second))
    assert first["losses"][-1] < first["losses"][0]
    assert first["params"] == second["params"]
    assert first["params"] != first["initial"]


# -- uneven inputs ---------------------------------------------------------------------------


def _uneven() -> dict[str, Any]:
    x, y = _data()
    out: dict[str, Any] = {}

    # even_batches=False: 20 samples in batches of 4 -> rank 0 gets 3 batches, rank 1 gets 2.
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False)
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(x[:20], y[:20]), batch_size=PER_RANK_BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for inputs, targets in loader:
            accelerator.backward(F.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    out["loader"] = {"steps": steps, "params": _params(accelerator.unwrap_model(model))}

    # Default even_batches=True, overridden for the block; a manual 3-vs-2 step loop.
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    prepared_loader = DataLoader(TensorDataset(x, y), batch_size=PER_RANK_BATCH)
    model, optimizer, prepared_loader = accelerator.prepare(model, optimizer, prepared_loader)
    rank = accelerator.process_index
    count = 3 if rank == 0 else 2
    steps = 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        even_inside = prepared_loader.batch_sampler.even_batches
        for step in range(count):
            ids = slice(4 * (2 * step + rank), 4 * (2 * step + rank) + 4)
            accelerator.backward(F.mse_loss(model(x[ids]), y[ids]))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    out["manual"] = {
        "steps": steps,
        "even_inside": even_inside,
        "even_after": prepared_loader.batch_sampler.even_batches,
        "params": _params(accelerator.unwrap_model(model)),
    }
    accelerator.wait_for_everyone()  # both ranks reach this: nothing is left hanging
    return out


def test_join_uneven_inputs_lets_ranks_take_different_step_counts_on_cpu() -> None:
    first, second = run_on_cpu(_uneven, timeout=60, collective_timeout=20)
    assert (first["loader"]["steps"], second["loader"]["steps"]) == (3, 2)
    assert (first["manual"]["steps"], second["manual"]["steps"]) == (3, 2)
    # DDP's join hook hands the last joiner's weights to the ranks that finished early.
    for scenario in ("loader", "manual"):
        _close(first[scenario]["params"], second[scenario]["params"], rtol=0, atol=0)
    assert first["manual"]["even_inside"] is False
    assert first["manual"]["even_after"] is True
