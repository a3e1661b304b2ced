"""Tensor parallelism on gloo CPU ranks: alone (tp=2) and under FSDP2 (dp_shard=2 x tp=2).

The model is a residual MLP whose blocks are split Megatron-style (``up`` by output features,
``down`` by input features) with :func:`accel.utils.apply_tensor_parallel`; its norms, input
layer and head stay whole (plain under tensor parallelism alone, replicated DTensors under
FSDP2). Oracle: one process training the unsplit model on the global batch (the batches of
the data-parallel ranks only: the ``tp`` peers see the same ones), AdamW, clipping at 1.0.
Each layout must end within ``TOLERANCE`` of it, feed ``tp`` peers identical batches, report
its mesh ranks, and restore weights and optimizer exactly through ``save_state`` /
``load_state``; ``save_model`` writes the whole weights; ``gather_for_metrics`` returns each
sample once (not once per ``tp`` peer); ``end_training`` leaves no gloo thread. Plans that
do not fit the model and models that are not tensor parallel are refused with the fix.
"""

from __future__ import annotations

import functools
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel import Accelerator, ParallelismConfig
from accel.utils import FullyShardedDataParallelPlugin, apply_tensor_parallel
from accel_state import AcceleratorState, GradientState
from accel_state.testing import run_on_cpu

# Each run lays out FSDP2 meshes beside the others: on the floor (torch 2.5) it is skipped.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_feature("fully_shard")]

NUM_SAMPLES = 64
PER_RANK_BATCH = 4
ACCUMULATION = 2
LR = 0.05
# Split layers sum their partial products in another order (rowwise: over the tp ranks), and
# 16 AdamW steps carry those float differences into the weights.
TOLERANCE = 1e-5
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


