"""``DeepSpeedPlugin``: fields, ``ACCEL_DEEPSPEED_*`` variables, config files, contradictions.

These need no DeepSpeed installed; the engine itself is tested in
test_deepspeed_multiprocess.py (the ``deepspeed`` nox session).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from accel import Accelerator
from accel.utils import DeepSpeedPlugin
from accel_state import AcceleratorState


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
            r"zero_stage=2\) contradicts zero_optimization.stage=3",
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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"deepspeed_plugin": DeepSpeedPlugin(), "deepspeed_plugins": {"a": DeepSpeedPlugin()}},
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
