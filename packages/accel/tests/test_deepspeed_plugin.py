"""``DeepSpeedPlugin``: fields, ``ACCEL_DEEPSPEED_*`` variables, config files, contradictions.

The plugin tests need no DeepSpeed installed. Those marked ``needs_deepspeed`` prepare on one
process (the engine's one-rank group; the ``deepspeed`` nox session runs them): what
``prepare`` does with the config (Accelerate 1.15's tests/deepspeed checks that run on a CPU:
"auto" values, optimizer and scheduler pairing, MoE leaf modules, a second Accelerator, the
accumulation boundaries, the norm ``clip_grad_norm_`` returns). Training on 2 ranks is
test_deepspeed_multiprocess.py's.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel import Accelerator
from accel.utils import DeepSpeedPlugin
from accel_state import AcceleratorState, GradientState
from accel_state.testing import require_reasons

_MISSING = require_reasons(modules=("deepspeed",))
if not _MISSING:
    # DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK when first imported: at collection, so the
    # leak check charges no test with it.
    import deepspeed  # noqa: F401
needs_deepspeed = pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING))


def test_fields_build_the_config_with_accelerates_defaults() -> None:
    plugin = DeepSpeedPlugin()
    assert (plugin.zero_stage, plugin.gradient_clipping) == (2, "auto")
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 2
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"
    assert plugin.deepspeed_config["zero_optimization"]["offload_param"] == {"device": "none"}
    assert plugin.zero3_init_flag is False
    assert DeepSpeedPlugin(zero_stage=3).zero3_init_flag is True  # ZeRO-3's default


def test_the_launcher_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCEL_GRADIENT_CLIPPING", "0.5")
    monkeypatch.setenv("ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3 and plugin.gradient_clipping == 0.5
    assert plugin.get_value("zero_optimization.offload_optimizer.device") == "cpu"
    assert DeepSpeedPlugin(zero_stage=1).zero_stage == 1  # an explicit field wins


def test_a_config_file_is_the_config_and_fills_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3}))
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    assert (plugin.zero_stage, plugin.gradient_clipping) == (3, 0.3)
    assert plugin.is_zero3()
    auto = {"zero_optimization": {"stage": "auto"}, "gradient_clipping": "auto"}
    filled = DeepSpeedPlugin(hf_ds_config=auto, zero_stage=1, gradient_clipping=2.0)
    assert filled.get_value("zero_optimization.stage") == 1
    assert filled.get_value("gradient_clipping") == 2.0
    assert auto["zero_optimization"]["stage"] == "auto"  # the caller's dict is not changed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hf_ds_config": {"train_batch_size": 8}}, "specify the ZeRO optimization config"),
        (
            {"hf_ds_config": {"zero_optimization": {"stage": 3}}, "zero_stage": 2},
            r"zero_stage=2\) \(`accel launch --zero_stage`\) contradicts zero_optimization.stage=3",
        ),
        ({"hf_ds_config": "/no/such.json"}, "no such file"),
        ({"zero_stage": 2, "zero3_init_flag": True}, "zero3_init_flag=True\\) with ZeRO stage 2"),
        ({"zero_stage": 5}, "stage=5"),
    ],
)
def test_bad_settings_are_refused_naming_both_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeepSpeedPlugin(**kwargs)


def test_ms_amp_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="MS-AMP"):
        DeepSpeedPlugin(enable_msamp=True)


def test_without_deepspeed_the_accelerator_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "accel\[deepspeed\]"'):
        Accelerator(deepspeed_plugin=DeepSpeedPlugin())
    assert AcceleratorState._shared_state == {}


def test_several_plugins_select_the_first_and_switch_by_name() -> None:
    student, teacher = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    state = AcceleratorState(cpu=True, deepspeed_plugin={"student": student, "teacher": teacher})
    try:
        assert state.distributed_type == "DEEPSPEED"
        assert state.deepspeed_plugin is student and (student.selected, teacher.selected) == (
            True,
            False,
        )
        state.select_deepspeed_plugin("teacher")
        assert state.deepspeed_plugin is teacher and not student.selected
        assert state.get_deepspeed_plugin("student") is student
        with pytest.raises(ValueError, match=r"'ghost' is not a DeepSpeed plugin.*\['student'"):
            state.select_deepspeed_plugin("ghost")
        assert state.deepspeed_plugin is teacher  # a bad name changes nothing
        with pytest.raises(ValueError, match="select_deepspeed_plugin"):
            student.select()  # only the state selects, so the others are unselected too
        with pytest.raises(NotImplementedError, match="select_deepspeed_plugin"):
            student.selected = True  # type: ignore[misc]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("argument", ["deepspeed_plugin", "deepspeed_plugins"])
@needs_deepspeed
def test_the_accelerator_takes_named_plugins_in_either_argument(argument: str) -> None:
    # Accelerate's recipe for a student and a teacher: Accelerator(deepspeed_plugin={...})
    student, teacher = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    try:
        accelerator = Accelerator(cpu=True, **{argument: {"student": student, "teacher": teacher}})
        state = accelerator.state
        assert state.deepspeed_plugins == {"student": student, "teacher": teacher}
        assert state.deepspeed_plugin is student
        state.select_deepspeed_plugin("teacher")
        assert accelerator.state.deepspeed_plugin is teacher
        accelerator.end_training()  # the one-rank group DeepSpeed was given
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"deepspeed_plugin": DeepSpeedPlugin(), "deepspeed_plugins": {"a": DeepSpeedPlugin()}},
            ValueError,
            "pass one of them",
        ),
        (
            {
                "deepspeed_plugin": {"a": DeepSpeedPlugin()},
                "deepspeed_plugins": {"b": DeepSpeedPlugin()},
            },
            ValueError,
            "pass one of them",
        ),
        ({"deepspeed_plugins": {}}, ValueError, "holds no plugin"),
        ({"deepspeed_plugins": [DeepSpeedPlugin()]}, TypeError, "dict of names"),
        ({"deepspeed_plugins": {"a": object()}}, TypeError, "dict of names"),
    ],
)
def test_bad_deepspeed_plugins_are_refused_before_any_state(
    kwargs: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Accelerator(**kwargs)
    assert AcceleratorState._shared_state == {}


def test_model_init_config_fills_what_zero_init_reads() -> None:
    plugin = DeepSpeedPlugin(zero_stage=3)
    assert plugin.zero3_init_flag  # ZeRO-3's default, as in Accelerate
    config = plugin.model_init_config()
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert config["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in config and config["gradient_clipping"] == 0.0
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"  # the plugin's stays as it was


def test_zero3_init_context_manager_toggles_the_flag_and_refuses_below_zero3() -> None:
    plugin = DeepSpeedPlugin(zero_stage=3)
    with plugin.zero3_init_context_manager(enable=False):
        assert plugin.zero3_init_flag is False
    assert plugin.zero3_init_flag is True
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        with DeepSpeedPlugin(zero_stage=2).zero3_init_context_manager(enable=True):
            pass


def test_zero3_init_context_needs_the_accelerator_first() -> None:
    from accel.utils.deepspeed import zero3_init_context

    with zero3_init_context(DeepSpeedPlugin(zero_stage=2)):  # not ZeRO-3 init: built normally
        assert torch.nn.Linear(2, 2).weight.numel() == 4
    with pytest.raises(RuntimeError, match=r"create the Accelerator\(deepspeed_plugin=...\) first"):
        with zero3_init_context(DeepSpeedPlugin(zero_stage=3)):
            pass


def test_hf_deepspeed_config_reads_dicts_files_and_base64(tmp_path: Path) -> None:
    import base64

    from accel.utils.deepspeed import HfDeepSpeedConfig

    config = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    for source in (config, str(path), encoded):
        hf = HfDeepSpeedConfig(source)
        assert hf.is_zero3() and not hf.is_zero2() and hf.is_offload()
        assert hf.get_value("zero_optimization.offload_param.device") == "cpu"
        assert hf.get_value("zero_optimization.missing.key", 7) == 7
        assert hf.is_true("bf16.enabled") and hf.is_false("fp16.enabled")
        assert not hf.is_false("not.there")
    hf = HfDeepSpeedConfig(config)
    hf.del_config_sub_tree("bf16.enabled")
    assert hf.get_value("bf16") == {} and config["bf16"] == {"enabled": True}  # a copy
    with pytest.raises(ValueError, match="Can't find nope"):
        hf.del_config_sub_tree("nope", must_exist=True)
    with pytest.raises(ValueError, match="expected a dict, a path to a JSON file or base64"):
        HfDeepSpeedConfig("not/a/file.json")


# --- "auto" filled from the plugin ------------------------------------------------------------

GATHER = "zero_optimization.stage3_gather_16bit_weights_on_model_save"


@pytest.mark.parametrize(
    ("kwargs", "variable", "expected"),
    [
        ({}, None, False),
        ({"zero3_save_16bit_model": True}, None, True),
        ({}, "ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
        ({}, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),  # Accelerate's spelling
    ],
)
def test_an_auto_16bit_gather_is_the_plugins_save_16bit_setting(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], variable: str | None, expected: bool
) -> None:
    # Accelerate's shipped ds_config_zero3.json says "auto" there
    if variable is not None:
        monkeypatch.setenv(variable, "true")
    config = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config, **kwargs)
    assert plugin.get_value(GATHER) is expected
    assert plugin.zero3_save_16bit_model is expected
    with pytest.raises(ValueError, match="contradicts zero_optimization.stage3_gather_16bit"):
        explicit = {"zero_optimization": {"stage": 3, GATHER.split(".")[1]: True}}
        DeepSpeedPlugin(hf_ds_config=explicit, zero3_save_16bit_model=False)


class MyMoE(nn.Module):
    """A mixture of experts: only some experts run for a token (a ZeRO-3 leaf module)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x)  # the other expert gets no gradient


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = MyMoE()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def test_moe_class_names_come_from_the_variable_and_unknown_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MyMoE,Linear")
    assert DeepSpeedPlugin(zero_stage=3).transformer_moe_cls_names == "MyMoE,Linear"
    plugin = DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="MyMoE,Qwen2MoeSparseMoeBlock")
    model = MoEModel()
    with pytest.raises(ValueError, match="called 'Qwen2MoeSparseMoeBlock' to wrap") as info:
        plugin.set_moe_leaf_modules(model)  # checked before DeepSpeed is even imported
    assert str(info.value).endswith("modules: Linear, MoEModel, ModuleList, MyMoE")
    assert not hasattr(model.moe, "_z3_leaf")  # nothing marked


