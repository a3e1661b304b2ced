"""The one command a developer (and CI) needs: python3 tools/dev.py test | demo | docs [nox args].

    python3 tools/dev.py test                        # the CI set: lint, floor, tests-*,
                                                     # isolation-*, integration, deepspeed,
                                                     # trackers, hf-stack, upstream, docs, build
    python3 tools/dev.py test -s tests-accel-state   # any nox arguments pass through
    python3 tools/dev.py test -R -t tests            # reuse venvs, one family
    python3 tools/dev.py demo                        # torchrun training, then big-model offload
    python3 tools/dev.py docs                        # the site into site/ (open site/index.html)
    python3 tools/dev.py docs -R -- -k quicktour     # reuse the venv; check one page's examples

It creates (once, and again when the pinned nox changes) a tools venv at .nox-tools/ holding the
nox version pinned in the root pyproject.toml's `nox` dependency group, installed with
`-c tools/constraints/ci.txt`, then runs nox on noxfile.py and exits with nox's exit code. After
`test` it prints one line with every session's duration and the free disk before and after
(the sessions' venvs share uv's cache; a full machine is the first thing to rule out when an
install fails). Works from any directory.
Standard library only; needs Python >= 3.11.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS_VENV = ROOT / ".nox-tools"
CONSTRAINTS = ROOT / "tools" / "constraints" / "ci.txt"
STAMP = TOOLS_VENV / "accel-tools.json"
USAGE = "usage: python3 tools/dev.py {test,demo,docs} [nox arguments...]"


def nox_requirements() -> list[str]:
    """Return the `nox` dependency group of the root pyproject.toml."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    group = data.get("dependency-groups", {}).get("nox", [])
    reqs = [item for item in group if isinstance(item, str)]
    if not reqs:
        raise SystemExit("dev.py: pyproject.toml has no [dependency-groups] nox = [...] entry")
    return reqs


def ensure_tools_venv() -> Path:
    """Create or update .nox-tools/ so that it holds exactly the pinned nox; return its python."""
    python = TOOLS_VENV / "bin" / "python"
    wanted = {
        "python": sys.version.split()[0],
        "requirements": nox_requirements(),
        "constraints": CONSTRAINTS.read_text(encoding="utf-8"),
    }
    try:
        current = json.loads(STAMP.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        current = None
    if python.exists() and current == wanted:
        return python
    print(f"dev.py: preparing {TOOLS_VENV} ({', '.join(wanted['requirements'])})", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TOOLS_VENV)], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(CONSTRAINTS),
            *wanted["requirements"],
        ],
        check=True,
    )
    STAMP.write_text(json.dumps(wanted, indent=2) + "\n", encoding="utf-8")
    return python


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _free_disk() -> str:
    return f"{shutil.disk_usage(ROOT).free / 2**30:.1f} GiB"


def print_timings(report: Path, wall: float) -> None:
    """Print one line: every session with its status and duration, from nox's JSON report."""
    try:
        sessions = json.loads(report.read_text(encoding="utf-8"))["sessions"]
    except (OSError, ValueError, KeyError):
        print(f"dev.py: no session report from nox; wall time {_duration(wall)}")
        return
    parts = [
        f"{s['name']} {s['result']} {_duration(float(s.get('duration') or 0.0))}" for s in sessions
    ]
    print(f"dev.py: session timings: {' | '.join(parts)} | wall {_duration(wall)}", flush=True)


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):
        print("dev.py: needs Python >= 3.11 (run it with python3.11)", file=sys.stderr)
        return 2
    if not argv or argv[0] not in ("test", "demo", "docs"):
        print(USAGE, file=sys.stderr)
        return 2
    command, extra = argv[0], argv[1:]
    python = ensure_tools_venv()
    nox = [str(python), "-m", "nox", "--noxfile", str(ROOT / "noxfile.py")]
    if command in ("demo", "docs"):  # one session; the remaining arguments go to nox
        return subprocess.run([*nox, "-s", command, *extra], cwd=ROOT, check=False).returncode

    fd, name = tempfile.mkstemp(prefix="accel-nox-report-", suffix=".json")
    os.close(fd)
    report = Path(name)
    start, disk_before = time.monotonic(), _free_disk()
    print(f"dev.py: free disk {disk_before}", flush=True)
    try:
        # No -s: nox runs nox.options.sessions (the CI set) unless `extra` selects others.
        proc = subprocess.run([*nox, "--report", str(report), *extra], cwd=ROOT, check=False)
        print_timings(report, time.monotonic() - start)
        print(f"dev.py: free disk {disk_before} before, {_free_disk()} after", flush=True)
    finally:
        report.unlink(missing_ok=True)
    return proc.returncode


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