class MLPBlock(nn.Module):
    """Norm, then up (split by output features), tanh, down (split by input features)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    _no_split_modules = ["MLPBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _model() -> Net:
    torch.manual_seed(3)
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return x, y


def _loader() -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*_data()), batch_size=PER_RANK_BATCH, shuffle=True
    )


def _weights(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


def _difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(u - v) for key in a for u, v in zip(a[key], b[key], strict=True))


@functools.cache
def _reference(
    dp: int, order: tuple[tuple[int, ...], ...]
) -> tuple[dict[str, list[float]], list[float]]:
    """One process over the global batch: each step averages ``dp x ACCUMULATION`` batches.

    ``order`` lists the rows of each batch the data-parallel ranks read (:func:`_order`).
    Returns the weights and the gradient norm of each step (before clipping).
    """
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    per_step = dp * ACCUMULATION
    for start in range(0, len(order), per_step):
        loss = torch.zeros(())
        for index in order[start : start + per_step]:
            ids = torch.tensor(index)
            loss = loss + F.mse_loss(model(x[ids]), y[ids]) / per_step
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model.state_dict()), norms


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _refusals(accelerator: Accelerator) -> dict[str, str]:
    """What each plan that does not fit, and a model that is not split, are told."""
    mesh = accelerator.torch_device_mesh
    found = {}
    cases: dict[str, Any] = {
        "no-module": {"blocks.*.missing": "colwise"},
        "bad-style": {"blocks.*.up": "diagonal"},
        "indivisible": {"out": "colwise"},  # 1 output feature over 2 ranks
        "no-plan": None,  # Net carries no plan of its own
    }
    for name, plan in cases.items():
        try:
            apply_tensor_parallel(_model(), mesh, plan)
        except ValueError as error:
            found[name] = str(error)
    try:
        accelerator.prepare(_model())
    except ValueError as error:
        found["plain-model"] = str(error)
    return found


def _layout(config: ParallelismConfig, fsdp: bool, folder: str) -> dict[str, Any]:
    """Train one epoch split by ``PLAN``; report weights, batches, ranks, a resume check."""
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION,
        parallelism_config=config,
        fsdp_plugin=plugin if fsdp else None,
    )
    result: dict[str, Any] = {"refusals": _refusals(accelerator) if not fsdp else {}}
    if fsdp:  # Accelerate prepares this; accel refuses it (docs/compat.md says why)
        plugin.cpu_ram_efficient_loading = True
        try:
            accelerator.prepare(
                apply_tensor_parallel(_model(), accelerator.torch_device_mesh, PLAN)
            )
        except ValueError as error:
            result["refusals"]["ram-efficient"] = str(error)
        plugin.cpu_ram_efficient_loading = False
    net = apply_tensor_parallel(_model(), accelerator.torch_device_mesh, PLAN)
    model, optimizer, loader = accelerator.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=LR), _loader()
    )
    x, _ = _data()
    batches = []
    norms = []
    for xb, yb in loader:
        # which dataset rows this rank got (the loader shuffles; rows are unique)
        batches.append([int((x == row).all(dim=1).nonzero()) for row in xb])
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
    from torch.distributed.tensor import DTensor

    up = accelerator.unwrap_model(model).blocks[0].up.weight
    result.update(
        type=accelerator.distributed_type.value,
        engine=accelerator.engine.name,
        batches=batches,
        norms=norms,
        weights=_weights(accelerator.get_state_dict(model)),
        ranks=[
            accelerator.data_parallel_shard_rank,
            accelerator.tensor_parallel_rank,
            accelerator.process_index,
        ],
        up_local_shape=list(up.to_local().shape) if isinstance(up, DTensor) else None,
    )
    ids = torch.utils.data.DataLoader(torch.arange(NUM_SAMPLES - 2), batch_size=PER_RANK_BATCH)
    seen: list[int] = []
    seen_objects: list[int] = []
    for batch in accelerator.prepare(ids):  # 62 samples: the last batch is evened out
        seen += accelerator.gather_for_metrics(batch).tolist()
        seen_objects += accelerator.gather_for_metrics(batch.tolist(), use_gather_object=True)
    result["metrics"] = [seen, seen_objects]
    accelerator.save_model(model, f"{folder}/model")
    accelerator.save_state(f"{folder}/state")
    xb, yb = next(iter(_loader()))
    steps = []
    for _ in range(2):  # one more step, then back to the save and the same step again
        accelerator.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        steps.append(_weights(accelerator.get_state_dict(model)))
        if len(steps) == 1:
            accelerator.load_state(f"{folder}/state")
            restored = _weights(accelerator.get_state_dict(model))
    if accelerator.is_main_process:  # the full state dict lives on rank 0
        from safetensors.torch import load_file

        result["restored"] = _difference(restored, result["weights"])
        result["step-again"] = _difference(steps[0], steps[1])
        result["saved-model"] = _difference(
            _weights(load_file(f"{folder}/model/model.safetensors")), result["weights"]
        )
        result["folders"] = sorted(p.name for p in Path(f"{folder}/state").iterdir())
    accelerator.end_training()
    del accelerator, net, model, optimizer, loader
    _reset()
    gc.collect()
    tasks = Path("/proc/self/task")
    if tasks.is_dir():  # Linux: no gloo thread of the mesh is left for interpreter exit
        names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
        result["gloo-threads"] = sorted(name for name in names if "gloo" in name)
    return result


@functools.cache
def _runs(world: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        if world == 2:
            return run_on_cpu(
                _layout, ParallelismConfig(tp_size=2), False, folder, world_size=2, timeout=240
            )
        config = ParallelismConfig(dp_shard_size=2, tp_size=2)
        return run_on_cpu(_layout, config, True, folder, world_size=4, timeout=300)


def _order(runs: list[dict[str, Any]], dp: int) -> tuple[tuple[int, ...], ...]:
    """The batches as the oracle takes them: step i of data-parallel rank r at ``i * dp + r``.

    The data-parallel ranks are every second rank (``tp`` is the mesh's inner dimension).
    """
    per_rank = [run["batches"] for run in runs[:: len(runs) // dp]]
    return tuple(tuple(rows) for step in zip(*per_rank, strict=True) for rows in step)


def test_tensor_parallel_alone_trains_like_one_process_and_resumes_exactly() -> None:
    runs = _runs(2)
    assert {run["type"] for run in runs} == {"MULTI_CPU"}
    assert {run["engine"] for run in runs} == {"tensor parallel"}
    assert [run["ranks"] for run in runs] == [[0, 0, 0], [0, 1, 1]]
    assert runs[0]["up_local_shape"] == [16, 16]  # 32 output features, half on each rank
    assert runs[0]["batches"] == runs[1]["batches"]  # tp peers read the same rows
    assert len(runs[0]["batches"]) == NUM_SAMPLES // PER_RANK_BATCH  # one data shard
    reference, norms = _reference(1, _order(runs, 1))
    assert min(norms) > 1.0  # clipping acts at every step
    for run in runs:  # the norm of the whole gradients, the same on every rank
        assert run["norms"] == pytest.approx(norms, rel=1e-5)
    assert _difference(runs[0]["weights"], reference) <= TOLERANCE
    assert runs[0]["restored"] == 0.0 and runs[0]["step-again"] == 0.0
    assert runs[0]["saved-model"] == 0.0
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(runs[0]["folders"])


@pytest.mark.parametrize("world", [2, 4])
def test_metrics_hold_each_sample_once_though_tp_peers_share_them(world: int) -> None:
    for run in _runs(world):
        assert run["metrics"] == [list(range(NUM_SAMPLES - 2))] * 2


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
@pytest.mark.parametrize("world", [2, 4])
def test_end_training_leaves_no_gloo_thread_of_the_mesh(world: int) -> None:
    assert [run["gloo-threads"] for run in _runs(world)] == [[]] * world


def test_fsdp2_over_dp_shard_beside_tp_trains_like_one_process_and_resumes_exactly() -> None:
    runs = _runs(4)
    assert {run["type"] for run in runs} == {"FSDP"}
    # rank = shard * 2 + tp (row-major mesh, tp innermost)
    assert [run["ranks"] for run in runs] == [[0, 0, 0], [0, 1, 1], [1, 0, 2], [1, 1, 3]]
    assert runs[0]["up_local_shape"] == [8, 16]  # split by tp, then sharded by FSDP2
    assert runs[0]["batches"] == runs[1]["batches"] and runs[2]["batches"] == runs[3]["batches"]
    assert runs[0]["batches"] != runs[2]["batches"]  # the data-parallel ranks differ
    reference, norms = _reference(2, _order(runs, 2))
    for run in runs:
        assert run["norms"] == pytest.approx(norms, rel=1e-5)
    assert _difference(runs[0]["weights"], reference) <= TOLERANCE
    assert runs[0]["restored"] == 0.0 and runs[0]["step-again"] == 0.0
    assert runs[0]["saved-model"] == 0.0


def test_ram_efficient_loading_beside_tensor_parallelism_is_refused_with_the_fix() -> None:
    message = _runs(4)[0]["refusals"]["ram-efficient"]
    assert "cpu_ram_efficient_loading=True) with tensor parallelism" in message
    assert "Set cpu_ram_efficient_loading=False" in message


def test_plans_that_do_not_fit_and_plain_models_are_refused_with_the_fix() -> None:
    refusals = _runs(2)[0]["refusals"]
    print(json.dumps(refusals, indent=1))
    assert "'blocks.*.missing' matches no module of Net" in refusals["no-module"]
    assert "nothing was sharded" in refusals["no-module"]
    assert "plan['blocks.*.up']='diagonal' is not a style" in refusals["bad-style"]
    assert "colwise, rowwise" in refusals["bad-style"]
    assert "out (Linear, weight (1, 16))" in refusals["indivisible"]
    assert "tp_size=2" in refusals["indivisible"]
    assert "Net): the model carries no tensor parallel plan" in refusals["no-plan"]
    assert "ParallelismConfig(tp_size=2) but Net is not tensor parallel" in refusals["plain-model"]
    assert "apply_tensor_parallel" in refusals["plain-model"]
