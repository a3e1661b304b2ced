"""Single-process behaviour of the ``Accelerator`` (CPU, no process group).

Covers construction and its validation, the run properties, ``prepare`` (types, order,
idempotence, placement), training equivalence with a plain PyTorch loop (including gradient
accumulation and exact ``num_items`` normalisation), bf16/fp16 on CPU, clipping, the
collectives on one process, metrics gathering, triggers, unwrapping, memory, saving,
profiling, data helpers and trackers.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.handlers import (
    DistributedDataParallelKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from accel.tracking import GeneralTracker
from accel_amp import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
)
from accel_data import DataLoaderConfiguration
from accel_state import DistributedType

# --- helpers ------------------------------------------------------------------------------


def _regression_data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``X`` (n x 3) and exact targets ``y = X w + 0.5``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator)
    w = torch.tensor([[1.5], [-2.0], [0.75]])
    return x, x @ w + 0.5


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1)


def _mse(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _train_raw(batch_size: int, epochs: int) -> torch.nn.Linear:
    """The reference: a plain PyTorch loop over the regression data, in order."""
    x, y = _regression_data()
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for xb, yb in loader:
            loss = _mse(model, xb, yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def _train_prepared(
    accelerator: Accelerator, batch_size: int, epochs: int
) -> tuple[torch.nn.Module, list[float]]:
    """The same loop adapted with ``prepare`` / ``accumulate`` / ``backward``."""
    x, y = _regression_data()
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    for _ in range(epochs):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = _mse(model, xb, yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return model, losses


class _RecordingTracker(GeneralTracker):
    """A custom tracker that remembers every call."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    @property
    def tracker(self) -> list[tuple[str, Any]]:
        return self.calls

    def start(self) -> None:
        self.calls.append(("start", None))

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", dict(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", (dict(values), step)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


# --- construction -------------------------------------------------------------------------


def test_defaults_describe_a_single_cpu_process() -> None:
    accelerator = Accelerator()
    assert accelerator.device == torch.device("cpu")
    assert accelerator.distributed_type == DistributedType.NO
    assert accelerator.num_processes == 1
    assert accelerator.process_index == 0
    assert accelerator.mixed_precision == "no"
    assert accelerator.gradient_accumulation_steps == 1
    assert accelerator.rng_types == ["generator"]
    assert accelerator.split_batches is False
    assert accelerator.scaler is None


def test_unknown_mixed_precision_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="fp32") as info:
        Accelerator(mixed_precision="fp32")
    for choice in ("no", "fp16", "bf16", "fp8"):
        assert choice in str(info.value)


def test_steps_and_plugin_together_are_refused() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps") as info:
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )
    assert "gradient_accumulation_plugin" in str(info.value)


def test_plugin_sets_the_accumulation_steps() -> None:
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    assert accelerator.gradient_accumulation_steps == 4


def test_accumulation_steps_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRADIENT_ACCUMULATION_STEPS", "3")
    assert Accelerator().gradient_accumulation_steps == 3


def test_mixed_precision_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"


def test_two_handlers_of_one_class_are_refused() -> None:
    with pytest.raises(ValueError, match="only pass one"):
        Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()]
        )


def test_handler_is_stored_in_its_slot() -> None:
    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    assert Accelerator(kwargs_handlers=[handler]).ddp_handler is handler


def test_unknown_handler_is_a_type_error_naming_its_class() -> None:
    class NotAHandler:
        pass

    with pytest.raises(TypeError, match="NotAHandler"):
        Accelerator(kwargs_handlers=[NotAHandler()])  # type: ignore[list-item]


def test_split_batches_argument_is_honoured() -> None:
    assert Accelerator(split_batches=True).split_batches is True


def test_split_batches_contradicting_the_dataloader_config_is_refused() -> None:
    with pytest.raises(ValueError, match="split_batches"):
        Accelerator(
            split_batches=True,
            dataloader_config=DataLoaderConfiguration(split_batches=False),
        )


