"""DeepSpeed checkpoints move both ways between accel and Accelerate 1.15 (2 CPU ranks).

``scripts/deepspeed_compat.py`` saves under one library and loads under the other, ZeRO-2 and
ZeRO-3: the weights and the next step (so the optimizer partitions too) must match. Accelerate
runs from its own virtualenv with DeepSpeed in it (``tools/reference_venv.py --deepspeed``); the
``deepspeed`` nox session creates it and passes its interpreter in ``ACCEL_REFERENCE_PYTHON``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "deepspeed_compat.py"
REFERENCE = os.environ.get("ACCEL_REFERENCE_PYTHON", "")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not (REFERENCE and Path(REFERENCE).exists()),
        reason=(
            "Accelerate 1.15's virtualenv is not available: set ACCEL_REFERENCE_PYTHON to its "
            "python (python3 tools/reference_venv.py --deepspeed creates it with DeepSpeed)"
        ),
    ),
]


def _run(python: str, lib: str, stage: int, mode: str, directory: Path) -> str:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [python, *launcher, str(SCRIPT), "--lib", lib, "--stage", str(stage)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for name in ("ACCEL_USE_CPU", "ACCELERATE_USE_CPU"):  # Accelerate would drop DeepSpeed
        env.pop(name, None)
    done = subprocess.run(
        [*command, "--mode", mode, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    ("saver", "loader"), [("accelerate", "accel"), ("accel", "accelerate")], ids=str
)
def test_deepspeed_checkpoints_move_between_libraries(
    saver: str, loader: str, stage: int, tmp_path: Path
) -> None:
    python = {"accel": sys.executable, "accelerate": REFERENCE}
    directory = tmp_path / "checkpoint"
    _run(python[saver], saver, stage, "save", directory)
    assert (directory / "pytorch_model").is_dir() and (directory / "latest").is_file()
    assert (directory / "latest").read_text().strip() == "pytorch_model"
    out = _run(python[loader], loader, stage, "load", directory)
    assert f"compat: OK (loaded with {loader})" in out
