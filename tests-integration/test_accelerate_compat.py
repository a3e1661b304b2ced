"""Checkpoints move both ways between accel and Accelerate 1.15 (same file names and formats).

Accelerate runs from its own virtualenv (tools/reference_venv.py); the ``integration`` nox
session creates it and passes its interpreter in ``ACCEL_REFERENCE_PYTHON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "compat_checkpoint.py"
REFERENCE = os.environ.get("ACCEL_REFERENCE_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not (REFERENCE and Path(REFERENCE).exists()),
    reason=(
        "Accelerate 1.15's virtualenv is not available: set ACCEL_REFERENCE_PYTHON to its "
        "python (python3 tools/reference_venv.py creates it; `python3 tools/dev.py test` does)"
    ),
)


def _run(python: str, lib: str, mode: str, directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "ACCEL_USE_CPU": "1"}
    command = [python, str(SCRIPT), "--lib", lib, "--mode", mode, "--dir", str(directory)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    ("saver", "loader"), [("accelerate", "accel"), ("accel", "accelerate")], ids=str
)
def test_checkpoint_round_trip_between_libraries(saver: str, loader: str, tmp_path: Path) -> None:
    python = {"accel": sys.executable, "accelerate": REFERENCE}
    directory = tmp_path / "checkpoint"
    saved = _run(python[saver], saver, "save", directory)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert (directory / "model.safetensors").exists()
    assert (directory / "optimizer.bin").exists()
    loaded = _run(python[loader], loader, "load", directory)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f"compat: OK (loaded with {loader})" in loaded.stdout


# Each plugin class: its constructor parameters with their defaults, as text (importable in
# both libraries under these module paths once "accelerate" is renamed "accel").
_SIGNATURES = """
import dataclasses, inspect, json, sys
lib = sys.argv[1]
utils = __import__(lib + ".utils", fromlist=["x"])
parallelism = __import__(lib + ".parallelism_config", fromlist=["x"])
top = __import__(lib)
names = ["FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "MegatronLMPlugin",
         "TorchTensorParallelPlugin", "TorchTensorParallelConfig", "TorchContextParallelConfig",
         "DeepSpeedSequenceParallelConfig"]
out = {}
for name in names:
    cls = getattr(utils, name)
    out[name] = [(p.name, repr(p.default)) for p in inspect.signature(cls).parameters.values()]
cls = parallelism.ParallelismConfig
out["ParallelismConfig"] = [
    (p.name, repr(p.default)) for p in inspect.signature(cls).parameters.values()
]
out["top"] = sorted(n for n in ("FullyShardedDataParallelPlugin", "DeepSpeedPlugin",
                                "ParallelismConfig") if hasattr(top, n))
print(json.dumps(out))
"""


def _signatures(python: str, lib: str) -> dict[str, object]:
    done = subprocess.run(
        [python, "-c", _SIGNATURES, lib], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_engine_plugins_have_accelerates_signatures() -> None:
    ours = _signatures(sys.executable, "accel")
    theirs = _signatures(REFERENCE, "accelerate")
    assert ours == theirs
