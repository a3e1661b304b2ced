"""The FSDP2 engine on 2 gloo CPU ranks: it trains like DDP and like one process.

Oracles: a plain single-process torch loop over the global batch (the same samples, in the
same order), and the same loop prepared under DDP. FSDP2 must end with the same weights within
``FP32_TOLERANCE`` for every wrap policy, with accumulation, activation checkpointing,
RAM-efficient loading (bf16: within ``BF16_TOLERANCE`` of DDP with bf16 autocast);
``clip_grad_norm_`` must return DDP's norm as a plain tensor; ``save_model`` must load into a
plain model with identical outputs; per-rank parameter + gradient + AdamW bytes must be at
most 0.55x DDP's; ``save_state`` / ``load_state`` (sharded and full) must resume bit for bit,
from the middle of an accumulation window too; and every bad input must be refused before
anything changes.

Each worker call covers many checks (a start costs seconds); the tests read their part.
"""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel import Accelerator
from accel.checkpointing import CheckpointError
from accel.utils import FullyShardedDataParallelPlugin
from accel_state import AcceleratorState, GradientState, PartialState
from accel_state.testing import run_on_cpu

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_feature("fully_shard")]

NUM_SAMPLES = 32
PER_RANK_BATCH = 4
ACCUMULATION = 2
LR = 0.05
FP32_TOLERANCE = 2e-6  # reduce-scatter vs all-reduce: float sums in another order
BF16_TOLERANCE = 1e-6  # FSDP2's bf16 policy against DDP's bf16 autocast (same roundings)


class Block(nn.Module):
    """One residual layer: the unit TRANSFORMER_BASED_WRAP shards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """Input layer, two blocks in a ModuleList (a container), output head."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _model() -> Net:
    torch.manual_seed(3)  # the same initial weights everywhere
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return x, y


def _loader() -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*_data()), batch_size=PER_RANK_BATCH
    )


def _reference() -> dict[str, list[float]]:
    """One process, plain torch: each step sees the global batch of both ranks' micro-batches."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    world = 2
    per_step = PER_RANK_BATCH * world * ACCUMULATION
    for start in range(0, NUM_SAMPLES, per_step):
        # rank r's k-th micro-batch is batch (k * world + r) of the loader
        loss = 0.0
        for k in range(ACCUMULATION):
            for rank in range(world):
                index = start // PER_RANK_BATCH + k * world + rank
                ids = slice(index * PER_RANK_BATCH, (index + 1) * PER_RANK_BATCH)
                loss = loss + F.mse_loss(model(x[ids]), y[ids]) / (world * ACCUMULATION)
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model.state_dict())


def _weights(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


def _full(accelerator: Accelerator, model: Any) -> dict[str, list[float]]:
    state = accelerator.get_state_dict(model)  # a collective under FSDP2
    gathered = accelerator.gather_for_metrics([_weights(state)], use_gather_object=True)
    return gathered[0]


def _train(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> list[float]:
    norms = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                assert type(norm) is torch.Tensor  # a plain tensor, not a DTensor
                norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
    return norms


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _run(plugin: dict[str, Any] | None, mixed_precision: str = "no") -> dict[str, Any]:
    """Train one epoch under FSDP2 (``plugin``) or DDP (None); return weights and norms."""
    kwargs: dict[str, Any] = {}
    plugin = dict(plugin) if plugin is not None else None
    empty_elsewhere = plugin is not None and plugin.pop("empty_on_other_ranks", False)
    if plugin is not None:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**plugin)
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, mixed_precision=mixed_precision, **kwargs
    )
    if empty_elsewhere and accelerator.process_index != 0:
        from accel import init_empty_weights

        with init_empty_weights():  # only rank 0 holds weights; prepare broadcasts them
            model = _model()
        assert all(p.device.type == "meta" for p in model.parameters())
    else:
        model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # built before sharding
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    norms = _train(accelerator, model, optimizer, loader)
    result = {
        "type": accelerator.distributed_type.value,
        "weights": _full(accelerator, model),
        "norms": norms,
        "memory": _bytes(model, optimizer),
    }
    accelerator.free_memory()
    _reset()
    return result


def _bytes(model: Any, optimizer: Any) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (tensor accounting)."""

    def local(tensor: torch.Tensor) -> int:
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        return tensor.numel() * tensor.element_size()

    total = 0
    for param in model.parameters():
        total += local(param)
        if param.grad is not None:
            total += local(param.grad)
    for state in optimizer.state.values():
        total += sum(local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


_BLOCKS = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
CONFIGS: dict[str, dict[str, Any]] = {
    "transformer": _BLOCKS,
    "size": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 200},  # skips ModuleList
    "no-wrap": {"auto_wrap_policy": "NO_WRAP"},
    "checkpointing": {**_BLOCKS, "activation_checkpointing": True},
    "ram-efficient": {**_BLOCKS, "cpu_ram_efficient_loading": True},
    "ram-efficient-meta": {
        **_BLOCKS,
        "cpu_ram_efficient_loading": True,
        "empty_on_other_ranks": True,
    },
    "keep-unsharded": {**_BLOCKS, "reshard_after_forward": False},
}