def test_the_megatron_slot_is_not_implemented() -> None:
    # More in test_engine_refusal.py and test_parallelism.py: every slot, switch and size
    # (torch_tp_plugin is ParallelismConfig(tp_size=...): test_parallelism.py).
    with pytest.raises(NotImplementedError, match="megatron_lm_plugin"):
        Accelerator(megatron_lm_plugin=object())


@pytest.mark.torch_feature("fully_shard")
def test_an_fsdp_plugin_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match="fsdp_plugin=<object.*FullyShardedDataParallelPlugin"):
        Accelerator(fsdp_plugin=object())


def test_dynamo_backend_and_plugin_together_are_refused() -> None:
    with pytest.raises(ValueError, match="dynamo"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))


def test_dynamo_plugin_fields_left_none_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # transformers' Trainer builds TorchDynamoPlugin(backend=None, mode=None, ...) unless
    # torch_compile_backend is set: None means "the environment, else the default".
    plugin = TorchDynamoPlugin(backend=None, mode=None, fullgraph=None, dynamic=None)
    assert (plugin.backend, plugin.mode, plugin.fullgraph, plugin.dynamic) == (
        "NO",
        "default",
        False,
        None,
    )
    assert plugin.use_regional_compilation is False and not plugin.enabled
    assert plugin.to_kwargs() == {}
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")  # Accelerate's name works too
    monkeypatch.setenv("ACCEL_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCEL_DYNAMO_USE_DYNAMIC", "false")
    plugin = TorchDynamoPlugin(backend=None)
    assert (plugin.backend, plugin.mode, plugin.dynamic) == ("EAGER", "max-autotune", False)
    assert TorchDynamoPlugin(backend="inductor", mode="default").backend == "INDUCTOR"
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "warp-drive")
    with pytest.raises(ValueError, match=r"ACCELERATE_DYNAMO_BACKEND='warp-drive'.*choose one of"):
        TorchDynamoPlugin()


def test_project_dir_sets_project_and_logging_dirs(tmp_path: Path) -> None:
    accelerator = Accelerator(project_dir=tmp_path)
    assert accelerator.project_dir == str(tmp_path)
    assert accelerator.logging_dir == str(tmp_path)


def test_project_configuration_rejects_a_zero_total_limit() -> None:
    with pytest.raises(ValueError, match="total_limit"):
        ProjectConfiguration(total_limit=0)


# --- properties ---------------------------------------------------------------------------


def test_process_role_properties_on_one_process() -> None:
    accelerator = Accelerator()
    assert accelerator.is_main_process is True
    assert accelerator.is_local_main_process is True
    assert accelerator.is_last_process is True
    assert accelerator.use_distributed is False
    assert accelerator.multi_device is False


def test_even_batches_is_settable() -> None:
    accelerator = Accelerator()
    assert accelerator.even_batches is True
    accelerator.even_batches = False
    assert accelerator.even_batches is False


def test_sync_gradients_is_settable() -> None:
    accelerator = Accelerator()
    assert accelerator.sync_gradients is True
    accelerator.sync_gradients = False
    assert accelerator.sync_gradients is False


def test_gradient_accumulation_steps_is_settable_and_validated() -> None:
    accelerator = Accelerator()
    accelerator.gradient_accumulation_steps = 4
    assert accelerator.gradient_accumulation_steps == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            accelerator.gradient_accumulation_steps = bad  # type: ignore[assignment]
    assert accelerator.gradient_accumulation_steps == 4


def test_step_counts_micro_batches_and_is_settable() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = accelerator.prepare(_linear())
    assert accelerator.step == 0
    for _ in range(2):
        with accelerator.accumulate(model):
            pass
    assert accelerator.step == 2
    assert accelerator.sync_gradients is False
    accelerator.step = 7
    assert accelerator.step == 7


def test_optimizer_step_was_skipped_is_false_after_a_normal_step() -> None:
    accelerator = Accelerator()
    model = _linear()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator.optimizer_step_was_skipped is False
    x, y = _regression_data(n=4)
    accelerator.backward(_mse(model, x, y))
    optimizer.step()
    assert accelerator.optimizer_step_was_skipped is False


