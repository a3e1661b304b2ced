"""Nothing trains silently wrong: every way of asking for an engine accel lacks is refused.

Before this check existed, ``accel launch --use_fsdp --num_processes 2 train.py`` exited 0,
the model was wrapped in nothing while the data was sharded, and after one step the ranks held
different weights. Each path is launched here for real: the launcher's flags, environment
switches and config files (refused before any process starts, exit 2); the questionnaire
(nothing written); and scripts started by torchrun itself, as ``accelerate launch`` or a job
script would, with a switch in the environment or a plugin in the code (every rank stops in
``Accelerator()``, before its first step). A positive control shows the same script training
when nothing asks for an engine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "engine_train.py")
ENV = {
    key: value
    for key, value in os.environ.items()
    if not key.startswith(("ACCEL_USE_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))
}
ENV.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", ACCEL_USE_CPU="true")


def run(
    args: list[str], env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**ENV, **(env or {})},
        input=stdin,
    )


def trained(output: str) -> list[str]:
    """The ``TRAINED <rank> <digest> <type>`` reports, wherever they are in the output.

    The ranks share one stdout, so two reports can land on one line (whatever prefix the
    launcher adds); each is found on its own.
    """
    return ["TRAINED " + " ".join(f) for f in re.findall(r"TRAINED (\d+) (\w+) (\w+)", output)]


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (["--use_megatron_lm"], {}, "Megatron-LM was requested by --use_megatron_lm"),
        (
            ["--use_parallelism_config", "--parallelism_config_sp_size", "2"],
            {},
            "parallelism_config_sp_size=2 asks for sequence parallelism",
        ),
        (
            [],
            {"ACCEL_USE_MEGATRON_LM": "true"},
            "requested by ACCEL_USE_MEGATRON_LM=true in the environment",
        ),
        (
            [],
            {"ACCELERATE_USE_MEGATRON_LM": "true"},
            "requested by ACCELERATE_USE_MEGATRON_LM=true in the environment (Accelerate's name",
        ),
    ],
    ids=["megatron", "parallelism", "env", "accelerate-env"],
)
def test_launch_flags_and_switches_are_refused_before_any_process(
    flags: list[str], env: dict[str, str], expected: str
) -> None:
    done = run(["-m", "accel_launch", "launch", *flags, "--num_processes", "2", SCRIPT], env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr
    assert "nothing was started" in done.stderr
    assert not trained(done.stdout)


@pytest.mark.parametrize("how", ["flag", "config"])
def test_xla_without_torch_xla_starts_nothing(tmp_path: Path, how: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("distributed_type: XLA\nmixed_precision: 'no'\n")
    flags = ["--tpu"] if how == "flag" else ["--config_file", str(config)]
    done = run(["-m", "accel_launch", "launch", *flags, SCRIPT])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "accel launch --tpu: torch_xla is not installed" in done.stderr
    assert "nothing was started" in done.stderr
    assert not trained(done.stdout)


@pytest.mark.parametrize("kind", ["MEGATRON_LM"])
def test_config_files_are_refused(tmp_path: Path, kind: str) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nnum_processes: 2\n"
        "use_cpu: true\nmixed_precision: 'no'\n"
    )
    done = run(["-m", "accel_launch", "launch", "--config_file", str(config), SCRIPT])
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"was requested by distributed_type: {kind} in {config}" in done.stderr
    assert not trained(done.stdout)


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {"ACCEL_USE_MEGATRON_LM": "true"}, "ACCEL_USE_MEGATRON_LM=true in the environment"),
        (
            [],
            {"ACCELERATE_USE_MEGATRON_LM": "true"},
            "ACCELERATE_USE_MEGATRON_LM=true in the environment",
        ),
        (["megatron-plugin"], {}, "Accelerator(megatron_lm_plugin=...)"),
    ],
    ids=["accel-switch", "accelerate-switch", "plugin-argument"],
)
def test_scripts_under_torchrun_stop_on_every_rank_before_training(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    # torchrun stops the remaining workers when the first fails: each rank holds SIGTERM until
    # its Accelerator() has refused, so that every rank's own refusal is seen.
    done = run([*TORCHRUN, *args], {**env, "ENGINE_TRAIN_HOLD_SIGTERM": "1"})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert output.count(f"Megatron-LM was requested by {expected}") >= 2
    assert not trained(done.stdout)


def test_control_the_same_script_trains_ddp_when_cpu_outranks_a_switch() -> None:
    done = run(
        ["-m", "accel_launch", "launch", "--cpu", "--num_processes", "2", SCRIPT],
        {"ACCEL_USE_FSDP": "true"},  # --cpu asks for DDP explicitly; the ranks see false
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(trained(done.stdout))
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert len({line.split()[2] for line in lines}) == 1  # DDP: the ranks agree


FSDP_RUNS = [
    (["-m", "accel_launch", "launch", "--use_fsdp", "--num_processes", "2", SCRIPT], {}),
    (TORCHRUN, {"ACCEL_USE_FSDP": "true"}),
    (TORCHRUN, {"ACCELERATE_USE_FSDP": "true"}),
    ([*TORCHRUN, "fsdp-plugin"], {}),
    (  # FSDP2 over a ParallelismConfig's mesh, from the launcher's flags
        ["-m", "accel_launch", "launch", "--use_fsdp", "--parallelism_config_dp_shard_size", "2",
         "--num_processes", "2", SCRIPT],
        {},
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env"),
    FSDP_RUNS,
    ids=["launch-flag", "accel-switch", "accelerate-switch", "plugin", "parallelism-flags"],
)
def test_every_fsdp_request_trains_with_fsdp2_on_every_rank(
    args: list[str], env: dict[str, str]
) -> None:
    done = run(args, env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(trained(done.stdout))
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert {line.split()[3] for line in lines} == {"FSDP"}  # honoured, not swapped for DDP
    assert len({line.split()[2] for line in lines}) == 1  # the ranks hold the same weights
    # no gloo thread is left for interpreter finalization (it could abort the finished run)
    if Path("/proc/self/task").is_dir():  # the script reads Linux's /proc
        exits = sorted(re.findall(r"EXIT-THREADS (\d+) (\S+)", done.stdout))
        assert exits == [("0", "-"), ("1", "-")]


def test_a_config_file_asking_for_fsdp_trains_with_fsdp2(tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
        "mixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
    )
    done = run(["-m", "accel_launch", "launch", "--config_file", str(config), SCRIPT])
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(trained(done.stdout))
    assert {line.split()[3] for line in lines} == {"FSDP"}
    assert len({line.split()[2] for line in lines}) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None,
    reason="deepspeed is installed here (the deepspeed session trains with it)",
)
def test_deepspeed_without_the_package_stops_every_rank_with_the_install_command() -> None:
    done = run(["-m", "accel_launch", "launch", "--use_deepspeed", "--num_processes", "2", SCRIPT])
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert output.count('pip install "accel[deepspeed]"') >= 2, output
    assert not trained(done.stdout)