# --- prepare on one process (DeepSpeed installed) ---------------------------------------------


def _model(hidden: dict[str, Any] | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if hidden is not None:
        model.config = SimpleNamespace(**hidden)  # type: ignore[assignment]
    return model


def _loader(**kwargs: Any) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(dataset, **(kwargs or {"batch_size": 2}))


@pytest.fixture
def made() -> Iterator[list[Accelerator]]:
    """The test's Accelerators, ended afterwards (their one-rank group and DeepSpeed with it)."""
    accelerators: list[Accelerator] = []
    yield accelerators
    for accelerator in accelerators:
        accelerator.end_training()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(made: list[Accelerator], plugin: Any, **kwargs: Any) -> Accelerator:
    made.append(Accelerator(cpu=True, deepspeed_plugin=plugin, **kwargs))
    return made[-1]


def _restart(made: list[Accelerator]) -> None:
    """End the test's run, so the next Accelerator starts another one."""
    for accelerator in made:
        accelerator.end_training()
    made.clear()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# Accelerate's tests/deepspeed/ds_config_zero3.json, as shipped (its "auto"s included).
SHIPPED_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


@needs_deepspeed
def test_accelerates_shipped_zero3_config_trains_a_bf16_step(made: list[Accelerator]) -> None:
    from accel.utils import DummyOptim, DummyScheduler

    accelerator = _accelerator(
        made, DeepSpeedPlugin(hf_ds_config=SHIPPED_ZERO3), mixed_precision="bf16"
    )
    model = _model({"hidden_sizes": [16, 64, 32]})  # the largest sizes the buckets
    optimizer = DummyOptim(model.parameters(), lr=0.01, weight_decay=0.0)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=1)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(), scheduler
    )
    config = accelerator.engine.resolved_config
    zero = config["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert [zero[k] for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size")] == [4096, 3686]
    assert zero["stage3_param_persistence_threshold"] == 640
    assert (config["bf16"]["enabled"], config["fp16"]["enabled"]) == (True, False)
    assert config["optimizer"]["params"]["lr"] == 0.01
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["train_batch_size"] == 2
    before = accelerator.get_state_dict(model)["0.weight"].clone()
    for xb, yb in loader:  # WarmupLR starts at warmup_min_lr (0): the first step moves nothing
        accelerator.backward(F.mse_loss(model(xb.to(torch.bfloat16)).float(), yb))
        optimizer.step()
        scheduler.step()
    assert not torch.equal(before, accelerator.get_state_dict(model)["0.weight"])


