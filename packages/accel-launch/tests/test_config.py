"""Config files: the schema, old formats, unknown keys, file locations, write_basic_config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from accel_launch import config as config_module
from accel_launch.config import (
    HOW_DEFAULT,
    HOW_EXPLICIT,
    HOW_LEGACY,
    HOW_NONE,
    ClusterConfig,
    default_config_path,
    find_config_file,
    legacy_accelerate_config_path,
    load_config_from_file,
    write_basic_config,
)
from accel_state.enums import ComputeEnvironment, DistributedType
from accel_state.environment import ACCEL_HOME

# Files in the formats that past Accelerate releases wrote (key sets of those releases).
V0_11_FP16 = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
fp16: true
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
num_machines: 1
num_processes: 2
"""

V0_11 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: 'NO'
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: false
"""

V0_12 = V0_11.replace("fsdp_config: {}\n", "downcast_bf16: 'no'\nfsdp_config: {}\n")

LATEST = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: 'NO'
downcast_bf16: 'no'
fsdp_config: {}
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
tpu_name: 'test-tpu'
tpu_zone: 'us-central1-a'
commands: null
command_file: tests/test_samples/test_command_file.sh
"""

MPI_0_28 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
ipex_config:
  ipex: true
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: 'no'
mpirun_config:
  mpirun_ccl: '1'
  mpirun_hostfile: /home/user/hostfile
num_machines: 4
num_processes: 16
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

FP8_0_34 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
  backend: TE
  fp8_format: E4M3
  amax_history_len: 1024
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
use_cpu: false
"""

FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_offload_params: false
  fsdp_transformer_layer_cls_to_wrap: BertLayer
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: false
"""

SAGEMAKER = """\
compute_environment: AMAZON_SAGEMAKER
distributed_type: NO
mixed_precision: fp16
ec2_instance_type: MY_TYPE
iam_role_name: MY_ROLE
"""


