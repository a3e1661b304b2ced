"""Every ``accelerate launch`` flag of Accelerate 1.15 exists in ``accel launch``.

``accelerate_launch_flags.txt`` lists them (the integration tests check the list against
Accelerate itself). Each is parsed as Accelerate parses it (a switch, a value or a repeatable
value) and a dry run with it either succeeds or is refused before anything starts (exit 2)
with a message naming the flag. The flags that work are checked for what they do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_launch.cli import build_parser, main
from accel_launch.launch import plan_launch
from accel_state.torch_support import torch_has

pytestmark = pytest.mark.usefixtures("launch_environment")

_LISTED = Path(__file__).with_name("accelerate_launch_flags.txt")
FLAGS = [
    tuple(line.split())
    for line in _LISTED.read_text(encoding="utf-8").splitlines()
    if line and not line.startswith("#")
]

#: The flags that work in this release (a dry run with them succeeds); the rest are refused.
WORKS = {
    "config_file", "cpu", "debug", "dynamo_backend", "dynamo_mode", "dynamo_use_dynamic",
    "dynamo_use_fullgraph", "dynamo_use_regional_compilation", "enable_cpu_affinity",
    "fp8_backend", "gpu_ids", "gradient_accumulation_steps", "log_dir", "machine_rank",
    "main_process_ip", "main_process_port", "max_restarts", "mixed_precision", "module",
    "monitor_interval", "multi_gpu", "no_python", "num_cpu_threads_per_process",
    "num_machines", "num_processes", "quiet", "rdzv_backend", "rdzv_conf", "role",
    "same_network", "tee", "tpu", "use_deepspeed", "use_fsdp", "use_parallelism_config",
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size",
    "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy",
    "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation",
}  # fmt: skip
if not torch_has("fully_shard"):  # torch 2.5 (the floor): FSDP2 is refused, naming --use_fsdp
    WORKS.discard("use_fsdp")

#: A value that the flag accepts when it works (others get "1").
SAMPLES = {
    "mixed_precision": "bf16",
    "dynamo_backend": "inductor",
    "dynamo_mode": "default",
    "rdzv_backend": "static",
    "num_processes": "2",
    "main_process_ip": "127.0.0.1",
    "main_process_port": "0",
    "fp8_backend": "ao",
    "gpu_ids": "all",
    "tee": "3",
    "monitor_interval": "0.5",
    "max_restarts": "0",
    "machine_rank": "0",
    "rdzv_conf": "timeout=60",
    "role": "trainer",
    "deepspeed_multinode_launcher": "pdsh",
    # sizes get "1" (an sp size above 1 is refused: test_engine_refusal.py)
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_backend": "deepspeed",
    "parallelism_config_sp_seq_length": "128",
    "parallelism_config_sp_seq_length_is_variable": "true",
    "parallelism_config_sp_attn_implementation": "sdpa",
}


def test_the_list_is_sound() -> None:
    assert len(FLAGS) > 100 and all(kind in ("switch", "value", "list") for _, kind in FLAGS)
    assert WORKS <= {name for name, _ in FLAGS}


@pytest.mark.parametrize(("name", "kind"), FLAGS, ids=[name for name, _ in FLAGS])
def test_accelerates_flag_runs_or_is_refused_naming_it(
    name: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    value = {"config_file": str(tmp_path / "c.yaml"), "log_dir": str(tmp_path / "logs")}
    (tmp_path / "c.yaml").write_text("distributed_type: 'NO'\n")
    given = [] if kind == "switch" else [value.get(name, SAMPLES.get(name, "1"))]
    code = main(["launch", f"--{name}", *given, "--dry_run", str(script)])
    message = capsys.readouterr().err
    if name in WORKS:
        assert code == 0, message
    else:
        assert code == 2, message
        assert f"--{name}" in message, message


def plan(*argv: str, script: str) -> dict[str, object]:
    return plan_launch(build_parser().parse_args(["launch", *argv, script]), os.environ)


def test_gpu_ids_and_cpu_affinity_reach_the_processes(script: str) -> None:
    env = plan("--multi_gpu", "--gpu_ids", "1,3", "--enable_cpu_affinity", script=script)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["ACCEL_CPU_AFFINITY"] == "true"
    assert "CUDA_VISIBLE_DEVICES" not in plan("--cpu", script=script)["env"]


def test_regional_compilation_is_handed_to_the_script(script: str) -> None:
    env = plan("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation", script=script)[
        "env"
    ]
    assert env["ACCEL_DYNAMO_BACKEND"] == "INDUCTOR"
    assert env["ACCEL_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"


def test_role_is_torchruns_and_tee_is_opt_in(script: str) -> None:
    command = plan("--cpu", "--num_processes", "2", "--role", "trainer", script=script)["command"]
    assert command[command.index("--role") + 1] == "trainer"
    assert "--redirects" in command and "--tee" not in command
    teed = plan("--cpu", "--num_processes", "2", "--tee", "3", script=script)["command"]
    assert teed[teed.index("--tee") + 1] == "3" and "--redirects" not in teed


@pytest.mark.parametrize("backend", ["te", "msamp"])
def test_fp8_backends_other_than_torchao_are_refused(
    backend: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--fp8_backend", backend, "--dry_run", script]) == 2
    assert "torchao only" in capsys.readouterr().err
