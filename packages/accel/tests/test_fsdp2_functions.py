"""Accelerate's one-object FSDP checkpoint functions (what they refuse) and its module helper.

Their round trips (full files and sharded folders, the optimizer too, reading what
``save_state`` wrote, a missing folder) run on 2 ranks in test_fsdp2_multiprocess.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from accel.utils.fsdp_utils import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)

SHARDED = SimpleNamespace(state_dict_type="SHARDED_STATE_DICT")


def test_they_need_the_runs_process_group(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"save_fsdp_model\(\) needs the FSDP2 run's process"):
        save_fsdp_model(SHARDED, None, model, tmp_path)
    with pytest.raises(RuntimeError, match=r"load_fsdp_optimizer\(\).*prepare"):
        load_fsdp_optimizer(SHARDED, None, object(), model, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_per_rank_files_are_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="use_dcp=True"):
        save_fsdp_model(SHARDED, None, nn.Linear(2, 2), tmp_path, use_dcp=False)
    with pytest.raises(NotImplementedError, match=r"load_fsdp_model\(use_dcp=False\)"):
        load_fsdp_model(SHARDED, None, nn.Linear(2, 2), tmp_path, use_dcp=False)


def test_fsdp1s_local_state_dict_is_refused(tmp_path: Path) -> None:
    plugin = SimpleNamespace(state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(ValueError, match="'LOCAL_STATE_DICT' is FSDP1's.*SHARDED_STATE_DICT"):
        save_fsdp_optimizer(plugin, None, object(), nn.Linear(2, 2), tmp_path)


def test_get_parameters_from_modules_by_pattern_or_modules() -> None:
    from accel.utils.fsdp_utils import get_parameters_from_modules

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
    assert get_parameters_from_modules(None, model, "cpu") == set()
    found = get_parameters_from_modules(r"1\.0", model, "cpu")  # the full name must match
    assert found == set(model[1][0].parameters())
    assert get_parameters_from_modules("1", model, "cpu") == set(model[1].parameters())
    assert get_parameters_from_modules([model[0]], model, "cpu") == set(model[0].parameters())
    assert get_parameters_from_modules("nothing", model, "cpu") == set()
