"""The DeepSpeed engine on 2 gloo CPU ranks (runs where deepspeed is installed: the
``deepspeed`` nox session; skipped elsewhere, where test_deepspeed_plugin.py covers the
settings and the missing-package error).

Oracle: the same loop prepared under DDP (2 ranks, same batches). ZeRO-1/2/3 in fp32 must end
with DDP's weights within ``FP32_TOLERANCE`` (accumulation 2, clipping at 1.0: DeepSpeed's
global norm must be DDP's); bf16 within ``BF16_TOLERANCE`` of fp32. Also: the "auto" values
DeepSpeed receives, every contradiction refused, save_state/load_state resuming bit for bit at
a window boundary, a save inside a window refused, and the exported weights (ZeRO-3 with and
without the 16-bit gather) loading into a plain model with identical outputs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("deepspeed")

from accel import Accelerator  # noqa: E402
from accel.utils import DeepSpeedPlugin  # noqa: E402
from accel.utils.deepspeed import DummyOptim  # noqa: E402
from accel_state import AcceleratorState, GradientState  # noqa: E402
from accel_state.testing import run_on_cpu  # noqa: E402

pytestmark = pytest.mark.multiprocess

NUM_SAMPLES = 32
PER_RANK_BATCH = 4
ACCUMULATION = 2
LR = 0.1
FP32_TOLERANCE = 2e-6
BF16_TOLERANCE = 5e-2


def _model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _loader() -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _reset() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _weights(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


def _train(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> list[float]:
    norms = []
    dtype = next(accelerator.unwrap_model(model).parameters()).dtype
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(xb.to(dtype)).float(), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
    return norms


def _run(stage: int | None, precision: str = "no") -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if stage is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0)
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, mixed_precision=precision, **kwargs
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    norms = _train(accelerator, model, optimizer, loader)
    state = accelerator.get_state_dict(model)  # a collective under ZeRO-3
    result = {
        "type": accelerator.distributed_type.value,
        "weights": _weights(state) if accelerator.is_main_process else None,
        "norms": norms,
        "config": getattr(accelerator.engine, "resolved_config", None),
    }
    accelerator.free_memory()
    _reset()
    return result


def _equivalence_worker() -> dict[str, Any]:
    results: dict[str, Any] = {"ddp": _run(None)}
    for stage in (1, 2, 3):
        results[f"zero{stage}"] = _run(stage)
    results["zero2-bf16"] = _run(2, "bf16")
    results["zero3-bf16"] = _run(3, "bf16")
    return results


@functools.cache
def _equivalence() -> dict[str, Any]:
    return run_on_cpu(_equivalence_worker, timeout=300)[0]


def _max_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trains_like_ddp(stage: int) -> None:
    results = _equivalence()
    run = results[f"zero{stage}"]
    assert run["type"] == "DEEPSPEED" and results["ddp"]["type"] == "MULTI_CPU"
    assert _max_difference(run["weights"], results["ddp"]["weights"]) <= FP32_TOLERANCE
    assert run["norms"] == pytest.approx(results["ddp"]["norms"], rel=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bf16_trains_close_to_fp32(stage: int) -> None:
    results = _equivalence()
    bf16 = results[f"zero{stage}-bf16"]["weights"]
    assert 0 < _max_difference(bf16, results["ddp"]["weights"]) <= BF16_TOLERANCE


def test_the_auto_values_are_filled_from_the_run() -> None:
    config = _equivalence()["zero2"]["config"]
    assert config["train_micro_batch_size_per_gpu"] == PER_RANK_BATCH
    assert config["gradient_accumulation_steps"] == ACCUMULATION
    assert config["train_batch_size"] == PER_RANK_BATCH * ACCUMULATION * 2
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_optimization"]["stage"] == 2
    assert _equivalence()["zero2-bf16"]["config"]["bf16"] == {"enabled": True}


# --- checkpoints, export, refusals -------------------------------------------------------


def _checkpoint_worker(folder: str) -> dict[str, Any]:
    root = Path(folder)
    out: dict[str, Any] = {}
    for stage, gather in ((2, False), (3, True), (3, False)):
        name = f"zero{stage}-{'gather' if gather else 'layers'}"
        plugin = DeepSpeedPlugin(
            zero_stage=stage, gradient_clipping=1.0, zero3_save_16bit_model=gather
        )
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, deepspeed_plugin=plugin)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
        saved, refused = None, None
        for step, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
            if step == 0:
                try:
                    accelerator.save_state(os.fspath(root / f"{name}-open"))
                except ValueError as error:
                    refused = str(error)
            if step == 1:  # the first window is complete
                saved = accelerator.save_state(os.fspath(root / name))
        straight = _weights(accelerator.get_state_dict(model))
        assert saved is not None
        accelerator.load_state(saved)
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
        resumed = _weights(accelerator.get_state_dict(model))
        accelerator.save_model(model, root / f"{name}-export")
        probe = torch.linspace(-1, 1, 12).reshape(3, 4)
        with torch.no_grad():
            outputs = model(probe).tolist()
        out[name] = {
            "bit_identical": straight == resumed,
            "refused": refused,
            "open_exists": (root / f"{name}-open").exists(),
            "files": sorted(
                str(p.relative_to(saved)) for p in Path(saved).rglob("*") if p.is_file()
            ),
            "outputs": outputs,
        }
        accelerator.free_memory()
        _reset()
    return out


@functools.cache
def _checkpoints(folder: str) -> dict[str, Any]:
    return run_on_cpu(_checkpoint_worker, folder, timeout=300)[0]


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("deepspeed")
    return folder, _checkpoints(os.fspath(folder))


@pytest.mark.parametrize("name", ["zero2-layers", "zero3-gather", "zero3-layers"])
def test_save_state_resumes_bit_for_bit_and_refuses_an_open_window(
    checkpoint_results: tuple[Path, dict[str, Any]], name: str
) -> None:
    _, results = checkpoint_results
    run = results[name]
    assert run["bit_identical"]
    assert "inside an accumulation window under DeepSpeed" in run["refused"]
    assert not run["open_exists"]  # refused before anything was written
    assert "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt" in run["files"]
    assert {"latest", "random_states_0.pkl", "accel_manifest.json"} <= set(run["files"])


@pytest.mark.parametrize("name", ["zero2-layers", "zero3-gather", "zero3-layers"])
def test_save_model_writes_weights_a_plain_model_loads(
    checkpoint_results: tuple[Path, dict[str, Any]], name: str
) -> None:
    from accel.model_files import load_model_files

    folder, results = checkpoint_results
    plain = _model()
    plain.load_state_dict(load_model_files(folder / f"{name}-export"))
    probe = torch.linspace(-1, 1, 12).reshape(3, 4)
    with torch.no_grad():
        assert plain(probe).tolist() == results[name]["outputs"]


def _refusals_worker() -> dict[str, str]:
    messages: dict[str, str] = {}

    def attempt(name: str, build: Any) -> None:
        try:
            build()
        except (ValueError, NotImplementedError) as error:
            messages[name] = str(error)
        finally:
            _reset()

    def prepared(plugin: DeepSpeedPlugin, accumulation: int = ACCUMULATION, **extra: Any) -> Any:
        accelerator = Accelerator(gradient_accumulation_steps=accumulation, deepspeed_plugin=plugin)
        model = _model()
        optimizer = extra.get("optimizer") or torch.optim.SGD(model.parameters(), lr=LR)
        objects = [model, optimizer, _loader(), *extra.get("more", [])]
        return accelerator, accelerator.prepare(*objects)

    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}

    def accumulation() -> None:
        accelerator = Accelerator(
            gradient_accumulation_steps=ACCUMULATION,
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
        )
        model = _model()
        try:
            accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), _loader())
        finally:
            messages["registered-after-failure"] = str(len(accelerator._dataloaders))

    attempt("accumulation", accumulation)
    batch = {"zero_optimization": {"stage": 2}, "train_batch_size": 7}
    attempt("batch", lambda: prepared(DeepSpeedPlugin(hf_ds_config=batch)))
    with_optimizer = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
    }
    attempt("optimizer-twice", lambda: prepared(DeepSpeedPlugin(hf_ds_config=with_optimizer)))
    attempt(
        "dummy-without-config",
        lambda: prepared(
            DeepSpeedPlugin(zero_stage=2), optimizer=DummyOptim(_model().parameters())
        ),
    )
    attempt("two-models", lambda: prepared(DeepSpeedPlugin(zero_stage=2), more=[_model()]))
    attempt(
        "fp16",
        lambda: Accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin()),
    )

    def clipping() -> None:
        accelerator, (model, optimizer, loader) = prepared(DeepSpeedPlugin(zero_stage=2))
        xb, yb = next(iter(loader))
        accelerator.backward(F.mse_loss(model(xb), yb))  # one window of 1: a real step
        accelerator.gradient_state._set_sync_gradients(True)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)

    attempt("clip-norm", clipping)

    def clip_value() -> None:
        accelerator, (model, _, _) = prepared(DeepSpeedPlugin(zero_stage=2, gradient_clipping=1))
        accelerator.gradient_state._set_sync_gradients(True)
        accelerator.clip_grad_value_(model.parameters(), 0.5)

    attempt("clip-value", clip_value)

    def prepare_again_after_free_memory() -> None:
        accelerator, _ = prepared(DeepSpeedPlugin(zero_stage=2))
        accelerator.free_memory()
        model = _model()
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), _loader())
        messages["prepare-again"] = "prepared"

    attempt("prepare-again", prepare_again_after_free_memory)
    return messages


def test_every_contradiction_and_unsupported_use_is_refused_with_the_fix() -> None:
    messages = run_on_cpu(_refusals_worker, timeout=300)[0]
    assert "the DeepSpeed config says 4, the Accelerator says 2" in messages["accumulation"]
    assert messages["registered-after-failure"] == "0"  # not even the loader stays
    assert "train_batch_size=7" in messages["batch"] and "make it 16" in messages["batch"]
    assert "optimizer in the config file and in the code" in messages["optimizer-twice"]
    assert "DummyOptim` without specifying an optimizer" in messages["dummy-without-config"]
    assert "one model (with at most one optimizer)" in messages["two-models"]
    assert "use mixed_precision='bf16'" in messages["fp16"]
    assert "gradient_clipping=None" in messages["clip-norm"]
    assert "DeepSpeedPlugin(gradient_clipping=0.5)" in messages["clip-norm"]
    assert "does not support `clip_grad_value_`" in messages["clip-value"]
    assert messages["prepare-again"] == "prepared"  # free_memory lets another model in