# --- prepare ------------------------------------------------------------------------------


def test_prepare_returns_wrapped_objects_in_input_order() -> None:
    accelerator = Accelerator()
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    extra = {"keep": "me"}
    p_loader, p_model, p_optimizer, p_scheduler, p_extra, p_int = accelerator.prepare(
        loader, model, optimizer, scheduler, extra, 3
    )
    assert isinstance(p_loader, DataLoader)
    assert type(p_loader) is not DataLoader
    assert isinstance(p_model, torch.nn.Module)
    assert isinstance(p_optimizer, AcceleratedOptimizer)
    assert p_optimizer.optimizer is optimizer
    assert isinstance(p_scheduler, AcceleratedScheduler)
    assert p_scheduler.scheduler is scheduler
    assert p_extra is extra
    assert p_int == 3


def test_prepare_of_one_object_returns_it_not_a_tuple() -> None:
    accelerator = Accelerator()
    model = _linear()
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, torch.nn.Linear)
    assert prepared is model


def test_scheduler_before_its_optimizer_is_still_bound() -> None:
    accelerator = Accelerator()
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1 - n / 10)
    p_scheduler, p_optimizer = accelerator.prepare(scheduler, optimizer)
    assert isinstance(p_scheduler, AcceleratedScheduler)
    assert isinstance(p_optimizer, AcceleratedOptimizer)
    assert p_scheduler.optimizers == [p_optimizer]
    p_optimizer.step()
    p_scheduler.step()
    assert p_scheduler.get_last_lr() == pytest.approx([0.9])


def test_preparing_twice_returns_the_same_objects() -> None:
    accelerator = Accelerator()
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    first = accelerator.prepare(loader, model, optimizer, scheduler)
    second = accelerator.prepare(*first)
    for before, after in zip(first, second, strict=True):
        assert after is before
    assert second[2].optimizer is optimizer
    assert second[3].scheduler is scheduler
    assert len(accelerator._models) == 1
    assert len(accelerator._optimizers) == 1
    assert len(accelerator._schedulers) == 1
    assert len(accelerator._dataloaders) == 1


def test_device_placement_of_the_wrong_length_is_refused() -> None:
    accelerator = Accelerator()
    with pytest.raises(ValueError, match="device_placement"):
        accelerator.prepare(_linear(), _linear(), device_placement=[True])


def test_device_placement_false_leaves_the_model_where_it_is() -> None:
    accelerator = Accelerator()
    kept, moved = _linear(), _linear()
    with (
        mock.patch.object(kept, "to", wraps=kept.to) as kept_to,
        mock.patch.object(moved, "to", wraps=moved.to) as moved_to,
    ):
        accelerator.prepare(kept, moved, device_placement=[False, True])
    kept_to.assert_not_called()
    moved_to.assert_called()