def _equivalence_worker() -> dict[str, Any]:
    """Every configuration, DDP and bf16 in one launch."""
    results: dict[str, Any] = {"ddp": _run(None)}
    for name, plugin in CONFIGS.items():
        results[name] = _run(plugin)
    results["bf16"] = _run(CONFIGS["transformer"], mixed_precision="bf16")
    results["ddp-bf16"] = _run(None, mixed_precision="bf16")
    results["reference"] = _reference()
    return results


@functools.cache
def _equivalence() -> dict[str, Any]:
    return run_on_cpu(_equivalence_worker, timeout=240)[0]


def _max_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp2_trains_like_one_process_and_like_ddp(config: str) -> None:
    results = _equivalence()
    run = results[config]
    assert run["type"] == "FSDP"
    assert _max_difference(run["weights"], results["reference"]) <= FP32_TOLERANCE
    assert _max_difference(run["weights"], results["ddp"]["weights"]) <= FP32_TOLERANCE
    ddp_norms = results["ddp"]["norms"]
    assert run["norms"] == pytest.approx(ddp_norms, rel=1e-5)
    assert results["ddp"]["type"] == "MULTI_CPU"


def test_fsdp2_bf16_trains_like_ddp_with_bf16_autocast() -> None:
    results = _equivalence()
    fsdp, ddp = results["bf16"]["weights"], results["ddp-bf16"]["weights"]
    assert _max_difference(fsdp, ddp) <= BF16_TOLERANCE
    assert _max_difference(fsdp, results["reference"]) > 100 * BF16_TOLERANCE  # really bf16


def test_a_control_that_skips_a_step_differs() -> None:
    """Negative control: the tolerance is tight enough to see a missing optimizer step."""
    results = _equivalence()
    initial = _weights(_model().state_dict())
    assert _max_difference(initial, results["reference"]) > 100 * FP32_TOLERANCE


def test_fsdp2_holds_at_most_055_of_ddps_bytes_per_rank() -> None:
    results = _equivalence()
    ratio = results["transformer"]["memory"] / results["ddp"]["memory"]
    assert ratio <= 0.55, ratio


# --- checkpoints, save_model, bad inputs ---------------------------------------------------


def _checkpoint_worker(folder: str) -> dict[str, Any]:
    root = Path(folder)
    out: dict[str, Any] = {}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", state_dict_type=kind
        )
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, fsdp_plugin=plugin)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
        saved = None
        for step, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
            if step == 2:  # inside a window: one micro-batch of two accumulated
                saved = accelerator.save_state(os.fspath(root / kind))
                at_save = _full(accelerator, model)
        straight = _full(accelerator, model)
        accelerator.save_state(os.fspath(root / f"{kind}-end"))  # the window is closed here
        _end_weights[kind] = straight
        accelerator.load_state(saved)
        for xb, yb in loader:  # resumes after the saved batch
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
        resumed = _full(accelerator, model)
        assert saved is not None
        out[kind] = {
            "at_save": at_save,
            "at_end": straight,
            "bit_identical": straight == resumed,
            "files": sorted(
                str(p.relative_to(saved)) for p in Path(saved).rglob("*") if p.is_file()
            ),
        }
        out[kind]["functions"] = _checkpoint_functions(
            accelerator, plugin, model, optimizer, loader, root, kind
        )
        if kind == "SHARDED_STATE_DICT":
            accelerator.save_model(model, root / "export", max_shard_size=1000)
            probe = torch.linspace(-1, 1, 12).reshape(3, 4)
            out["outputs"] = model(probe).detach().tolist()
        accelerator.free_memory()
        _reset()
    return out


def _checkpoint_functions(
    accelerator: Any, plugin: Any, model: Any, optimizer: Any, loader: Any, root: Path, kind: str
) -> dict[str, Any]:
    """Accelerate's one-object functions (transformers' Trainer checkpoints FSDP with them)."""
    from accel.utils.fsdp_utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    folder = root / f"{kind}-functions"
    save_fsdp_model(plugin, accelerator, model, folder)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
    saved, saved_state = _full(accelerator, model), _optimizer_state(optimizer)
    for xb, yb in loader:  # move on, then come back
        accelerator.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
    moved = _full(accelerator, model) != saved
    load_fsdp_model(plugin, accelerator, model, folder)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
    result = {
        "moved": moved,
        "model_back": _full(accelerator, model) == saved,
        "optimizer_back": _optimizer_state(optimizer) == saved_state,
        "files": sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()),
    }
    # save_state's files are the same layout: the functions read them too
    load_fsdp_model(plugin, accelerator, model, root / f"{kind}-end")
    result["reads_save_state"] = _full(accelerator, model) == _end_weights.get(kind)
    try:
        load_fsdp_model(plugin, accelerator, model, root / "nothing-here")
    except CheckpointError as error:
        result["missing"] = str(error)
    result["unchanged_after_error"] = _full(accelerator, model) == _end_weights.get(kind)
    return result


