"""Launch settings: flag > environment > config file > default, with the source of each value."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from accel_launch import settings as settings_module
from accel_launch.config import ClusterConfig, load_config_from_file
from accel_launch.settings import (
    ENV_VARS,
    LAUNCH_KEYS,
    Setting,
    format_settings_table,
    resolve_launch_settings,
)
from accel_state.environment import (
    ACCEL_DEBUG_MODE,
    ACCEL_DYNAMO_BACKEND,
    ACCEL_GRADIENT_ACCUMULATION_STEPS,
    ACCEL_MIXED_PRECISION,
    ACCEL_USE_CPU,
)

CONFIG_PATH = "/etc/accel/cluster.yaml"
CONFIG = f"config {CONFIG_PATH}"


@pytest.fixture(autouse=True)
def _eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "_physical_cores", lambda: 8)


def resolve(
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    config: ClusterConfig | None = None,
    devices: int = 0,
    source: str | None = CONFIG_PATH,
) -> dict[str, Setting]:
    return resolve_launch_settings(flags or {}, environ or {}, config, source, devices)


def from_file(tmp_path: Path, text: str) -> tuple[ClusterConfig, str]:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config_from_file(path), str(path)


# --- defaults -----------------------------------------------------------------------------


def test_defaults_on_a_cpu_only_machine() -> None:
    got = resolve()
    assert list(got) == list(LAUNCH_KEYS)
    assert all(item.source == "default" for item in got.values())
    values = {key: item.value for key, item in got.items()}
    assert values == {
        "num_processes": 1,
        "num_machines": 1,
        "machine_rank": 0,
        "main_process_ip": None,
        "main_process_port": None,
        "mixed_precision": "no",
        "use_cpu": True,
        "gradient_accumulation_steps": None,
        "dynamo_backend": "no",
        "dynamo_mode": "default",
        "dynamo_use_fullgraph": False,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": False,
        "rdzv_backend": "static",
        "max_restarts": 0,
        "monitor_interval": 0.1,
        "num_cpu_threads_per_process": 8,
        "gpu_ids": "all",
        "enable_cpu_affinity": False,
        "debug": False,
        "same_network": False,
    }


def test_defaults_with_accelerators() -> None:
    got = resolve(devices=4)
    assert got["num_processes"] == Setting(4, "default")
    assert got["use_cpu"] == Setting(False, "default")
    assert got["num_cpu_threads_per_process"] == Setting(None, "default")


def test_default_processes_cover_every_machine() -> None:
    got = resolve({"num_machines": 2}, devices=4)
    assert got["num_processes"] == Setting(8, "default")


def test_forced_cpu_defaults_to_one_process_and_shares_cores() -> None:
    got = resolve({"use_cpu": True}, devices=4)
    assert got["num_processes"] == Setting(1, "default")
    assert got["num_cpu_threads_per_process"] == Setting(8, "default")
    got = resolve({"use_cpu": True, "num_processes": 3})
    assert got["num_cpu_threads_per_process"] == Setting(2, "default")
    got = resolve({"use_cpu": True, "num_processes": 16})
    assert got["num_cpu_threads_per_process"] == Setting(1, "default")


# --- precedence ---------------------------------------------------------------------------


def test_precedence_flag_env_config_default() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", mixed_precision="fp8")
    env = {ACCEL_MIXED_PRECISION: "fp16"}
    flag = {"mixed_precision": "bf16"}
    assert resolve(flag, env, config)["mixed_precision"] == Setting("bf16", "flag")
    assert resolve({}, env, config)["mixed_precision"] == Setting(
        "fp16", "env ACCEL_MIXED_PRECISION"
    )
    assert resolve({}, {}, config)["mixed_precision"] == Setting("fp8", CONFIG)
    assert resolve({}, {}, None)["mixed_precision"] == Setting("no", "default")


def test_flag_none_means_not_given() -> None:
    got = resolve({"mixed_precision": None}, {ACCEL_MIXED_PRECISION: "bf16"})
    assert got["mixed_precision"] == Setting("bf16", "env ACCEL_MIXED_PRECISION")


def test_empty_env_value_is_unset() -> None:
    config = ClusterConfig(distributed_type="NO", mixed_precision="bf16")
    got = resolve({}, {ACCEL_MIXED_PRECISION: "  "}, config)
    assert got["mixed_precision"] == Setting("bf16", CONFIG)


def test_flag_beats_config_for_keys_without_env() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", num_processes=4, main_process_port=1234)
    got = resolve({"num_processes": 2}, {}, config)
    assert got["num_processes"] == Setting(2, "flag")
    assert got["main_process_port"] == Setting(1234, CONFIG)


ENV_CASES = [
    ("mixed_precision", "BF16", "bf16", "fp8"),
    ("use_cpu", "yes", True, False),
    ("gradient_accumulation_steps", "8", 8, 2),
    ("dynamo_backend", "INDUCTOR", "inductor", "eager"),
    ("dynamo_mode", "max-autotune", "max-autotune", "reduce-overhead"),
    ("dynamo_use_fullgraph", "1", True, False),
    ("dynamo_use_dynamic", "true", True, False),
    ("dynamo_use_regional_compilation", "on", True, False),
    ("num_cpu_threads_per_process", "3", 3, None),
    ("debug", "1", True, False),
]


@pytest.mark.parametrize(("key", "raw", "expected", "config_value"), ENV_CASES)
def test_env_beats_config(key: str, raw: str, expected: Any, config_value: Any) -> None:
    config = ClusterConfig(
        distributed_type="MULTI_GPU",
        mixed_precision="fp8",
        use_cpu=False,
        debug=False,
        deepspeed_config={"gradient_accumulation_steps": 2},
        dynamo_config={
            "dynamo_backend": "EAGER",
            "dynamo_mode": "reduce-overhead",
            "dynamo_use_fullgraph": False,
            "dynamo_use_dynamic": False,
            "dynamo_use_regional_compilation": False,
        },
    )
    name = ENV_VARS[key]
    with_env = resolve({}, {name: raw}, config, devices=2)
    assert with_env[key] == Setting(expected, f"env {name}")
    without = resolve({}, {}, config, devices=2)
    if config_value is not None:
        assert without[key] == Setting(config_value, CONFIG)
    with_flag = resolve({key: expected}, {name: raw}, config, devices=2)
    assert with_flag[key].source == "flag"


def test_env_names_come_from_the_contract() -> None:
    assert ENV_VARS["mixed_precision"] == ACCEL_MIXED_PRECISION
    assert ENV_VARS["use_cpu"] == ACCEL_USE_CPU
    assert ENV_VARS["gradient_accumulation_steps"] == ACCEL_GRADIENT_ACCUMULATION_STEPS
    assert ENV_VARS["dynamo_backend"] == ACCEL_DYNAMO_BACKEND
    assert ENV_VARS["debug"] == ACCEL_DEBUG_MODE
    assert set(ENV_VARS) <= set(LAUNCH_KEYS)
    assert "num_processes" not in ENV_VARS


@pytest.mark.parametrize("source", [CONFIG_PATH, CONFIG])
def test_config_source_label(source: str) -> None:
    config = ClusterConfig(distributed_type="NO", num_processes=1)
    got = resolve({}, {}, config, source=source)
    assert got["num_processes"] == Setting(1, CONFIG)


def test_config_without_source_label() -> None:
    config = ClusterConfig(distributed_type="NO", num_processes=1)
    assert resolve({}, {}, config, source=None)["num_processes"].source == "config"


def test_config_num_processes_minus_one_means_unset() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU")
    assert resolve({}, {}, config, devices=2)["num_processes"] == Setting(2, "default")


def test_only_keys_in_the_file_count_as_config(tmp_path: Path) -> None:
    config, path = from_file(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n")
    got = resolve({}, {}, config, source=path, devices=2)
    assert got["num_processes"] == Setting(2, f"config {path}")
    assert got["use_cpu"] == Setting(False, "default")
    assert got["debug"] == Setting(False, "default")
    assert got["mixed_precision"] == Setting("no", "default")
    assert got["rdzv_backend"] == Setting("static", "default")


def test_file_values_and_legacy_spellings_count_as_config(tmp_path: Path) -> None:
    text = (
        "distributed_type: 'NO'\nfp16: true\ndebug: true\nsame_network: true\n"
        "dynamo_backend: INDUCTOR\nmain_process_ip: 10.0.0.1\n"
    )
    config, path = from_file(tmp_path, text)
    got = resolve({}, {}, config, source=path)
    label = f"config {path}"
    assert got["num_processes"] == Setting(1, label)  # NO means one process
    assert got["mixed_precision"] == Setting("fp16", label)
    assert got["debug"] == Setting(True, label)
    assert got["same_network"] == Setting(True, label)
    assert got["dynamo_backend"] == Setting("inductor", label)
    assert got["main_process_ip"] == Setting("10.0.0.1", label)
    assert got["main_process_port"] == Setting(None, "default")


def test_dynamo_config_keys_map_to_settings(tmp_path: Path) -> None:
    text = (
        "distributed_type: MULTI_GPU\ndynamo_config:\n  dynamo_backend: INDUCTOR\n"
        "  dynamo_mode: max-autotune\n  dynamo_use_fullgraph: true\n  dynamo_use_dynamic: true\n"
    )
    config, path = from_file(tmp_path, text)
    got = resolve({}, {}, config, source=path, devices=2)
    label = f"config {path}"
    assert got["dynamo_backend"] == Setting("inductor", label)
    assert got["dynamo_mode"] == Setting("max-autotune", label)
    assert got["dynamo_use_fullgraph"] == Setting(True, label)
    assert got["dynamo_use_dynamic"] == Setting(True, label)
    assert got["dynamo_use_regional_compilation"] == Setting(False, "default")


def test_deepspeed_accumulation_steps(tmp_path: Path) -> None:
    config, path = from_file(
        tmp_path,
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 4\n",
    )
    got = resolve({}, {}, config, source=path, devices=2)
    assert got["gradient_accumulation_steps"] == Setting(4, f"config {path}")
    auto = ClusterConfig(
        distributed_type="DEEPSPEED", deepspeed_config={"gradient_accumulation_steps": "auto"}
    )
    assert resolve({}, {}, auto)["gradient_accumulation_steps"] == Setting(None, "default")


def test_omp_num_threads_is_the_env_source_of_threads() -> None:
    got = resolve({}, {"OMP_NUM_THREADS": "5"})
    assert got["num_cpu_threads_per_process"] == Setting(5, "env OMP_NUM_THREADS")
    got = resolve({"num_cpu_threads_per_process": 2}, {"OMP_NUM_THREADS": "5"})
    assert got["num_cpu_threads_per_process"] == Setting(2, "flag")


def test_string_flags_are_converted() -> None:
    got = resolve(
        {"num_processes": "4", "main_process_port": "29501", "monitor_interval": "0.5"},
        devices=4,
    )
    assert got["num_processes"] == Setting(4, "flag")
    assert got["main_process_port"] == Setting(29501, "flag")
    assert got["monitor_interval"] == Setting(0.5, "flag")


def test_port_zero_on_one_machine_lets_the_launcher_pick() -> None:
    assert resolve({"main_process_port": 0})["main_process_port"] == Setting(0, "flag")


def test_settings_are_frozen() -> None:
    item = resolve()["num_processes"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.value = 3  # type: ignore[misc]


# --- validation ---------------------------------------------------------------------------


def _error(**kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        resolve(**kwargs)
    return str(info.value)


def test_num_processes_zero_from_flag() -> None:
    assert _error(flags={"num_processes": 0}) == "num_processes=0 (from flag) must be >= 1"


def test_num_processes_negative_from_config() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", num_processes=-3)
    assert _error(config=config) == f"num_processes=-3 (from {CONFIG}) must be >= 1"


def test_num_machines_zero() -> None:
    assert _error(flags={"num_machines": 0}) == "num_machines=0 (from flag) must be >= 1"


@pytest.mark.parametrize("rank", [2, 5, -1])
def test_machine_rank_out_of_range(rank: int) -> None:
    message = _error(flags={"machine_rank": rank, "num_machines": 2, "num_processes": 2})
    assert message.startswith(f"machine_rank={rank} (from flag) must be between 0 and")
    assert "num_machines=2 (from flag)" in message


def test_machine_rank_from_config_against_default_machines(tmp_path: Path) -> None:
    config, path = from_file(tmp_path, "distributed_type: MULTI_GPU\nmachine_rank: 1\n")
    message = _error(config=config, source=path)
    assert f"machine_rank=1 (from config {path})" in message
    assert "num_machines=1 (from default)" in message


def test_config_built_in_code_sets_every_key() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", machine_rank=1)
    assert f"num_machines=1 (from {CONFIG})" in _error(config=config)


def test_processes_not_a_multiple_of_machines() -> None:
    message = _error(flags={"num_processes": 3, "num_machines": 2})
    assert "num_processes=3 (from flag) must be a multiple of num_machines=2" in message


@pytest.mark.parametrize("port", [65536, -1, 100000])
def test_port_out_of_range(port: int) -> None:
    message = _error(flags={"main_process_port": port})
    assert message.startswith(f"main_process_port={port} (from flag) must be between 1 and 65535")


def test_port_zero_with_several_machines() -> None:
    message = _error(flags={"main_process_port": 0, "num_machines": 2, "num_processes": 2})
    assert "main_process_port=0 (from flag)" in message
    assert "pass a fixed port" in message


def test_mixed_precision_choices() -> None:
    message = _error(environ={ACCEL_MIXED_PRECISION: "fp32"})
    assert message == (
        "mixed_precision='fp32' (from env ACCEL_MIXED_PRECISION) is not one of no, fp8, fp16, bf16"
    )


def test_non_integer_from_env() -> None:
    message = _error(environ={ACCEL_GRADIENT_ACCUMULATION_STEPS: "lots"})
    assert message == (
        "gradient_accumulation_steps='lots' (from env ACCEL_GRADIENT_ACCUMULATION_STEPS) "
        "is not an integer"
    )


def test_non_boolean_from_env() -> None:
    message = _error(environ={ACCEL_USE_CPU: "perhaps"})
    assert message.startswith("use_cpu='perhaps' (from env ACCEL_USE_CPU) is not a boolean")


def test_boolean_flag_must_be_boolean() -> None:
    assert "is not a boolean" in _error(flags={"debug": 2})


def test_bool_is_not_an_integer() -> None:
    assert _error(flags={"num_processes": True}).startswith("num_processes=True (from flag)")


def test_non_number_interval() -> None:
    assert "is not a number" in _error(flags={"monitor_interval": "soon"})


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 (from flag) must be"),
        ({"max_restarts": -1}, "max_restarts=-1 (from flag) must be >= 0"),
        ({"monitor_interval": 0}, "monitor_interval=0.0 (from flag) must be > 0"),
        ({"num_cpu_threads_per_process": 0}, "num_cpu_threads_per_process=0 (from flag) must be"),
        ({"dynamo_backend": "turbo"}, "dynamo_backend='turbo' (from flag) is not one of no, eager"),
        ({"dynamo_mode": "fast"}, "dynamo_mode='fast' (from flag) is not one of default"),
        ({"rdzv_backend": "zmq"}, "rdzv_backend='zmq' (from flag) is not one of static, c10d"),
        ({"main_process_ip": " "}, "main_process_ip=' ' (from flag) is empty"),
    ],
)
def test_range_and_choice_errors(flags: dict[str, Any], start: str) -> None:
    assert _error(flags=flags).startswith(start)


def test_bad_config_value_names_the_config(tmp_path: Path) -> None:
    config, path = from_file(
        tmp_path, "distributed_type: MULTI_GPU\ndynamo_config:\n  dynamo_mode: fastest\n"
    )
    with pytest.raises(ValueError, match=rf"dynamo_mode='fastest' \(from config {path}\)"):
        resolve({}, {}, config, source=path)


def test_unknown_flag_key() -> None:
    with pytest.raises(ValueError, match=r"unknown launch settings \['cpu'\]"):
        resolve({"cpu": True})


# --- the table ----------------------------------------------------------------------------


def test_table_lists_every_setting_with_its_source() -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", num_processes=2)
    got = resolve({"mixed_precision": "bf16"}, {ACCEL_DEBUG_MODE: "1"}, config, devices=2)
    table = format_settings_table(got)
    lines = table.split("\n")
    assert lines[0].split(" | ") == ["setting".ljust(31), "value".ljust(7), "source"]
    assert set(lines[1]) == {"-", "+"}
    assert len(lines) == len(LAUNCH_KEYS) + 2
    bars = {tuple(i for i, ch in enumerate(line) if ch in "|+") for line in lines}
    assert len(bars) == 1  # every column lines up
    rows = {line.split(" | ")[0].strip(): line.split(" | ")[1:] for line in lines[2:]}
    assert [cell.strip() for cell in rows["mixed_precision"]] == ["bf16", "flag"]
    assert [cell.strip() for cell in rows["debug"]] == ["true", "env ACCEL_DEBUG_MODE"]
    assert [cell.strip() for cell in rows["num_processes"]] == ["2", CONFIG]
    assert [cell.strip() for cell in rows["main_process_port"]] == ["-", "default"]
    assert not any(line != line.rstrip() for line in lines)
    assert not table.endswith("\n")


def test_table_of_a_few_settings() -> None:
    table = format_settings_table(
        {"num_processes": Setting(2, "flag"), "use_cpu": Setting(False, "default")}
    )
    assert table == (
        "setting       | value | source\n"
        "--------------+-------+--------\n"
        "num_processes | 2     | flag\n"
        "use_cpu       | false | default"
    )


# --- gpu_ids and enable_cpu_affinity (Accelerate's flags) -------------------------------------


def test_gpu_ids_choose_the_processes_per_machine() -> None:
    got = resolve({"gpu_ids": " 0, 2"}, devices=4)
    assert got["gpu_ids"] == Setting("0,2", "flag")
    assert got["num_processes"] == Setting(2, "default")
    assert resolve(devices=4)["num_processes"].value == 4


@pytest.mark.parametrize("raw", ["0,0", "a,b", "1;2", "-1", ""])
def test_bad_gpu_ids_name_the_value(raw: str) -> None:
    with pytest.raises(ValueError, match=r"gpu_ids=.* is not 'all' or a comma-separated list"):
        resolve({"gpu_ids": raw}, devices=2)


def test_more_processes_than_listed_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"more than the GPUs of gpu_ids='1'"):
        resolve({"gpu_ids": "1", "num_processes": 2}, devices=2)


def test_cpu_affinity_from_the_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    assert resolve({"enable_cpu_affinity": True})["enable_cpu_affinity"] == Setting(True, "flag")
    env = resolve(environ={"ACCEL_CPU_AFFINITY": "1"})["enable_cpu_affinity"]
    assert env == Setting(True, "env ACCEL_CPU_AFFINITY")
    text = "distributed_type: MULTI_GPU\nenable_cpu_affinity: true\ngpu_ids: 0,1\n"
    config, path = from_file(tmp_path, text)
    got = resolve(config=config, source=path, devices=2)
    assert got["enable_cpu_affinity"] == Setting(True, f"config {path}")
    assert got["gpu_ids"] == Setting("0,1", f"config {path}")