def test_scheduler_of_an_unprepared_optimizer_is_refused() -> None:
    accelerator = Accelerator()
    model = _linear()
    accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    other = torch.optim.SGD(_linear().parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(ValueError, match="not prepared"):
        accelerator.prepare(scheduler)


# --- training -------------------------------------------------------------------------------


def test_prepared_regression_reaches_a_low_loss() -> None:
    accelerator = Accelerator()
    _, losses = _train_prepared(accelerator, batch_size=8, epochs=30)
    assert losses[0] > 0.5
    assert losses[-1] < 1e-4


def test_prepared_loop_equals_the_raw_loop_exactly() -> None:
    raw = _train_raw(batch_size=8, epochs=3)
    prepared, _ = _train_prepared(Accelerator(), batch_size=8, epochs=3)
    torch.testing.assert_close(prepared.weight, raw.weight, rtol=0, atol=0)
    torch.testing.assert_close(prepared.bias, raw.bias, rtol=0, atol=0)


def test_accumulating_two_batches_equals_one_batch_twice_as_big() -> None:
    raw = _train_raw(batch_size=8, epochs=3)
    stepped_every_batch = _train_raw(batch_size=4, epochs=3)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    prepared, _ = _train_prepared(accelerator, batch_size=4, epochs=3)
    torch.testing.assert_close(prepared.weight, raw.weight)
    torch.testing.assert_close(prepared.bias, raw.bias)
    # The comparison discriminates: stepping on every micro-batch gives other weights.
    assert not torch.allclose(stepped_every_batch.weight, raw.weight, atol=1e-4)


def test_backward_with_num_items_gives_the_mean_gradient_over_the_window() -> None:
    x, y = _regression_data(n=8)
    raw = _linear()
    _mse(raw, x, y).backward()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = _linear()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # Micro-batches of unequal sizes (3 and 5): a per-batch mean would weight them wrongly.
    for xb, yb in ((x[:3], y[:3]), (x[3:], y[3:])):
        with accelerator.accumulate(model):
            loss_sum = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum")
            accelerator.backward(loss_sum, num_items=len(xb))
    assert accelerator.sync_gradients is True
    torch.testing.assert_close(model.weight.grad, raw.weight.grad)
    torch.testing.assert_close(model.bias.grad, raw.bias.grad)


# --- bf16 on CPU ----------------------------------------------------------------------------


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_bf16_model_computes_in_bfloat16_and_returns_float32() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(_mlp())
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    output = model(torch.randn(2, 3))
    assert seen == [torch.bfloat16]
    assert output.dtype == torch.float32


def test_autocast_context_computes_in_bfloat16() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    layer = _linear()
    with accelerator.autocast():
        assert layer(torch.randn(2, 3)).dtype == torch.bfloat16
    assert layer(torch.randn(2, 3)).dtype == torch.float32


def test_autocast_disabled_is_an_fp32_island_in_a_bf16_run() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    layer = _linear()
    with accelerator.autocast():
        with accelerator.autocast(AutocastKwargs(enabled=False)):
            assert layer(torch.randn(2, 3)).dtype == torch.float32


def test_unwrap_model_without_fp32_wrapper_restores_the_model() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(_mlp())
    assert "forward" in model.__dict__
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert unwrapped is model
    assert "forward" not in model.__dict__
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    model(torch.randn(2, 3))
    assert seen == [torch.float32]


def test_policy_describes_bfloat16() -> None:
    description = Accelerator(mixed_precision="bf16").policy.describe()
    assert "bfloat16" in description
    assert "bf16" in description


# --- fp16 on CPU ----------------------------------------------------------------------------


def test_fp16_on_cpu_has_a_grad_scaler() -> None:
    accelerator = Accelerator(mixed_precision="fp16")
    assert isinstance(accelerator.scaler, torch.amp.GradScaler)


def test_fp16_inf_gradient_skips_the_optimizer_and_the_scheduler() -> None:
    # A small initial scale: 65536 overflows float16 activation gradients on this data.
    accelerator = Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256.0)]
    )
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = _regression_data(n=4)

    accelerator.backward(_mse(model, x, y))
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped is False
    assert scheduler.get_last_lr() == pytest.approx([0.05])
    optimizer.zero_grad()

    accelerator.backward(_mse(model, x, y))
    model.weight.grad[0, 0] = float("inf")
    weight = model.weight.detach().clone()
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped is True
    assert scheduler.get_last_lr() == pytest.approx([0.05])
    torch.testing.assert_close(model.weight.detach(), weight, rtol=0, atol=0)


# --- clipping -------------------------------------------------------------------------------


