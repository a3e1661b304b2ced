"""Create (idempotently) the virtualenv that holds HuggingFace Accelerate for side-by-side runs.

    python3 tools/reference_venv.py            # prints the venv's python path
    python3 tools/reference_venv.py --deepspeed   # the same plus DeepSpeed, in a second venv
    python3 tools/reference_venv.py --hf-stack    # Accelerate with transformers, peft, trl

Benchmarks (tools/bench/), the compatibility tests in tests-integration/ and the calibration
run of Accelerate's own test suite (tools/upstream_suite.py) run Accelerate 1.15 in its own
venv at .bench-venvs/accelerate-1.15/, next to torch 2.13.0 installed with the repository's
constraints file, so it never shares an interpreter with accel. The venv also holds the root
pyproject's ``upstream`` dependency group (pytest, transformers, ...), the libraries the
suite's accel run has too. With ``ACCEL_UV`` naming a uv executable (the nox sessions set it
to the uv pinned beside nox) the venvs are made and filled by uv, from the cache the sessions
share; else by venv and pip. ``--deepspeed`` gives a second venv,
.bench-venvs/accelerate-1.15-deepspeed/, the same plus DeepSpeed: a separate folder, so that
installing DeepSpeed for the DeepSpeed cross-checks never changes what the calibration run of
the suite skips (Accelerate's tests that need DeepSpeed run when it is importable).
``--hf-stack`` gives a third, .bench-venvs/accelerate-1.15-hf/: Accelerate with the root
pyproject's ``hf-stack`` group (transformers, peft, trl, datasets), the side the ``hf-stack``
session's scenarios compare accel with. Standard library only.
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


HF_VENV = VENV.with_name(f"{VENV.name}-hf")


def _group(name: str) -> list[str]:
    """A dependency group of the root pyproject.toml, its included groups expanded."""
    import tomllib

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found: list[str] = []
    for item in groups["dependency-groups"][name]:
        if isinstance(item, dict):
            found.extend(_group(str(item["include-group"])))
        else:
            found.append(str(item))
    return found


def _upstream_group() -> list[str]:
    """The ``upstream`` dependency group of the root pyproject.toml."""
    return _group("upstream")


REQUIREMENTS = [
    "torch==2.13.0",
    f"accelerate=={ACCELERATE_VERSION}",
    *dict.fromkeys(["numpy", "safetensors", *_upstream_group()]),
]
HF_REQUIREMENTS = [
    "torch==2.13.0",
    f"accelerate=={ACCELERATE_VERSION}",
    *dict.fromkeys(["numpy", "safetensors", *_group("hf-stack")]),
]


DEEPSPEED = "deepspeed==0.19.8"


def ensure_accelerate_venv(*, deepspeed: bool = False, hf_stack: bool = False) -> Path:
    """Return the python of the Accelerate venv, creating or repairing it first if needed.

    ``deepspeed=True``: the venv with DeepSpeed (installed after torch with DS_BUILD_OPS=0 and no
    build isolation, so nothing is compiled). ``hf_stack=True``: the venv with transformers,
    peft, trl and datasets.
    """
    folder = HF_VENV if hf_stack else DEEPSPEED_VENV if deepspeed else VENV
    requirements = HF_REQUIREMENTS if hf_stack else REQUIREMENTS
    python = folder / "bin" / "python"
    stamp = folder / "accel-reference.json"
    wanted = {
        "requirements": requirements,
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
    uv = os.environ.get("ACCEL_UV", "")
    if uv:  # seeded with pip: upstream_suite.py downloads Accelerate's sdist with it
        made = [uv, "venv", "--quiet", "--clear", "--seed", "--python", sys.executable]
        subprocess.run([*made, str(folder)], check=True)
        command = [uv, "pip", "install", "--quiet", "--python", str(python)]
    else:
        venv.EnvBuilder(with_pip=True, clear=True).create(folder)
        command = [str(python), "-m", "pip", "install", "--quiet"]
    command += ["-c", str(CONSTRAINTS)]
    subprocess.run([*command, *requirements], check=True)
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
    print(
        ensure_accelerate_venv(
            deepspeed="--deepspeed" in sys.argv[1:], hf_stack="--hf-stack" in sys.argv[1:]
        )
    )
