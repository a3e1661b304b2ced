"""``accel merge-weights`` and ``accel to-fsdp2``: the commands and their functions."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from accel.commands.to_fsdp2 import convert_config_to_fsdp2
from accel.model_files import load_model_files
from accel.utils import merge_fsdp_weights
from accel_launch.cli import main


def _dcp_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A checkpoint root with a DCP model folder, as save_state's SHARDED_STATE_DICT writes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = root / "pytorch_model_fsdp_0"
    # torch 2.5 (the floor) has no no_dist: without a process group it saves in one process
    alone = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(folder), **alone)
    (root / "random_states_0.pkl").write_bytes(b"")
    return state


@pytest.mark.parametrize("given", ["root", "folder"])
def test_merge_weights_accepts_the_checkpoint_root_or_its_dcp_folder(
    tmp_path: Path, given: str
) -> None:
    expected = _dcp_checkpoint(tmp_path / "checkpoint")
    source = tmp_path / "checkpoint"
    if given == "folder":
        source = source / "pytorch_model_fsdp_0"
    assert merge_fsdp_weights(source, tmp_path / "out") == ["model.safetensors"]
    merged = load_model_files(tmp_path / "out")
    assert sorted(merged) == sorted(expected)
    assert all(torch.equal(merged[k], expected[k]) for k in expected)


def test_merge_weights_command_and_its_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _dcp_checkpoint(tmp_path / "checkpoint")
    code = main(
        ["merge-weights", str(tmp_path / "checkpoint"), str(tmp_path / "out"),
         "--unsafe_serialization", "--remove_checkpoint_dir"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "pytorch_model.bin").exists()
    assert not (tmp_path / "checkpoint" / "pytorch_model_fsdp_0").exists()
    assert set(load_model_files(tmp_path / "out")) == set(expected)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    assert main(["merge-weights", str(tmp_path / "plain"), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "is not a sharded FSDP checkpoint" in err and "notes.txt" in err
    assert not (tmp_path / "o2").exists()


FSDP1 = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_use_orig_params": True,
        "fsdp_sync_module_states": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    },
}


def test_to_fsdp2_converts_like_accelerate() -> None:
    converted = convert_config_to_fsdp2(FSDP1)
    assert converted["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    assert converted["num_processes"] == 2
    assert FSDP1["fsdp_config"]["fsdp_version"] == 1  # the input is not changed
    assert convert_config_to_fsdp2(converted) == converted  # already FSDP2
    with pytest.raises(ValueError, match="NO_SHARD shards nothing"):
        convert_config_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}})


@pytest.mark.torch_feature("fully_shard")
def test_to_fsdp2_command_writes_a_config_the_launcher_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = tmp_path / "fsdp1.yaml", tmp_path / "fsdp2.yaml"
    source.write_text(yaml.safe_dump(FSDP1))
    assert main(["to-fsdp2", "--config_file", str(source)]) == 2
    assert "--output_file" in capsys.readouterr().err
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(target)]) == 0
    assert yaml.safe_load(target.read_text())["fsdp_config"]["fsdp_version"] == 2
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(target)]) == 2
    assert "exists" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["launch", "--config_file", str(target), "--dry_run", str(script)]) == 0
    assert main(["launch", "--config_file", str(source), "--dry_run", str(script)]) == 2
    assert "accel to-fsdp2" in capsys.readouterr().err
