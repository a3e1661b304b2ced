"""Create (idempotently) the virtualenv that holds HuggingFace Accelerate for side-by-side runs.

    python3 tools/reference_venv.py            # prints the venv's python path
    python3 tools/reference_venv.py --deepspeed   # the same plus DeepSpeed, in a second venv

Benchmarks (tools/bench/), the compatibility tests in tests-integration/ and the calibration
run of Accelerate's own test suite (tools/upstream_suite.py) run Accelerate 1.15 in its own
venv at .bench-venvs/accelerate-1.15/, next to torch 2.13.0 installed with the repository's
constraints file, so it never shares an interpreter with accel. The venv also holds the root
pyproject's ``upstream`` dependency group (pytest, transformers, ...), the libraries the
suite's accel run has too. ``--deepspeed`` gives a second venv,
.bench-venvs/accelerate-1.15-deepspeed/, the same plus DeepSpeed: a separate folder, so that
installing DeepSpeed for the DeepSpeed cross-checks never changes what the calibration run of
the suite skips (Accelerate's tests that need DeepSpeed run when it is importable). Standard
library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "tools" / "constraints" / "ci.txt"
ACCELERATE_VERSION = "1.15.0"
VENV = ROOT / ".bench-venvs" / f"accelerate-{ACCELERATE_VERSION.rsplit('.', 1)[0]}"
DEEPSPEED_VENV = VENV.with_name(f"{VENV.name}-deepspeed")


def _upstream_group() -> list[str]:
    """The ``upstream`` dependency group of the root pyproject.toml."""
    import tomllib

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [str(item) for item in groups["dependency-groups"]["upstream"]]


REQUIREMENTS = [
    "torch==2.13.0",
    f"accelerate=={ACCELERATE_VERSION}",
    *dict.fromkeys(["numpy", "safetensors", *_upstream_group()]),
]


DEEPSPEED = "deepspeed==0.19.8"


def ensure_accelerate_venv(*, deepspeed: bool = False) -> Path:
    """Return the python of the Accelerate venv, creating or repairing it first if needed.

    ``deepspeed=True``: the venv with DeepSpeed (installed after torch with DS_BUILD_OPS=0 and no
    build isolation, so nothing is compiled).
    """
    folder = DEEPSPEED_VENV if deepspeed else VENV
    python = folder / "bin" / "python"
    stamp = folder / "accel-reference.json"
    wanted = {
        "requirements": REQUIREMENTS,
        "constraints": CONSTRAINTS.read_text(encoding="utf-8"),
        "deepspeed": DEEPSPEED if deepspeed else None,
    }
    try:
        if python.exists() and json.loads(stamp.read_text(encoding="utf-8")) == wanted:
            return python
    except (OSError, ValueError):
        pass
    print(
        f"reference_venv: installing Accelerate {ACCELERATE_VERSION} into {folder}",
        file=sys.stderr,
    )
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    command = [str(python), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS)]
    subprocess.run([*command, *REQUIREMENTS], check=True)
    if deepspeed:
        subprocess.run([*command, "setuptools", "wheel"], check=True)
        subprocess.run(
            [*command, "--no-build-isolation", DEEPSPEED],
            check=True,
            env={**os.environ, "DS_BUILD_OPS": "0"},
        )
    stamp.write_text(json.dumps(wanted), encoding="utf-8")
    return python


if __name__ == "__main__":
    print(ensure_accelerate_venv(deepspeed="--deepspeed" in sys.argv[1:]))