@needs_deepspeed
def test_an_auto_nothing_fills_is_named_with_its_own_fix(made: list[Accelerator]) -> None:
    config = {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}
    accelerator = _accelerator(made, DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    with pytest.raises(ValueError, match="cannot fill") as info:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader())
    assert "give zero_optimization.sub_group_size a value" in str(info.value)
    assert "bucket" not in str(info.value)  # not a bucket size: no bucket-size advice


SCHEDULED = {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}
CONFIG_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}


def _lambda(optimizer: Any) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@needs_deepspeed
@pytest.mark.parametrize(
    ("sections", "dummy_optimizer", "scheduler", "match"),
    [
        (
            {},
            False,
            "dummy",
            "Either specify a scheduler in the config file or pass in the "
            "`lr_scheduler_callable` parameter when using `accel.utils.DummyScheduler`.",
        ),
        (
            {"scheduler": SCHEDULED},
            False,
            "torch",
            "You cannot specify a scheduler in the config file and in the code at the same time",
        ),
        (
            {"scheduler": SCHEDULED, "optimizer": CONFIG_OPTIMIZER},
            True,
            "torch",
            "You cannot specify a scheduler in the config file and in the code at the same time",
        ),
        (
            {"optimizer": CONFIG_OPTIMIZER},
            True,
            "torch",
            "You can only specify `accel.utils.DummyScheduler` in the code when using "
            "`accel.utils.DummyOptim`",
        ),
    ],
)
def test_optimizer_and_scheduler_pairings_are_refused_in_accelerates_words(
    made: list[Accelerator],
    sections: dict[str, Any],
    dummy_optimizer: bool,
    scheduler: str,
    match: str,
) -> None:
    from accel.utils import DummyOptim, DummyScheduler

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **sections})
    accelerator = _accelerator(made, plugin)
    model = _model()
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = DummyOptim(model.parameters(), lr=0.1) if dummy_optimizer else torch_optimizer
    scheduled = DummyScheduler(optimizer) if scheduler == "dummy" else _lambda(torch_optimizer)
    with pytest.raises(ValueError, match=re.escape(match)):
        accelerator.prepare(model, optimizer, _loader(), scheduled)
    model = _model()  # nothing of the refused call stays: a right one prepares
    right: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    if dummy_optimizer:
        right = DummyOptim(model.parameters(), lr=0.1)
    prepared = accelerator.prepare(model, right, _loader())
    assert type(prepared[0]).__name__ == "DeepSpeedEngine"