@pytest.fixture(autouse=True)
def _isolated_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """No test sees the real home directory or a real ACCEL_HOME/HF_HOME."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for name in (ACCEL_HOME, "HF_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return home


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- loading ------------------------------------------------------------------------------


def test_load_0_11_file_with_legacy_fp16(tmp_path: Path) -> None:
    config = load_config_from_file(_write(tmp_path / "c.yaml", V0_11_FP16))
    assert config.distributed_type is DistributedType.MULTI_GPU
    assert config.mixed_precision == "fp16"
    assert config.num_processes == 2
    assert config.use_cpu is False and config.debug is False
    assert "fp16" not in config.to_dict()
    assert "mixed_precision" in config.given_keys()
    assert "debug" not in config.given_keys()


def test_legacy_fp16_false_means_no(tmp_path: Path) -> None:
    text = V0_11_FP16.replace("fp16: true", "fp16: false")
    assert load_config_from_file(_write(tmp_path / "c.yaml", text)).mixed_precision == "no"


def test_mixed_precision_wins_over_legacy_fp16(tmp_path: Path) -> None:
    text = V0_11_FP16 + "mixed_precision: bf16\n"
    assert load_config_from_file(_write(tmp_path / "c.yaml", text)).mixed_precision == "bf16"


def test_legacy_fp16_must_be_boolean(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", V0_11_FP16.replace("fp16: true", "fp16: maybe"))
    with pytest.raises(ValueError, match=r"c\.yaml: fp16='maybe' is not a boolean"):
        load_config_from_file(path)


@pytest.mark.parametrize("text", [V0_11, V0_12], ids=["0.11", "0.12"])
def test_load_old_files(tmp_path: Path, text: str) -> None:
    config = load_config_from_file(_write(tmp_path / "c.yaml", text))
    assert config.compute_environment is ComputeEnvironment.LOCAL_MACHINE
    assert config.distributed_type is DistributedType.NO
    assert config.num_processes == 1
    assert config.mixed_precision == "no"
    assert config.downcast_bf16 is False
    assert config.deepspeed_config == {} and config.fsdp_config == {}


def test_load_latest_file(tmp_path: Path) -> None:
    config = load_config_from_file(_write(tmp_path / "c.yaml", LATEST))
    assert config.gpu_ids == "all"
    assert config.same_network is True
    assert config.rdzv_backend == "static"
    assert config.tpu_name == "test-tpu" and config.tpu_zone == "us-central1-a"
    assert config.commands is None
    assert config.command_file == "tests/test_samples/test_command_file.sh"
    assert config.main_process_ip is None and config.main_process_port is None


def test_load_mpi_file_drops_retired_ipex_config_with_warning(tmp_path: Path) -> None:
    path = _write(tmp_path / "mpi.yaml", MPI_0_28)
    with pytest.warns(UserWarning, match=r"mpi\.yaml: ignoring ipex_config"):
        config = load_config_from_file(path)
    assert config.distributed_type is DistributedType.MULTI_CPU
    assert config.mpirun_config == {"mpirun_ccl": "1", "mpirun_hostfile": "/home/user/hostfile"}
    assert config.num_machines == 4 and config.num_processes == 16
    assert config.main_process_port == 29500
    assert config.tpu_env == []
    assert "ipex_config" not in config.to_dict()


def test_empty_retired_key_is_dropped_silently(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    load_config_from_file(_write(tmp_path / "c.yaml", V0_11 + "tp_config: {}\n"))
    assert not [w for w in recwarn if "tp_config" in str(w.message)]


def test_load_fp8_and_fsdp_files(tmp_path: Path) -> None:
    fp8 = load_config_from_file(_write(tmp_path / "fp8.yaml", FP8_0_34))
    assert fp8.mixed_precision == "fp8"
    assert fp8.fp8_config["backend"] == "TE"
    fsdp = load_config_from_file(_write(tmp_path / "fsdp.yaml", FSDP))
    assert fsdp.distributed_type is DistributedType.FSDP
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"


def test_load_json_file(tmp_path: Path) -> None:
    data = {"distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True}
    config = load_config_from_file(_write(tmp_path / "c.json", json.dumps(data)))
    assert config.distributed_type is DistributedType.MULTI_CPU
    assert config.num_processes == 2 and config.use_cpu is True


def test_unquoted_yaml_no_is_understood(tmp_path: Path) -> None:
    text = "distributed_type: NO\nmixed_precision: no\ndowncast_bf16: no\n"
    config = load_config_from_file(_write(tmp_path / "c.yaml", text))
    assert config.distributed_type is DistributedType.NO
    assert config.mixed_precision == "no"
    assert config.num_processes == 1


def test_missing_compute_environment_means_local_machine(tmp_path: Path) -> None:
    config = load_config_from_file(_write(tmp_path / "c.yaml", "distributed_type: MULTI_GPU\n"))
    assert config.compute_environment is ComputeEnvironment.LOCAL_MACHINE
    assert config.num_processes == -1  # only NO implies one process
    assert "compute_environment" not in config.given_keys()
    assert "mixed_precision" not in config.given_keys()


def test_missing_distributed_type_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path / "nodist.yaml", "compute_environment: LOCAL_MACHINE\n")
    with pytest.raises(ValueError, match=r"nodist\.yaml.*distributed_type"):
        load_config_from_file(path)


def test_unknown_keys_are_listed_sorted(tmp_path: Path) -> None:
    text = V0_12 + 'invalid_key: "x"\nanother_invalid_key: "y"\n'
    path = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    message = str(info.value)
    assert message.startswith(f"The config file at {path} had unknown keys")
    assert "(['another_invalid_key', 'invalid_key'])" in message
    assert "remove them" in message


def test_sagemaker_config_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "sm.yaml", SAGEMAKER)
    with pytest.raises(ValueError, match="accel does not launch on Amazon SageMaker"):
        load_config_from_file(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "", "42\n"])
def test_file_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "c.yaml", text)
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config_from_file(path)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "distributed_type: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML or JSON"):
        load_config_from_file(path)


def test_python_tags_are_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    text = f"distributed_type: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config_from_file(_write(tmp_path / "c.yaml", text))
    assert not marker.exists()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config_from_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("backend", "expected"), [("INDUCTOR", {"dynamo_backend": "INDUCTOR"}), ("NO", {})]
)
def test_legacy_top_level_dynamo_backend(tmp_path: Path, backend: str, expected: dict) -> None:
    text = f"distributed_type: 'NO'\ndynamo_backend: '{backend}'\n"
    config = load_config_from_file(_write(tmp_path / "c.yaml", text))
    assert config.dynamo_config == expected
    assert "dynamo_backend" not in config.to_dict()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("mixed_precision: fp32", "mixed_precision='fp32' is not one of no, fp8, fp16, bf16"),
        ("use_cpu: sometimes", "use_cpu='sometimes' is not a boolean"),
        ("num_processes: many", "num_processes='many' is not an integer"),
        ("fsdp_config: [1, 2]", "fsdp_config must be a mapping"),
    ],
)
def test_bad_values_name_file_and_key(tmp_path: Path, line: str, match: str) -> None:
    path = _write(tmp_path / "c.yaml", f"distributed_type: MULTI_GPU\n{line}\n")
    with pytest.raises(ValueError) as info:
        load_config_from_file(path)
    assert str(path) in str(info.value)
    assert match in str(info.value)


def test_bad_distributed_type_lists_choices(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "distributed_type: MULTI_BANANA\n")
    with pytest.raises(ValueError, match="MULTI_BANANA.*MULTI_GPU"):
        load_config_from_file(path)


# --- the dataclass ------------------------------------------------------------------------


def test_defaults_match_accelerate() -> None:
    config = ClusterConfig(distributed_type="NO")
    assert config.compute_environment is ComputeEnvironment.LOCAL_MACHINE
    assert (config.mixed_precision, config.use_cpu, config.debug) == ("no", False, False)
    assert (config.num_processes, config.machine_rank, config.num_machines) == (-1, 0, 1)
    assert config.gpu_ids is None and config.main_process_ip is None
    assert config.main_process_port is None
    assert config.rdzv_backend == "static" and config.same_network is False
    assert config.main_training_function == "main"
    assert config.enable_cpu_affinity is False and config.downcast_bf16 is False
    for name in (
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "dynamo_config",
    ):
        assert getattr(config, name) == {}
    assert config.tpu_use_cluster is False and config.tpu_use_sudo is False
    assert config.commands is None and config.tpu_vm is None and config.tpu_env is None


def test_distributed_type_is_required() -> None:
    with pytest.raises(TypeError):
        ClusterConfig()  # type: ignore[call-arg]


def test_to_dict_converts_enums_and_drops_none_and_empty_dicts() -> None:
    config = ClusterConfig(
        distributed_type=DistributedType.MULTI_GPU,
        num_processes=2,
        fsdp_config={"fsdp_version": 2},
    )
    data = config.to_dict()
    assert data["distributed_type"] == "MULTI_GPU" and type(data["distributed_type"]) is str
    assert data["compute_environment"] == "LOCAL_MACHINE"
    assert data["fsdp_config"] == {"fsdp_version": 2}
    assert "deepspeed_config" not in data and "gpu_ids" not in data
    assert "_given_keys" not in data
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_from_dict_round_trip_and_source() -> None:
    config = ClusterConfig(distributed_type="MULTI_CPU", num_processes=4, use_cpu=True)
    again = ClusterConfig.from_dict(config.to_dict())
    assert again == config
    with pytest.raises(ValueError, match="from-test"):
        ClusterConfig.from_dict({"num_processes": 2}, source="from-test")


def test_gpu_ids_read_as_int_becomes_text(tmp_path: Path) -> None:
    config = load_config_from_file(
        _write(tmp_path / "c.yaml", "distributed_type: NO\ngpu_ids: 0\n")
    )
    assert config.gpu_ids == "0"


@pytest.mark.parametrize("name", ["c.yaml", "c.yml", "nested/dir/c.yaml"])
def test_to_yaml_file_writes_yaml_atomically(tmp_path: Path, name: str) -> None:
    config = ClusterConfig(distributed_type="MULTI_GPU", num_processes=2, mixed_precision="bf16")
    target = tmp_path / name
    assert config.to_yaml_file(target) == target
    text = target.read_text(encoding="utf-8")
    assert not text.lstrip().startswith("{")
    assert yaml.safe_load(text) == config.to_dict()
    assert load_config_from_file(target) == config
    assert sorted(os.listdir(target.parent)) == [target.name]


def test_to_yaml_file_with_json_suffix_writes_json(tmp_path: Path) -> None:
    config = ClusterConfig(distributed_type="NO", num_processes=1)
    target = config.to_yaml_file(tmp_path / "c.json")
    assert json.loads(target.read_text(encoding="utf-8")) == config.to_dict()
    assert load_config_from_file(target) == config
    other = config.to_json_file(tmp_path / "other.yaml")
    assert json.loads(other.read_text(encoding="utf-8")) == config.to_dict()


def test_failed_write_keeps_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _write(tmp_path / "c.yaml", V0_11)

    def broken_replace(src: str, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(config_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        ClusterConfig(distributed_type="MULTI_GPU").to_yaml_file(target)
    assert target.read_text(encoding="utf-8") == V0_11
    assert os.listdir(tmp_path) == ["c.yaml"]


# --- locations ----------------------------------------------------------------------------


def test_default_path_uses_accel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCEL_HOME, str(tmp_path / "ah"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "ah" / "default_config.yaml"


def test_default_path_uses_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "xdg" / "accel" / "default_config.yaml"


def test_default_path_falls_back_to_dot_config(_isolated_home: Path) -> None:
    assert default_config_path() == _isolated_home / ".config" / "accel" / "default_config.yaml"


def test_default_path_reads_given_environ(tmp_path: Path) -> None:
    environ = {ACCEL_HOME: str(tmp_path)}
    assert default_config_path(environ) == tmp_path / "default_config.yaml"


def test_legacy_path_uses_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    assert legacy_accelerate_config_path() == expected


def test_legacy_path_uses_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert legacy_accelerate_config_path() == expected


def test_legacy_path_falls_back_to_dot_cache(_isolated_home: Path) -> None:
    expected = _isolated_home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert legacy_accelerate_config_path() == expected


def test_legacy_json_is_honoured_only_without_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    folder = tmp_path / "accelerate"
    json_file = _write(folder / "default_config.json", '{"distributed_type": "NO"}')
    assert legacy_accelerate_config_path() == json_file
    yaml_file = _write(folder / "default_config.yaml", V0_11)
    assert legacy_accelerate_config_path() == yaml_file


def test_find_explicit(tmp_path: Path) -> None:
    path = _write(tmp_path / "mine.yaml", V0_11)
    assert find_config_file(str(path)) == (path, HOW_EXPLICIT)
    assert HOW_EXPLICIT == "--config_file"


def test_find_explicit_missing_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        find_config_file(str(tmp_path / "missing.yaml"))


def test_find_explicit_wins_over_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCEL_HOME, str(tmp_path / "ah"))
    _write(tmp_path / "ah" / "default_config.yaml", V0_11)
    path = _write(tmp_path / "mine.yaml", V0_12)
    assert find_config_file(path) == (path, "--config_file")


def test_find_nothing() -> None:
    assert find_config_file(None) == (None, "none")
    assert HOW_NONE == "none"


def test_find_legacy_only_when_no_accel_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACCEL_HOME, str(tmp_path / "ah"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    legacy = _write(tmp_path / "hf" / "accelerate" / "default_config.yaml", V0_11)
    path, how = find_config_file(None)
    assert path == legacy
    assert how == HOW_LEGACY
    assert how == "legacy Accelerate default (read only because no accel config exists)"
    accel = _write(tmp_path / "ah" / "default_config.yaml", V0_12)
    assert find_config_file(None) == (accel, HOW_DEFAULT)
    assert HOW_DEFAULT == "accel default"


def test_find_with_given_environ(tmp_path: Path) -> None:
    accel = _write(tmp_path / "default_config.yaml", V0_11)
    assert find_config_file(None, {ACCEL_HOME: str(tmp_path)}) == (accel, "accel default")


# --- write_basic_config -------------------------------------------------------------------


def _fake_devices(monkeypatch: pytest.MonkeyPatch, kind: str, count: int) -> None:
    monkeypatch.setattr(config_module, "detect_local_accelerator", lambda: (kind, count))


@pytest.mark.parametrize(
    ("kind", "count", "processes", "distributed", "use_cpu"),
    [
        ("cpu", 0, 1, "NO", True),
        ("mps", 1, 1, "NO", False),
        ("cuda", 1, 1, "NO", False),
        ("cuda", 4, 4, "MULTI_GPU", False),
        ("xpu", 2, 2, "MULTI_XPU", False),
        ("npu", 8, 8, "MULTI_NPU", False),
    ],
)
def test_write_basic_config_round_trip(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    count: int,
    processes: int,
    distributed: str,
    use_cpu: bool,
) -> None:
    _fake_devices(monkeypatch, kind, count)
    target = tmp_path / "basic.yaml"
    assert write_basic_config("bf16", target) == target
    text = target.read_text(encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # real YAML, not JSON text in a .yaml file
    data = yaml.safe_load(text)
    assert data["compute_environment"] == "LOCAL_MACHINE"
    assert data["mixed_precision"] == "bf16"
    assert data["num_processes"] == processes
    assert data["distributed_type"] == distributed
    assert data["use_cpu"] is use_cpu
    assert data["debug"] is False and data["enable_cpu_affinity"] is False
    config = load_config_from_file(target)
    assert config.to_dict() == data


def test_write_basic_config_real_detection(tmp_path: Path) -> None:
    path = write_basic_config(save_location=tmp_path / "c.yaml")
    assert isinstance(path, Path)
    kind, count = config_module.detect_local_accelerator()
    config = load_config_from_file(path)
    assert config.use_cpu is (kind == "cpu")
    assert config.num_processes == (1 if kind in ("cpu", "mps") else count)


def test_write_basic_config_defaults_to_accel_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_devices(monkeypatch, "cpu", 0)
    monkeypatch.setenv(ACCEL_HOME, str(tmp_path / "fresh"))
    written = write_basic_config()
    assert written == tmp_path / "fresh" / "default_config.yaml"
    assert find_config_file(None) == (written, "accel default")


def test_write_basic_config_refuses_to_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_devices(monkeypatch, "cpu", 0)
    target = _write(tmp_path / "c.yaml", V0_11)
    assert write_basic_config("fp16", target) is False
    assert target.read_text(encoding="utf-8") == V0_11
    assert str(target) in capsys.readouterr().out


def test_write_basic_config_bad_precision(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="mixed_precision='fp32' is not one of no, fp8, fp16, bf16"
    ):
        write_basic_config("fp32", tmp_path / "c.yaml")
    assert not (tmp_path / "c.yaml").exists()