_end_weights: dict[str, Any] = {}


def _optimizer_state(optimizer: Any) -> Any:
    """This rank's shard of the optimizer state, as plain lists."""

    def local(value: Any) -> Any:
        return getattr(value, "to_local", lambda: value)().tolist()

    state = optimizer.optimizer.state_dict()["state"]
    return {k: {n: local(v) for n, v in entry.items()} for k, entry in state.items()}


@functools.cache
def _checkpoints(folder: str) -> dict[str, Any]:
    return run_on_cpu(_checkpoint_worker, folder, timeout=240)[0]


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("fsdp2")
    return folder, _checkpoints(os.fspath(folder))


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_state_resumes_bit_for_bit_from_inside_a_window(
    checkpoint_results: tuple[Path, dict[str, Any]], kind: str
) -> None:
    _, results = checkpoint_results
    assert results[kind]["bit_identical"]


def test_checkpoints_use_accelerates_fsdp_layout(
    checkpoint_results: tuple[Path, dict[str, Any]],
) -> None:
    _, results = checkpoint_results
    sharded = results["SHARDED_STATE_DICT"]["files"]
    for name in (
        "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "pytorch_model_fsdp_0/__1_0.distcp",
        "optimizer_0/.metadata",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "accel_gradients_0.safetensors",  # the open window's pending gradients, per rank
        "accel_manifest.json",
    ):
        assert name in sharded, sharded
    assert "model.safetensors" not in sharded
    full = results["FULL_STATE_DICT"]["files"]
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(full), full


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_accelerates_fsdp_checkpoint_functions_round_trip(
    checkpoint_results: tuple[Path, dict[str, Any]], kind: str
) -> None:
    _, results = checkpoint_results
    found = results[kind]["functions"]
    assert found["moved"] and found["model_back"] and found["optimizer_back"]
    assert found["reads_save_state"]
    assert "nothing-here" in found["missing"] and found["unchanged_after_error"]
    expected = (
        {"pytorch_model_fsdp.bin", "optimizer.bin"}
        if kind == "FULL_STATE_DICT"
        else {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"}
    )
    assert expected <= set(found["files"]), found["files"]


def test_merge_weights_reassembles_the_two_ranks_shards(
    checkpoint_results: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from accel.model_files import load_model_files
    from accel.utils import merge_fsdp_weights

    folder, _ = checkpoint_results
    merge_fsdp_weights(folder / "SHARDED_STATE_DICT", tmp_path / "merged")
    merged = load_model_files(tmp_path / "merged")
    expected = _model().state_dict()
    assert {k: tuple(v.shape) for k, v in merged.items()} == {
        k: tuple(v.shape) for k, v in expected.items()
    }


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_two_rank_checkpoint_loads_in_one_process(
    checkpoint_results: tuple[Path, dict[str, Any]], kind: str
) -> None:
    """DCP reshards on load; a window left open at 2 ranks cannot resume at 1 and is refused."""
    folder, results = checkpoint_results
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", state_dict_type=kind
    )
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, fsdp_plugin=plugin)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = _weights(accelerator.get_state_dict(model))
    with pytest.raises(CheckpointError, match="cannot be resumed exactly at another world size"):
        accelerator.load_state(os.fspath(folder / kind))  # saved inside a window
    assert _weights(accelerator.get_state_dict(model)) == before  # nothing changed
    accelerator.load_state(os.fspath(folder / f"{kind}-end"))
    assert _weights(accelerator.get_state_dict(model)) == results[kind]["at_end"]
    accelerator.end_training()


def test_save_model_writes_full_weights_a_plain_model_loads(
    checkpoint_results: tuple[Path, dict[str, Any]],
) -> None:
    from accel.model_files import load_model_files

    folder, results = checkpoint_results
    export = folder / "export"
    assert (export / "model.safetensors.index.json").exists()  # sharded at 1000 bytes
    plain = _model()
    plain.load_state_dict(load_model_files(export))
    probe = torch.linspace(-1, 1, 12).reshape(3, 4)
    assert plain(probe).detach().tolist() == results["outputs"]