@needs_deepspeed
def test_schedulers_deepspeed_builds_are_wrapped_and_batch_sizes_found(
    made: list[Accelerator],
) -> None:
    from accel.utils import DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler

    plugin = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "optimizer": CONFIG_OPTIMIZER}
    )
    accelerator = _accelerator(made, plugin)
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    built: list[Any] = []

    def build(inner: Any) -> Any:
        built.append(_lambda(inner))
        return built[-1]

    sampler = torch.utils.data.BatchSampler(range(8), batch_size=4, drop_last=False)
    _, _, _, scheduler = accelerator.prepare(
        model,
        optimizer,
        _loader(batch_sampler=sampler),
        DummyScheduler(optimizer, lr_scheduler_callable=build),
    )
    assert isinstance(scheduler, DeepSpeedSchedulerWrapper) and scheduler.scheduler is built[0]
    assert accelerator.engine.resolved_config["train_micro_batch_size_per_gpu"] == 4
    _restart(made)

    # a torch optimizer and the config's scheduler, stood for by a DummyScheduler
    plugin = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "scheduler": SCHEDULED}
    )
    accelerator = _accelerator(made, plugin)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, _, scheduler = accelerator.prepare(model, optimizer, _loader(), DummyScheduler(optimizer))
    assert type(scheduler.scheduler).__name__ == "WarmupLR"
    _restart(made)

    # no loader in this call nor before, and the micro batch left at "auto"
    accelerator = _accelerator(made, DeepSpeedPlugin(zero_stage=2))
    model = _model()
    with pytest.raises(ValueError, match="requires you to pass at least one training or eval"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


@needs_deepspeed
@pytest.mark.parametrize("source", ["field", "variable"])
def test_moe_blocks_become_zero3_leaves_and_train(
    made: list[Accelerator], monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    if source == "variable":
        monkeypatch.setenv("ACCEL_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MyMoE")
        plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False)
    else:
        plugin = DeepSpeedPlugin(
            zero_stage=3, zero3_init_flag=False, transformer_moe_cls_names="MyMoE"
        )
    accelerator = _accelerator(made, plugin)
    model = MoEModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    leaves = sorted(
        name for name, m in model.module.named_modules() if getattr(m, "_z3_leaf", False)
    )
    assert leaves == ["moe"]
    before = accelerator.get_state_dict(model)["moe.experts.0.weight"].clone()
    for xb, yb in loader:  # one expert unused each step: a leaf module does not hang on it
        accelerator.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
    assert not torch.equal(before, accelerator.get_state_dict(model)["moe.experts.0.weight"])


@needs_deepspeed
def test_a_second_accelerator_cannot_bring_its_own_deepspeed_plugin(
    made: list[Accelerator],
) -> None:
    first = DeepSpeedPlugin(zero_stage=2)
    _accelerator(made, first)
    for argument in (
        {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3)},
        {"deepspeed_plugin": {"b": first}},
        {"deepspeed_plugins": {"b": first}},
    ):
        with pytest.raises(
            NotImplementedError, match="when creating a second `Accelerator`"
        ) as info:
            Accelerator(**argument)
        assert "already has ['default']" in str(info.value)
    assert Accelerator().deepspeed_plugin is first  # without one it shares the run's


@needs_deepspeed
@pytest.mark.parametrize(
    ("steps", "pattern"), [(4, [False, False, False, True]), (2, [False, True])]
)
def test_the_plugins_accumulation_sets_the_boundaries(
    made: list[Accelerator], steps: int, pattern: list[bool]
) -> None:
    accelerator = _accelerator(
        made, DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=steps)
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(batch_size=2))
    assert accelerator.gradient_accumulation_steps == steps
    seen = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            seen.append(accelerator.sync_gradients)
    assert seen == pattern * (4 // steps)
    assert model.global_steps == 4 // steps


@needs_deepspeed
def test_clip_grad_norm_returns_deepspeeds_norm_as_a_float(made: list[Accelerator]) -> None:
    accelerator = _accelerator(made, DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0))
    plain = _model()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    assert accelerator.clip_grad_norm_(model.parameters(), 1.0) is None  # no step yet
    xb, yb = next(iter(loader))
    accelerator.backward(F.mse_loss(model(xb), yb))
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    F.mse_loss(plain(xb), yb).backward()  # the oracle: the same batch, plain torch
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
    assert type(norm) is float and norm == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="`accel launch --gradient_clipping 0.5`"):
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
