"""The DeepSpeed engine on 2 gloo CPU ranks (runs where deepspeed is installed: the
``deepspeed`` nox session; skipped elsewhere, where test_deepspeed_plugin.py covers the
settings and the missing-package error).

Oracle: the same loop prepared under DDP (2 ranks, same batches). ZeRO-1/2/3 in fp32 must end
with DDP's weights within ``FP32_TOLERANCE`` (accumulation 2, clipping at 1.0: DeepSpeed's
global norm must be DDP's); bf16 within ``BF16_TOLERANCE`` of fp32. Also: the "auto" values
DeepSpeed receives, every contradiction refused, save_state/load_state resuming bit for bit at
a window boundary and inside an open window (DeepSpeed's partial gradients saved and put
back), a save inside a window refused where they cannot be read (bf16 ZeRO-2), and the
exported weights (ZeRO-3 with and
without the 16-bit gather) loading into a plain model with identical outputs.
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

pytest.importorskip("deepspeed")

from accel import Accelerator
from accel.engines.deepspeed_merge import merge_deepspeed_weights
from accel.utils import DeepSpeedPlugin, broadcast_object_list
from accel.utils.deepspeed import DummyOptim, zero3_init_context
from accel_state import AcceleratorState, GradientState
from accel_state.testing import run_on_cpu
from accel_state.testing.launch import free_port

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


def _train(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> list[Any]:
    norms = []
    dtype = next(accelerator.unwrap_model(model).parameters()).dtype
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(xb.to(dtype)).float(), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
    return norms


def _run(stage: int | None, precision: str = "no", zero3_init: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if stage is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=stage, gradient_clipping=1.0, zero3_init_flag=zero3_init
        )
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, mixed_precision=precision, **kwargs
    )
    with zero3_init_context():  # partitioned as it is built when zero3_init_flag is set
        model = _model()
    partitioned = (
        [p.numel() == 0 and p.ds_numel > 0 for p in model.parameters()] if zero3_init else []
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    norms = _train(accelerator, model, optimizer, loader)
    state = accelerator.get_state_dict(model)  # a collective under ZeRO-3
    result = {
        "type": accelerator.distributed_type.value,
        "weights": _weights(state) if accelerator.is_main_process else None,
        "norms": [float(norm) for norm in norms],
        "norm_types": sorted({type(norm).__name__ for norm in norms}),
        "config": getattr(accelerator.engine, "resolved_config", None),
        "partitioned": partitioned,
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
    results["zero3-init"] = _run(3, zero3_init=True)
    results["zero3-init-bf16"] = _run(3, "bf16", zero3_init=True)
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
    # Accelerate 1.15 returns DeepSpeed's norm as a Python float (DDP: a tensor)
    assert run["norm_types"] == ["float"] and results["ddp"]["norm_types"] == ["Tensor"]


def test_a_model_built_under_zero3_init_is_partitioned_and_trains_like_ddp() -> None:
    results = _equivalence()
    run = results["zero3-init"]
    assert run["partitioned"] and all(run["partitioned"])  # no rank held a whole weight
    assert _max_difference(run["weights"], results["ddp"]["weights"]) <= FP32_TOLERANCE
    assert run["norms"] == pytest.approx(results["ddp"]["norms"], rel=1e-5)
    bf16 = results["zero3-init-bf16"]
    assert all(bf16["partitioned"])
    assert _max_difference(bf16["weights"], results["zero3-bf16"]["weights"]) == 0.0


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


def _transformers_worker() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GPT2Config
    from transformers.integrations import is_deepspeed_zero3_enabled

    plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    out: dict[str, Any] = {"enabled": is_deepspeed_zero3_enabled()}
    with plugin.zero3_init_context_manager(enable=False):
        out["disabled_inside"] = not is_deepspeed_zero3_enabled()
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # transformers builds it under zero.Init
    out["partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    state = accelerator.get_state_dict(model)
    out["losses"] = losses
    out["shapes"] = {k: list(v.shape) for k, v in state.items()} if state else {}
    accelerator.free_memory()
    _reset()
    return out


def test_zero3_init_flag_makes_transformers_build_partitioned_models() -> None:
    pytest.importorskip("transformers")
    out = run_on_cpu(_transformers_worker, timeout=300)[0]
    assert out["enabled"] and out["disabled_inside"]
    assert out["partitioned"]
    assert len(out["losses"]) == 2 and all(0 < loss < 10 for loss in out["losses"])
    assert out["shapes"]["transformer.wte.weight"] == [64, 16]
    assert out["shapes"]["transformer.h.1.mlp.c_fc.weight"] == [16, 64]


HF_STYLE_CONFIG = {
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": True,
        },
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def _hf_style_worker() -> dict[str, Any]:
    from types import SimpleNamespace

    from accel.utils.deepspeed import DummyScheduler

    out: dict[str, Any] = {}
    plugin = DeepSpeedPlugin(hf_ds_config=HF_STYLE_CONFIG, zero3_init_flag=False)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, deepspeed_plugin=plugin)
    model = _model()
    model.config = SimpleNamespace(hidden_size=16)  # as a transformers model carries it
    optimizer = DummyOptim(
        model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-7
    )
    scheduler = DummyScheduler(optimizer, total_num_steps=9, warmup_num_steps=3)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(), scheduler
    )
    out["config"] = accelerator.engine.resolved_config
    lrs = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    out["lrs"] = lrs
    out["optimizer"] = type(optimizer.optimizer).__name__
    accelerator.free_memory()
    _reset()
    # betas "auto" with a DummyOptim that was not given them: refused, saying what to pass
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=HF_STYLE_CONFIG))
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=0.01)
    try:
        accelerator.prepare(model, optimizer, _loader(), DummyScheduler(optimizer))
    except ValueError as error:
        out["leftover"] = str(error)
    _reset()
    return out


def test_hf_style_auto_config_is_filled_like_accelerate() -> None:
    out = run_on_cpu(_hf_style_worker, timeout=300)[0]
    config = out["config"]
    assert config["optimizer"]["params"] == {
        "lr": 0.01,
        "betas": [0.8, 0.9],
        "eps": 1e-7,
        "weight_decay": 0.1,
        "torch_adam": True,
    }
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.01,
        "warmup_num_steps": 3,
        "total_num_steps": 5,  # 9 counted over the unprepared loader, over 2 processes
    }
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (256, 230)
    assert zero["stage3_param_persistence_threshold"] == 160
    assert config["gradient_clipping"] == 0.0 and config["train_batch_size"] == 16
    assert out["optimizer"] == "AdamW"
    # DeepSpeed's scheduler steps at each window's end (4 micro-batches per rank, 2 windows),
    # warming up from warmup_min_lr: nothing moves inside the second window, then it rises
    lrs = out["lrs"]
    assert len(lrs) == 4 and lrs[0] == lrs[1] == lrs[2] == 0.0 < lrs[3] <= 0.01
    message = out["leftover"]
    assert "['optimizer.params.betas', 'optimizer.params.eps'" in message
    assert "pass DummyOptim(params, ..., betas=...)" in message
    assert "total_num_steps" in message and "DummyScheduler(optimizer, ...)" in message


# --- several models, several plugins ---------------------------------------------------


def _teacher() -> nn.Sequential:
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _distill(accelerator: Accelerator, student: Any, teacher: Any, optimizer: Any, loader: Any):
    for xb, yb in loader:
        with accelerator.accumulate(student):
            with torch.no_grad():
                target = teacher(xb)
            out = student(xb)
            accelerator.backward(F.mse_loss(out, yb) + F.mse_loss(out, target))
            optimizer.step()
            optimizer.zero_grad()


def _several_models_worker(folder: str) -> dict[str, Any]:
    from accel.utils.deepspeed import get_active_deepspeed_plugin

    out: dict[str, Any] = {}
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    student = _model()
    optimizer = torch.optim.SGD(student.parameters(), lr=LR)
    student, optimizer, loader = accelerator.prepare(student, optimizer, _loader())
    teacher = _teacher().eval()
    _distill(accelerator, student, teacher, optimizer, loader)
    out["ddp"] = _weights(accelerator.get_state_dict(student))
    out["teacher"] = _weights(teacher.state_dict())
    accelerator.free_memory()
    _reset()

    plugins = {
        "student": DeepSpeedPlugin(zero_stage=2),
        "teacher": DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False),
    }
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, deepspeed_plugins=plugins)
    out["first_active"] = get_active_deepspeed_plugin(accelerator.state) is plugins["student"]
    student = _model()
    optimizer = torch.optim.SGD(student.parameters(), lr=LR)
    student, optimizer, loader = accelerator.prepare(student, optimizer, _loader())
    accelerator.state.select_deepspeed_plugin("teacher")
    out["teacher_active"] = accelerator.deepspeed_plugin is plugins["teacher"] and [
        p.selected for p in plugins.values()
    ] == [False, True]
    teacher = accelerator.prepare(_teacher())  # its micro batch: the loader prepared above
    teacher.eval()
    accelerator.state.select_deepspeed_plugin("student")
    out["wrapped_is_student"] = accelerator.deepspeed_engine_wrapped.engine is student
    out["stages"] = [
        type(student.optimizer).__name__,
        accelerator.engine.wrapper_of(teacher).config["zero_optimization"]["stage"],
    ]
    _distill(accelerator, student, teacher, optimizer, loader)
    out["deepspeed"] = _weights(accelerator.get_state_dict(student))
    out["deepspeed_teacher"] = _weights(accelerator.get_state_dict(teacher))
    # both engines checkpoint and resume: one tag folder each
    saved = accelerator.save_state(os.path.join(folder, "two-models"))
    out["tags"] = sorted(p.name for p in Path(saved).iterdir() if p.is_dir())
    out["latest"] = (Path(saved) / "latest").read_text().strip()
    _distill(accelerator, student, teacher, optimizer, loader)
    straight = _weights(accelerator.get_state_dict(student))
    accelerator.load_state(saved)
    _distill(accelerator, student, teacher, optimizer, loader)
    out["resumed_bit_identical"] = straight == _weights(accelerator.get_state_dict(student))
    # another Accelerator shares the state and its plugins (Accelerate's two-trainer recipe)
    other = Accelerator()
    out["other"] = [other.engine.name, other.deepspeed_plugin is plugins["student"]]
    for name in ("nope", None):
        try:
            accelerator.state.select_deepspeed_plugin(name)
        except ValueError as error:
            out[f"bad-{name}"] = str(error)
    # a loss through two trained models of one Accelerator: refused, naming both
    second = _model()
    second_optimizer = torch.optim.SGD(second.parameters(), lr=LR)
    second, second_optimizer = accelerator.prepare(second, second_optimizer)
    xb, yb = next(iter(loader))
    try:
        accelerator.backward(F.mse_loss(student(xb), yb) + F.mse_loss(second(xb), yb))
    except RuntimeError as error:
        out["two-trained"] = str(error)
    accelerator.free_memory()
    _reset()
    return out


@functools.cache
def _several_models(folder: str) -> dict[str, Any]:
    return run_on_cpu(_several_models_worker, folder, timeout=300)[0]


@pytest.fixture(scope="module")
def several(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _several_models(os.fspath(tmp_path_factory.mktemp("several")))


def test_two_plugins_train_a_student_beside_a_zero3_teacher_like_ddp(
    several: dict[str, Any],
) -> None:
    assert several["first_active"] and several["teacher_active"]
    assert several["wrapped_is_student"]
    assert several["stages"] == ["DeepSpeedZeroOptimizer", 3]
    assert _max_difference(several["deepspeed"], several["ddp"]) <= FP32_TOLERANCE
    assert several["deepspeed_teacher"] == several["teacher"]  # it only ran
    assert several["other"] == ["DeepSpeed", True]


def test_two_deepspeed_models_checkpoint_the_one_that_trains(several: dict[str, Any]) -> None:
    assert several["tags"] == ["pytorch_model"]  # the teacher has no optimizer: nothing to save
    assert several["latest"] == "pytorch_model"
    assert several["resumed_bit_identical"]


def test_plugin_selection_and_backward_through_two_trained_models_are_refused(
    several: dict[str, Any],
) -> None:
    assert "'nope' is not a DeepSpeed plugin of this run" in several["bad-nope"]
    assert "['student', 'teacher']" in several["bad-nope"]
    assert "None is not a DeepSpeed plugin" in several["bad-None"]
    message = several["two-trained"]
    assert "came from several of the trained models (Sequential, Sequential)" in message
    assert "its own Accelerator" in message


# --- checkpoints, export, refusals -------------------------------------------------------


def _checkpoint_worker(folder: str) -> dict[str, Any]:
    root = Path(folder)
    out: dict[str, Any] = {}
    cases = ((2, False, "no"), (3, True, "no"), (3, False, "no"), (2, False, "bf16"))
    for stage, gather, precision in cases:
        name = f"zero{stage}-{'gather' if gather else 'layers'}"
        name += "-bf16" if precision == "bf16" else ""
        plugin = DeepSpeedPlugin(
            zero_stage=stage, gradient_clipping=1.0, zero3_save_16bit_model=gather
        )
        accelerator = Accelerator(
            gradient_accumulation_steps=ACCUMULATION,
            deepspeed_plugin=plugin,
            mixed_precision=precision,
        )
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        saved, opened = None, None
        for step, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb.to(dtype)).float(), yb))
                optimizer.step()
                optimizer.zero_grad()
            if step == 2:  # inside the second window: DeepSpeed holds a partial gradient
                opened = accelerator.save_state(os.fspath(root / f"{name}-open"))
            if step == 1:  # the first window is complete
                saved = accelerator.save_state(os.fspath(root / name))
                at_save = _weights(accelerator.get_state_dict(model))
        straight = _weights(accelerator.get_state_dict(model))
        assert saved is not None and opened is not None
        resumed = {}
        for label, folder in (("boundary", saved), ("open", opened)):
            accelerator.load_state(folder)
            for xb, yb in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(F.mse_loss(model(xb.to(dtype)).float(), yb))
                    optimizer.step()
                    optimizer.zero_grad()
            resumed[label] = _weights(accelerator.get_state_dict(model))
        accelerator.save_model(model, root / f"{name}-export")
        probe = torch.linspace(-1, 1, 12).reshape(3, 4)
        with torch.no_grad():
            outputs = model(probe.to(dtype)).float().tolist()
        out[name] = {
            "at_save": at_save,
            "bit_identical": straight == resumed["boundary"],
            "open_bit_identical": straight == resumed["open"],
            "open_files": sorted(p.name for p in Path(opened).iterdir()),
            "files": sorted(
                str(p.relative_to(saved)) for p in Path(saved).rglob("*") if p.is_file()
            ),
            "outputs": outputs,
        }
        accelerator.free_memory()
        _reset()
    # bf16 ZeRO-2 accumulating in fp32 keeps buffers accel cannot read: refused, nothing written
    config = {
        "zero_optimization": {"stage": 2},
        "data_types": {"grad_accum_dtype": "fp32"},
        "gradient_clipping": 1.0,
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, deepspeed_plugin=plugin, mixed_precision="bf16"
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    xb, yb = next(iter(loader))
    with accelerator.accumulate(model):
        accelerator.backward(F.mse_loss(model(xb.to(torch.bfloat16)).float(), yb))
    try:
        accelerator.save_state(os.fspath(root / "zero2-bf16-open"))
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    out["refused_exists"] = (root / "zero2-bf16-open").exists()
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


@pytest.mark.parametrize(
    "name", ["zero2-layers", "zero3-gather", "zero3-layers", "zero2-layers-bf16"]
)
def test_save_state_resumes_bit_for_bit_at_a_boundary_and_inside_a_window(
    checkpoint_results: tuple[Path, dict[str, Any]], name: str
) -> None:
    _, results = checkpoint_results
    run = results[name]
    assert run["bit_identical"]
    assert run["open_bit_identical"]  # the partial gradient came back where DeepSpeed adds
    assert {"accel_gradients_0.safetensors", "accel_gradients_1.safetensors"} <= set(
        run["open_files"]
    )
    assert any(
        f.startswith("pytorch_model/") and f.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")
        for f in run["files"]
    )
    assert {"latest", "random_states_0.pkl", "accel_manifest.json"} <= set(run["files"])


def test_save_inside_a_window_is_refused_where_deepspeed_hides_the_gradients(
    checkpoint_results: tuple[Path, dict[str, Any]],
) -> None:
    _, results = checkpoint_results
    message = results["refused"]
    assert message is not None and "inside an accumulation window under DeepSpeed" in message
    assert "ZeRO-2 accumulating gradients in torch.float32 beside torch.bfloat16" in message
    assert "sync_gradients is True" in message
    assert not results["refused_exists"]  # refused before anything was written


@pytest.mark.parametrize("name", ["zero2-layers", "zero3-layers", "zero2-layers-bf16"])
def test_merge_weights_turns_a_deepspeed_checkpoint_into_the_weights_it_saved(
    checkpoint_results: tuple[Path, dict[str, Any]],
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from accel.model_files import load_model_files
    from accel_launch.cli import main

    folder, results = checkpoint_results
    expected = results[name]["at_save"]
    # the checkpoint root through the command, its tag folder through the function
    code = main(["merge-weights", os.fspath(folder / name), os.fspath(tmp_path / "root")])
    assert code == 0, capsys.readouterr().err
    merge_deepspeed_weights(folder / name / "pytorch_model", tmp_path / "tag")
    for out in ("root", "tag"):
        merged = load_model_files(tmp_path / out)
        assert sorted(merged) == sorted(expected)
        assert all(t.dtype == torch.float32 for t in merged.values())
        if name.endswith("bf16"):  # fp32 master weights; the model saw their bf16 rounding
            assert all(
                torch.equal(merged[k].to(torch.bfloat16).float().flatten(), torch.tensor(v))
                for k, v in expected.items()
            )
        else:
            assert _weights(merged) == expected


def test_merge_weights_refuses_an_incomplete_deepspeed_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "pytorch_model").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("pytorch_model")
    with pytest.raises(FileNotFoundError, match="holds no DeepSpeed model states"):
        merge_deepspeed_weights(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


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
    assert "does not clip (gradient_clipping=0.0)" in messages["clip-norm"]
    assert "DeepSpeedPlugin(gradient_clipping=0.5)" in messages["clip-norm"]
    assert "`accel launch --gradient_clipping 0.5`" in messages["clip-norm"]  # launched runs
    assert "does not support `clip_grad_value_`" in messages["clip-value"]
    assert "`accel launch --gradient_clipping`" in messages["clip-value"]
    assert messages["prepare-again"] == "prepared"  # free_memory lets another model in


def _teardown_worker() -> dict[str, str]:
    """Per ZeRO stage, one after the other in the same processes: the gloo threads left once a
    trained run has ended and its objects are gone, and the weights of the next run."""
    results: dict[str, str] = {}
    for stage in (2, 3):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
        net = _model()
        optimizer = torch.optim.SGD(net.parameters(), lr=LR)
        model, optimizer, loader = accelerator.prepare(net, optimizer, _loader())
        xb, _ = next(iter(loader))
        accelerator.backward(model(xb).sum())
        optimizer.step()
        state = accelerator.get_state_dict(model)
        results[f"weights-{stage}"] = repr(_weights(state)) if accelerator.is_main_process else ""
        # The next run rendezvouses on a port both ranks agree on now: on the old one, a rank
        # that ends first could reach rank 0's store of this run before rank 0 has closed it.
        port = [free_port() if accelerator.is_main_process else None]
        broadcast_object_list(port)
        accelerator.end_training()
        os.environ["MASTER_PORT"] = str(port[0])
        del net, model, optimizer, loader, accelerator, state
        _reset()
        gc.collect()
        tasks = Path("/proc/self/task")
        names = sorted((task / "comm").read_text().strip() for task in tasks.iterdir())
        results[f"threads-{stage}"] = ",".join(name for name in names if "gloo" in name)
    return results


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_end_training_lets_go_of_every_group_and_a_next_run_trains() -> None:
    """DeepSpeed's hooks, its module stack, its group registry and the world group captured as
    a default argument no longer keep gloo groups alive after ``end_training`` (their threads
    would reach interpreter exit, where they can abort a finished run); a second DeepSpeed
    run in the same processes, on a new world group, trains as the first did."""
    results = run_on_cpu(_teardown_worker, timeout=240)
    for rank in results:
        assert rank["threads-2"] == "" and rank["threads-3"] == ""
    main = results[0]
    assert main["weights-2"] and main["weights-2"] == main["weights-3"]  # ZeRO-2 == ZeRO-3