def _bad_inputs_worker() -> dict[str, str]:
    """Each bad input's message; after each, the Accelerator still prepares a good model."""
    messages: dict[str, str] = {}
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    )
    early = torch.optim.SGD(_model().parameters(), lr=0.1)
    try:
        accelerator.prepare(early)
    except ValueError as error:
        messages["optimizer-first"] = str(error)
    dispatched = _model()
    dispatched.hf_device_map = {"inp": "cpu", "blocks": "disk", "out": "cpu"}  # type: ignore[assignment]
    try:
        accelerator.prepare(dispatched)
    except ValueError as error:
        messages["device-map"] = str(error)
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    good = _model()
    try:
        accelerator.prepare(good, stray)
    except ValueError as error:
        messages["stray-optimizer"] = str(error)
    messages["registered-after-failure"] = str(len(accelerator._models))
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["NoSuchLayer"]
    )
    accelerator.state.fsdp_plugin = plugin
    accelerator.engine.plugin = plugin
    try:
        accelerator.prepare(_model())
    except ValueError as error:
        messages["unknown-class"] = str(error)
    accelerator.end_training()
    return messages


def _teardown_worker() -> str:
    """The gloo threads left once a trained FSDP2 run has ended and its objects are gone."""
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    )
    net = _model()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    accelerator.end_training()
    del net, model, optimizer, accelerator
    gc.collect()
    return ",".join(_gloo_threads())


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (Linux: /proc/self/task/*/comm)."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return sorted(name for name in names if "gloo" in name)


def test_bad_inputs_are_refused_with_the_fix_and_leave_nothing_registered() -> None:
    messages = run_on_cpu(_bad_inputs_worker, timeout=120)[0]
    assert "belongs to no model prepared with FSDP2" in messages["optimizer-first"]
    assert "Prepare the model first" in messages["optimizer-first"]
    assert "dispatched by a device map" in messages["device-map"]
    assert "'blocks': 'disk'" in messages["device-map"]
    assert "belongs to no model prepared with FSDP2" in messages["stray-optimizer"]
    assert messages["registered-after-failure"] == "0"
    assert "Could not find the transformer layer class NoSuchLayer" in messages["unknown-class"]
    assert "Block" in messages["unknown-class"]  # it lists the model's classes


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_end_training_leaves_no_gloo_thread_once_the_model_is_gone() -> None:
    """The mesh does not keep the groups alive: their threads must not reach interpreter exit.

    A gloo group still alive at finalization can abort a finished run at exit ("terminate
    called without an active exception").
    """
    assert run_on_cpu(_teardown_worker, timeout=120) == ["", ""]


def test_one_process_gets_a_one_rank_group_and_trains() -> None:
    """Without a launcher FSDP2 is honoured too: a one-rank group, DTensor shards."""
    from torch.distributed.tensor import DTensor

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    assert accelerator.is_fsdp2 and accelerator.distributed_type.value == "FSDP"
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    before = [p.full_tensor().clone() for p in model.parameters()]
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    assert any(
        not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters(), strict=True)
    )
    accelerator.end_training()
    assert not torch.distributed.is_initialized()
    assert PartialState._shared_state  # the state itself stays until reset


def test_an_optimizer_prepared_after_its_model_is_re_pointed_with_its_state() -> None:
    from torch.distributed.tensor import DTensor

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # state before sharding
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    model = accelerator.prepare(model)
    prepared = accelerator.prepare(optimizer)  # a later call
    params = [p for group in prepared.param_groups for p in group["params"]]
    assert params == list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    kept = [prepared.state[p]["exp_avg"].full_tensor() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(moments, kept, strict=True))
    accelerator.backward(model(torch.ones(2, 4)).sum())
    prepared.step()
    accelerator.end_training()


def test_activation_offload_is_refused_on_a_cpu_run() -> None:
    plugin = FullyShardedDataParallelPlugin(
        activation_checkpointing=True, activation_checkpointing_offload=True
    )
    with pytest.raises(ValueError, match="activation_checkpointing_offload=False"):
        Accelerator(fsdp_plugin=plugin)
    assert not torch.distributed.is_initialized()


class Tied(nn.Module):
    """An embedding whose weight the output head shares (tied word embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_tied_weights_stay_one_parameter_and_train() -> None:
    # SIZE_BASED_WRAP would make the embedding a unit of its own; its weight is also the
    # head's, outside it, so the embedding stays in the root's unit and the tie holds.
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert model.head.weight is model.embed.weight
    before = model.embed.weight.full_tensor().clone()
    ids = torch.tensor([[1, 2, 3]])
    accelerator.backward(torch.nn.functional.cross_entropy(model(ids)[0], ids[0]))
    optimizer.step()
    assert model.head.weight is model.embed.weight
    assert not torch.equal(before, model.embed.weight.full_tensor())
    from torch.distributed.fsdp import FSDPModule

    assert not isinstance(model.embed, FSDPModule)
    assert all(isinstance(block.lin, FSDPModule) for block in model.blocks)  # smallest fit
    accelerator.end_training()
