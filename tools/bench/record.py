"""The result file a benchmark's ``--json FILE`` writes: its figures with how they were made.

    {"format": 1, "benchmark": "train_step", "command": "python tools/bench/train_step.py ...",
     "date": "2026-12-05T22:00:00+00:00", "commit": "48ae718...", "dirty": false,
     "machine": {"cpu": "AMD EPYC", "cpus": 2, "memory_gib": 23.5, ...}, "results": {...}}

``results`` is the script's own figures, unchanged; the rest says what produced them, so that a
file kept under tools/bench/results/ (the data of the plots on docs/benchmarks.md, drawn by
tools/docs/plots.py) carries its command and machine. Standard library only (CUDA is asked
about only when the benchmark has imported torch).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FORMAT = 1
GIB = 1 << 30


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> float | None:
    """Physical memory in GiB (MemTotal of /proc/meminfo), or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) * 1024 / GIB, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU model and count, memory, OS, Python, torch and its threads."""
    torch = sys.modules.get("torch")
    try:
        torch_version = getattr(torch, "__version__", None) or metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    description: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": None,
    }
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        description["gpu"] = f"{cuda.device_count()} x {cuda.get_device_name(0)}"
    return description


def command(argv: list[str] | None = None) -> str:
    """The command line, its script as a path from the repository root when it is inside."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve()
    try:
        args[0] = script.relative_to(ROOT).as_posix()
    except ValueError:
        args[0] = str(script)
    return "python " + shlex.join(args)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _strict(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value


def record(benchmark: str, results: Any, argv: list[str] | None = None) -> dict[str, Any]:
    """The result file's content: ``results`` with the command, date, commit and machine.

    NaN and infinite floats in ``results`` (a figure that could not be measured) become null.
    """
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "format": FORMAT,
        "benchmark": benchmark,
        "command": command(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "machine": machine(),
        "results": _strict(results),
    }


def write_record(path: Path, benchmark: str, results: Any) -> None:
    """Write the result file (indented JSON, a final newline) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record(benchmark, results), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
