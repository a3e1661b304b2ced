"""``accel launch`` reads the one engine registry (accel_state.engine_requests.REGISTRY)."""

from __future__ import annotations

import pytest

from accel_launch import engines as launch_engines
from accel_state import DistributedType, engine_requests
from accel_state.engine_requests import ENGINES, REGISTRY, EngineSpec


def test_the_launchers_engines_are_the_rows_with_launch_settings() -> None:
    with_settings = sorted(spec.key for spec in REGISTRY if spec.settings)
    assert launch_engines.ENGINES == ("none", *with_settings)
    assert set(launch_engines.engine_switch_names()) == {
        name
        for spec in ENGINES.values()
        if spec.switch
        for name in (spec.switch, "ACCELERATE_" + spec.switch.removeprefix("ACCEL_"))
    }


def test_every_rows_flag_asks_for_it() -> None:
    for spec in ENGINES.values():
        flag = spec.flag.removeprefix("--")
        requests = launch_engines.launch_engine_requests({flag: True}, {}, None, None)
        assert [request.engine for request in requests] == [spec.key], spec.flag


def test_a_new_row_is_asked_for_by_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = EngineSpec(
        "toy",
        "Toy engine",
        "ACCEL_USE_TOY",
        "--use_toy",
        True,
        "train with DDP",
        distributed_type=DistributedType.MEGATRON_LM,
    )
    monkeypatch.setattr(engine_requests, "ENGINES", {**ENGINES, "toy": toy})
    requests = launch_engines.launch_engine_requests({"use_toy": True}, {}, None, None)
    assert [(r.engine, r.source) for r in requests] == [("toy", "--use_toy")]
    assert "ACCELERATE_USE_TOY" in launch_engines.engine_switch_names()
