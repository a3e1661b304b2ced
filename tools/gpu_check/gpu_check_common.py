"""What every step of tools/gpu_check/steps.py shares: its context, rows, probes, helpers.

A module beside steps.py (imported from the script's folder); standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
GB = 1_000_000_000
MB = 1_000_000


def row(what: str, accel: str = "", accelerate: str = "", goal: str = "", ok: Any = None) -> Any:
    """One table row; ``ok``: True (met), False (not met) or None (not judged)."""
    return {"what": what, "accel": accel, "accelerate": accelerate, "goal": goal, "ok": ok}


class Skip(Exception):
    """The step cannot run here; the message says why."""


@dataclass
class Run:
    """A finished command: exit code (None: killed at its timeout), log file, last lines."""

    code: int | None
    log: Path
    tail: str


@dataclass
class Context:
    """What a step knows: options, its deadline, the probes of the environment step."""

    step: str
    out: Path
    cache: Path
    dry_run: bool
    deadline: float
    sdist: Path | None
    probes: dict[str, Any] = field(default_factory=dict)
    cuda: bool | None = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], timeout: float | None = None) -> Run:
        """Run ``command`` in its own process group, output to ``OUT/<step>-<name>.log``."""
        limit = self.remaining() - 3 if timeout is None else min(timeout, self.remaining() - 3)
        if limit < 5:
            raise RuntimeError(f"no time left in the step's budget for {name} ({limit:.0f} s)")
        log = self.out / f"{self.step}-{name}.log"
        env = dict(os.environ)
        with log.open("w", encoding="utf-8") as handle:
            handle.write("$ " + " ".join(command) + "\n")
            handle.flush()
            process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code: int | None = process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                code = None
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        tail = " / ".join(line.strip() for line in lines[-3:])[-400:]
        if code is None:
            tail = f"timed out after {limit:.0f} s; see {log.name}"
        return Run(code, log, tail)

    def probe(self, module: str) -> dict[str, Any]:
        """``{"ok", "version", "alias", "error"}`` of ``import module`` in a fresh process."""
        if module not in self.probes:
            wait = max(5.0, min(60.0, self.remaining() / 4))
            self.probes.update(collect_probes(start_probes([module]), wait))
        found: dict[str, Any] = self.probes[module]
        return found

    def has_cuda(self) -> bool:
        if self.cuda is None:
            code = "import torch; print(torch.cuda.is_available())"
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
            )
            self.cuda = done.stdout.strip().endswith("True")
        return self.cuda

    def accelerate_python(self) -> str | None:
        """This interpreter when it has the real Accelerate (never in a dry run), else None."""
        found = self.probe("accelerate")
        if self.dry_run or not found["ok"] or found.get("alias"):
            return None
        return sys.executable

    def accelerate_absent(self) -> str:
        """Why the Accelerate side is not measured."""
        found = self.probe("accelerate")
        if self.dry_run:
            return "not measured (dry run)"
        if found.get("alias"):
            return "not measured (`accelerate` is accel's alias here)"
        return "not measured (no `import accelerate`)"

    def need_cuda(self) -> None:
        if not self.dry_run and not self.has_cuda():
            raise Skip("not measured: no CUDA")


def start_probes(modules: list[str]) -> dict[str, subprocess.Popen[str]]:
    """Start importing each module in a process of its own, all at once."""
    program = (
        "import importlib, json, sys\n"
        "m = importlib.import_module(sys.argv[1])\n"
        "print(json.dumps({'version': str(getattr(m, '__version__', '')),"
        " 'alias': hasattr(m, '__accel_version__')}))\n"
    )
    return {
        name: subprocess.Popen(
            [sys.executable, "-c", program, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in modules
    }


def collect_probes(
    started: dict[str, subprocess.Popen[str]], wait: float
) -> dict[str, dict[str, Any]]:
    """What each import gave: ``{"ok", "version", "alias"}`` or ``{"ok": False, "error"}``."""
    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + wait
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            found[name] = {"ok": False, "error": f"import ran past {wait:.0f} s"}
            continue
        if process.returncode == 0 and stdout.strip():
            found[name] = {"ok": True, **json.loads(stdout.strip().splitlines()[-1])}
        else:
            last = (stderr.strip().splitlines() or ["no output"])[-1]
            found[name] = {"ok": False, "error": last[:200]}
    return found


def fmt_ok(found: dict[str, Any], name: str) -> str:
    if found.get("ok"):
        return f"{name} {found.get('version') or '(no version)'}"
    error = found.get("error", "")
    if error.startswith("ModuleNotFoundError") and f"'{name}'" in error:
        return f"{name}: not installed"
    return f"{name}: import fails ({error[:80]})"


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def speed_ok(ctx: Context, value: float, goal: float, above: bool) -> bool | None:
    """A speed goal is judged on the real run only."""
    if ctx.dry_run:
        return None
    return value >= goal if above else value <= goal


def speed_goal(ctx: Context, text: str) -> str:
    return text + (" (not judged in a dry run)" if ctx.dry_run else "")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
