"""``accel launch`` and Accelerate's variable names: read as accel's, written where they matter.

Where ``accelerate`` is accel's alias, transformers in the processes reads Accelerate's names
(``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_USE_FSDP``): the launcher
gives them. Elsewhere it overwrites only the ones this shell sets, so the processes never see
the two spellings disagree.
"""

from __future__ import annotations

import os

import pytest

from accel_launch import launch as launch_module
from accel_launch.cli import build_parser
from accel_launch.launch import LaunchError, plan_launch
from accel_state.accelerate_alias import AliasStatus

pytestmark = pytest.mark.usefixtures("launch_environment")

ALIAS = AliasStatus(in_process=False, installed="/venv/site-packages", foreign=None)
NO_ALIAS = AliasStatus(in_process=False, installed=None, foreign=None)


def _env(argv: list[str], script: str) -> dict[str, str]:
    args = build_parser().parse_args(["launch", *argv, script])
    return dict(plan_launch(args, os.environ)["env"])


@pytest.mark.torch_feature("fully_shard")
def test_where_the_alias_is_installed_the_processes_get_accelerates_names(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_module, "alias_status", lambda: ALIAS)
    env = _env(["--cpu", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4"], script)
    assert env["ACCEL_MIXED_PRECISION"] == env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCEL_USE_CPU"] == env["ACCELERATE_USE_CPU"] == "true"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    env = _env(["--use_fsdp", "--num_processes", "2"], script)
    assert env["ACCEL_USE_FSDP"] == env["ACCELERATE_USE_FSDP"] == "true"


def test_without_the_alias_only_the_shells_accelerate_names_are_overwritten(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_module, "alias_status", lambda: NO_ALIAS)
    env = _env(["--cpu", "--mixed_precision", "bf16"], script)
    assert not any(name.startswith("ACCELERATE_") for name in env)
    # a job script set Accelerate's name; the flag wins, in both spellings
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    env = _env(["--cpu", "--mixed_precision", "bf16"], script)
    assert env["ACCEL_MIXED_PRECISION"] == env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_accelerates_names_in_the_shell_are_settings(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_module, "alias_status", lambda: NO_ALIAS)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = build_parser().parse_args(["launch", "--cpu", script])
    plan = plan_launch(args, os.environ)
    setting = plan["settings"]["mixed_precision"]
    assert (setting.value, setting.source) == ("bf16", "env ACCELERATE_MIXED_PRECISION")
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    with pytest.raises(LaunchError, match="ACCELERATE_MIXED_PRECISION='bf16'"):
        plan_launch(args, os.environ)