def test_clip_grad_norm_matches_torch() -> None:
    x, y = _regression_data(n=8)
    raw = _linear()
    _mse(raw, x, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(raw.parameters(), 0.1)

    accelerator = Accelerator()
    model = _linear()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(_mse(model, x, y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.1)
    assert norm is not None
    assert norm.item() > 0.1
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(model.weight.grad, raw.weight.grad)
    torch.testing.assert_close(model.bias.grad, raw.bias.grad)


def test_clip_grad_norm_on_an_accumulating_micro_batch_does_nothing() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = _linear()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _regression_data(n=4)
    with accelerator.accumulate(model):
        accelerator.backward(_mse(model, x, y))
        grad = model.weight.grad.clone()
        with pytest.warns(UserWarning, match="accumulation"):
            assert accelerator.clip_grad_norm_(model.parameters(), 1e-6) is None
    torch.testing.assert_close(model.weight.grad, grad, rtol=0, atol=0)


def test_unscale_gradients_twice_in_one_fp16_step_is_an_error() -> None:
    accelerator = Accelerator(mixed_precision="fp16")
    model = _linear()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _regression_data(n=4)
    accelerator.backward(_mse(model, x, y))
    accelerator.unscale_gradients()
    with pytest.raises(RuntimeError, match="already"):
        accelerator.unscale_gradients()


# --- collectives and metrics ----------------------------------------------------------------


def test_collectives_are_identities_on_one_process() -> None:
    accelerator = Accelerator()
    tensor = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(accelerator.gather(tensor), tensor)
    torch.testing.assert_close(accelerator.reduce(tensor, "sum"), tensor)
    torch.testing.assert_close(accelerator.reduce(tensor, "mean"), tensor)
    torch.testing.assert_close(accelerator.pad_across_processes(tensor, dim=1), tensor)
    nested = {"a": tensor, "b": [tensor + 1]}
    gathered = accelerator.gather(nested)
    torch.testing.assert_close(gathered["a"], tensor)
    torch.testing.assert_close(gathered["b"][0], tensor + 1)


def test_gather_for_metrics_yields_every_sample_once() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    gathered = [accelerator.gather_for_metrics(batch) for (batch,) in loader]
    torch.testing.assert_close(torch.cat(gathered), torch.arange(10))


def test_gather_for_metrics_of_strings_uses_objects() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=4))
    names: list[str] = []
    for batch in loader:
        gathered = accelerator.gather_for_metrics([f"s{i}" for i in batch.tolist()])
        assert isinstance(gathered, list)
        names.extend(gathered)
    assert names == [f"s{i}" for i in range(10)]


def test_trigger_is_seen_once_then_reset() -> None:
    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False


# --- models ---------------------------------------------------------------------------------


def test_unwrap_model_of_a_plain_model_returns_it() -> None:
    accelerator = Accelerator()
    model = _linear()
    assert accelerator.unwrap_model(model) is model
    assert accelerator.unwrap_model(accelerator.prepare(model)) is model


@pytest.mark.skipif(
    importlib.util.find_spec("torch._dynamo") is None, reason="torch._dynamo is unavailable"
)
def test_dynamo_backend_compiles_and_unwrap_can_remove_it() -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    accelerator = Accelerator(dynamo_backend="eager")
    model = _linear()
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, OptimizedModule)
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
    assert accelerator.unwrap_model(prepared) is prepared


def test_free_memory_forgets_prepared_objects() -> None:
    accelerator = Accelerator()
    model = _linear()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator._models and accelerator._optimizers
    model, optimizer = accelerator.free_memory(model, optimizer)
    assert model is None and optimizer is None
    assert accelerator._models == []
    assert accelerator._optimizers == []
    assert accelerator.step == 0


def test_get_state_dict_equals_the_model_state_dict() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = _mlp()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    state = accelerator.get_state_dict(accelerator.prepare(model))
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_save_writes_a_loadable_file(tmp_path: Path) -> None:
    accelerator = Accelerator()
    target = tmp_path / "weights.pt"
    state = _linear().state_dict()
    accelerator.save(state, target)
    loaded = torch.load(target, weights_only=True)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value)


