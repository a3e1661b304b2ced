"""``DeepSpeedPlugin``: fields, ``ACCEL_DEEPSPEED_*`` variables, config files, contradictions.

These need no DeepSpeed installed; the engine itself is tested in
test_deepspeed_multiprocess.py (the ``deepspeed`` nox session).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
