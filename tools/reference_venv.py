"""Create (idempotently) the virtualenv that holds HuggingFace Accelerate for side-by-side runs.

    python3 tools/reference_venv.py            # prints the venv's python path

Benchmarks (tools/bench/), the compatibility tests in tests-integration/ and the calibration
run of Accelerate's own test suite (tools/upstream_suite.py) run Accelerate 1.15 in its own
venv at .bench-venvs/accelerate-1.15/, next to torch 2.13.0 installed with the repository's
constraints file, so it never shares an interpreter with accel. The venv also holds the root
pyproject's ``upstream`` dependency group (pytest, transformers, ...), the libraries the
suite's accel run has too. Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "tools" / "constraints" / "ci.txt"
ACCELERATE_VERSION = "1.15.0"
VENV = ROOT / ".bench-venvs" / f"accelerate-{ACCELERATE_VERSION.rsplit('.', 1)[0]}"


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


def ensure_accelerate_venv() -> Path:
    """Return the python of the Accelerate venv, creating or repairing it first if needed."""
    python = VENV / "bin" / "python"
    stamp = VENV / "accel-reference.json"
    wanted = {"requirements": REQUIREMENTS, "constraints": CONSTRAINTS.read_text(encoding="utf-8")}
    try:
        if python.exists() and json.loads(stamp.read_text(encoding="utf-8")) == wanted:
            return python
    except (OSError, ValueError):
        pass
    print(
        f"reference_venv: installing Accelerate {ACCELERATE_VERSION} into {VENV}", file=sys.stderr
    )
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS), *REQUIREMENTS],
        check=True,
    )
    stamp.write_text(json.dumps(wanted), encoding="utf-8")
    return python


if __name__ == "__main__":
    print(ensure_accelerate_venv())