def test_profile_yields_a_profiler_and_writes_a_trace(tmp_path: Path) -> None:
    accelerator = Accelerator()
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path / "traces"))
    with accelerator.profile(handler) as profiler:
        assert isinstance(profiler, torch.profiler.profile)
        torch.randn(8, 8) @ torch.randn(8, 8)
    trace = tmp_path / "traces" / "profile_0.json"
    assert trace.is_file()
    json.loads(trace.read_text())


def test_profile_uses_the_handler_from_kwargs_handlers(tmp_path: Path) -> None:
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=os.fspath(tmp_path))
    accelerator = Accelerator(kwargs_handlers=[handler])
    with accelerator.profile():
        torch.ones(2) + 1
    assert (tmp_path / "profile_0.json").is_file()


# --- data and process helpers ---------------------------------------------------------------


def test_skip_first_batches_starts_later_in_the_epoch() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(10), batch_size=2))
    skipped = accelerator.skip_first_batches(loader, num_batches=2)
    assert [batch.tolist() for batch in skipped] == [[4, 5], [6, 7], [8, 9]]


def test_split_between_processes_gives_everything_to_one_process() -> None:
    accelerator = Accelerator()
    with accelerator.split_between_processes([1, 2, 3]) as share:
        assert list(share) == [1, 2, 3]
    with accelerator.split_between_processes({"a": [1, 2], "b": [3, 4]}) as share:
        assert share == {"a": [1, 2], "b": [3, 4]}


def test_main_process_first_runs_the_block() -> None:
    accelerator = Accelerator()
    ran: list[int] = []
    with accelerator.main_process_first():
        ran.append(accelerator.process_index)
    assert ran == [0]


def test_print_prints_on_the_main_process(capsys: pytest.CaptureFixture[str]) -> None:
    Accelerator().print("hello", 42)
    assert capsys.readouterr().out == "hello 42\n"


def test_deepcopy_returns_the_same_accelerator() -> None:
    accelerator = Accelerator()
    assert copy.deepcopy(accelerator) is accelerator


# --- trackers -------------------------------------------------------------------------------


def test_jsonl_tracker_writes_the_logged_values(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with="jsonl", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.1})
    tracker = accelerator.get_tracker("jsonl")
    assert tracker.name == "jsonl"
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["step"] == 1
    assert entry["loss"] == 1.0
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1}


def test_custom_tracker_instance_receives_the_calls() -> None:
    recorder = _RecordingTracker()
    accelerator = Accelerator(log_with=[recorder])
    accelerator.init_trackers("run", config={"lr": 0.1})
    assert accelerator.get_tracker("recorder") is recorder
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    accelerator.log({"loss": 1.0}, step=3)
    accelerator.end_training()
    assert recorder.calls == [
        ("start", None),
        ("config", {"lr": 0.1}),
        ("log", ({"loss": 1.0}, 3)),
        ("finish", None),
    ]


def test_get_tracker_of_an_unknown_name_is_a_blank_tracker() -> None:
    accelerator = Accelerator()
    accelerator.init_trackers("run")
    tracker = accelerator.get_tracker("nope")
    assert isinstance(tracker, GeneralTracker) and tracker.name == "nope"
    assert tracker.tracker is None
    tracker.log({"loss": 1.0}, step=1)
    # a tracker's own methods too: logging code runs unchanged where the tracker is not
    assert tracker.log_images({"sample": [np.zeros((2, 2, 3))]}, step=1) is None
    assert tracker.log_table("t", columns=["a"], data=[[1]]) is None
    with pytest.raises(AttributeError):
        tracker._private  # noqa: B018


def test_failed_construction_leaves_no_state_behind() -> None:
    from accel_state import AcceleratorState, GradientState

    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed: fp8 would succeed")
    with pytest.raises(ImportError, match=r'pip install "accel-amp\[fp8\]"'):
        Accelerator(mixed_precision="fp8", gradient_accumulation_steps=3)
    assert AcceleratorState._shared_state == {}
    assert GradientState._shared_state == {}
    accelerator = Accelerator()  # a corrected retry works
    assert accelerator.mixed_precision == "no"
    assert accelerator.gradient_accumulation_steps == 1
