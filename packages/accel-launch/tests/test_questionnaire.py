"""``accel config``: the questionnaire writes Accelerate's keys, DeepSpeed and FSDP included.

DeepSpeed and FSDP are not implemented in this release, so choosing one stops the questionnaire
(the refusal tests below); the tests marked ``engines_available`` walk the engine questions as
they run once each engine lands.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from accel_launch.cli import build_parser, main
from accel_launch.launch import plan_launch
from accel_launch.questionnaire import QuestionnaireError, ask_config

# The keys Accelerate 1.15's questionnaire writes into each section (commands/config/cluster.py).
ACCELERATE_DEEPSPEED_KEYS = {
    "deepspeed_config_file",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
    "zero3_init_flag",
    "deepspeed_moe_layer_cls_names",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
}
ACCELERATE_FSDP_KEYS = {
    "fsdp_version",
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "fsdp_backward_prefetch",
    "fsdp_state_dict_type",
    "fsdp_forward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states",
    "fsdp_activation_checkpointing",
}


pytestmark = pytest.mark.usefixtures("launch_environment")


def answering(answers: list[str]) -> tuple[list[str], object]:
    """An ``ask`` that gives ``answers`` in order and records the questions."""
    asked: list[str] = []
    pending: Iterator[str] = iter(answers)

    def ask(question: str, default: str) -> str:
        asked.append(question)
        return next(pending)

    return asked, ask


def run_cli(monkeypatch: pytest.MonkeyPatch, target: Path, answers: list[str]) -> int:
    pending = iter(answers)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    return main(["config", "--config_file", str(target)])


def test_all_defaults_give_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "cfg.yaml"
    assert run_cli(monkeypatch, target, [""] * 5) == 0
    written = yaml.safe_load(target.read_text())
    assert written["distributed_type"] == "NO" and written["num_processes"] == 1
    assert "deepspeed_config" not in written and "fsdp_config" not in written


@pytest.mark.usefixtures("engines_available")
def test_deepspeed_answers_write_accelerates_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "ds.yaml"
    answers = [
        "multi-cpu",  # kind
        "2",  # processes
        "1",  # machines
        "yes",  # DeepSpeed
        "no",  # JSON file
        "3",  # ZeRO stage
        "cpu",  # optimizer offload
        "none",  # parameter offload
        "4",  # accumulation steps
        "yes",  # clipping
        "0.5",  # norm
        "yes",  # 16-bit save
        "no",  # zero.Init
        "no",  # MoE
        "bf16",  # precision
    ]
    assert run_cli(monkeypatch, target, answers) == 0
    written = yaml.safe_load(target.read_text())
    assert written["distributed_type"] == "DEEPSPEED"
    assert written["mixed_precision"] == "bf16"
    section = written["deepspeed_config"]
    assert set(section) <= ACCELERATE_DEEPSPEED_KEYS
    assert section == {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": False,
    }
    # The file drives a launch: engine and settings come from it.
    capsys.readouterr()
    args = build_parser().parse_args(["launch", "--config_file", str(target), "train.py"])
    (tmp_path / "train.py").write_text("")
    args.training_script = str(tmp_path / "train.py")
    plan = plan_launch(args, os.environ)
    env = plan["env"]
    assert env["ACCEL_USE_DEEPSPEED"] == "true"
    assert env["ACCEL_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert env["ACCEL_GRADIENT_CLIPPING"] == "0.5"
    assert env["ACCEL_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert plan["settings"]["zero_stage"].source == f"config {target}"


@pytest.mark.usefixtures("engines_available")
def test_deepspeed_with_a_json_file(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    asked, ask = answering(["no", "", "", "yes", "yes", str(ds), "yes", "no", "fp16"])
    data = ask_config(ask)  # type: ignore[arg-type]
    assert data["deepspeed_config"] == {"deepspeed_config_file": str(ds), "zero3_init_flag": True}
    assert not any("ZeRO stage" in question for question in asked)


@pytest.mark.torch_feature("fully_shard")
@pytest.mark.usefixtures("engines_available")
def test_fsdp2_answers_write_accelerates_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "fsdp.yaml"
    answers = [
        "multi-gpu",
        "4",
        "1",
        "no",  # DeepSpeed
        "yes",  # FSDP (FSDP2: no version is asked)
        "yes",  # reshard after forward
        "no",  # offload
        "TRANSFORMER_BASED_WRAP",
        "no",  # _no_split_modules
        "LlamaDecoderLayer",
        "",  # state dict: SHARDED_STATE_DICT
        "yes",  # cpu ram efficient loading
        "yes",  # activation checkpointing
        "bf16",
    ]
    assert run_cli(monkeypatch, target, answers) == 0
    written = yaml.safe_load(target.read_text())
    assert written["distributed_type"] == "FSDP"
    section = written["fsdp_config"]
    assert set(section) <= ACCELERATE_FSDP_KEYS
    assert section == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": True,
    }


@pytest.mark.torch_feature("fully_shard")
@pytest.mark.usefixtures("engines_available")
def test_fsdp_asks_no_version_and_no_fsdp1_questions() -> None:
    answers = ["multi-cpu", "2", "1", "no", "yes", "no", "no", "SIZE_BASED_WRAP", "1000", "",
               "no", "no", "no"]  # fmt: skip
    asked, ask = answering(answers)
    section = ask_config(ask)["fsdp_config"]  # type: ignore[arg-type]
    assert section["fsdp_version"] == 2
    assert section["fsdp_reshard_after_forward"] is False
    assert section["fsdp_min_num_params"] == 1000
    assert section["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert not any("version" in question or "prefetch" in question for question in asked)
    assert set(section) <= ACCELERATE_FSDP_KEYS


def test_one_process_is_not_offered_fsdp() -> None:
    asked, ask = answering(["no", "1", "1", "no", "no"])
    assert ask_config(ask)["distributed_type"] == "NO"  # type: ignore[arg-type]
    assert not any("FSDP" in question for question in asked)


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        (["many-gpu"], r"'many-gpu' is not an answer to 'Which kind of machine\?'"),
        (["no", "zero"], "give a whole number >= 1"),
        (["no", "1", "1", "perhaps"], "answer yes or no"),
        (["no", "1", "1", "yes", "no", "5"], "choose one of 0, 1, 2, 3"),
    ],
)
@pytest.mark.usefixtures("engines_available")
def test_bad_answers_name_the_question(answers: list[str], message: str) -> None:
    _, ask = answering(answers)
    with pytest.raises(QuestionnaireError, match=message):
        ask_config(ask)  # type: ignore[arg-type]


@pytest.mark.usefixtures("engines_available")
def test_a_bad_answer_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cfg.yaml"
    assert run_cli(monkeypatch, target, ["many-gpu"]) == 2
    assert "nothing was written" in capsys.readouterr().err
    assert not target.exists()
    assert run_cli(monkeypatch, target, ["multi-cpu"]) == 2  # input ends early
    assert not target.exists()
    # A DeepSpeed JSON that does not exist is caught before writing.
    answers = ["no", "1", "1", "yes", "yes", str(tmp_path / "missing.json"), "no", "no", "no"]
    assert run_cli(monkeypatch, target, answers) == 2
    assert "missing.json" in capsys.readouterr().err
    assert not target.exists()
