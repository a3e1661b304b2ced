"""The GPU check (accel issue 30): one command, on a machine with one GPU, under 8 minutes.

    python3 tools/gpu_check.py --out $OUT/gpu-check
    python3 tools/gpu_check.py --out /tmp/gpu-check --dry-run        # CPU, small sizes (CI)
    python3 tools/gpu_check.py --out DIR [--steps training,offload] [--accelerate-sdist PATH]
                               [--timeout-scale 1.5] [--cache-dir DIR]

It needs torch and this checkout; transformers, Accelerate 1.15, DeepSpeed and pytest are used
where they import (each step says "not run: ..." where they do not). Where accel is not
installed, the six packages run from their sources: ``packages/*/src`` go on ``PYTHONPATH``
for every step, beside a folder (under ``--cache-dir``) with their metadata and entry points
and an ``accel`` command, so that ``accel launch`` and the plugin entry points work as
installed. Accelerate is the interpreter's own ``accelerate``, measured in a separate
process from accel's, and only when it is the real one (not accel's alias).

Every step runs in its own process (``tools/gpu_check/steps.py STEP``) with its own timeout,
one after another (they share the GPU), so a step that fails or hangs stops only itself; its
process tree is killed at the timeout. Each writes ``DIR/<step>.json`` (rows, figures) and
``DIR/<step>*.log``; at the end ``DIR/summary.json`` holds every record and the command
prints one Markdown table (step | accel | Accelerate 1.15 | goal / ok) and the command line.

Steps and their time budget on one H200 (planned / timeout, seconds; timeouts sum to 480,
``--timeout-scale`` multiplies them):

=================  =======  =======  ==========================================================
step               planned  timeout  what
=================  =======  =======  ==========================================================
environment        10       25       torch, CUDA, device, memory; which of accelerate,
                                     transformers, deepspeed, pytest import (each in a fresh
                                     process); host→device copy of a 1 GiB pinned and pageable
                                     tensor (CUDA events)
accel-gpu-tests    20       40       accel's own tests marked ``gpu`` (files that use the
                                     marker, every package and tests-integration):
                                     passed / failed / skipped
upstream-gpu       80       115      Accelerate 1.15's tests from its sdist that it gates on an
                                     accelerator (tools/upstream_suite.py ``--gpu``), against
                                     accel and against Accelerate
training           40       65       tools/bench/gpu_training.py: fp32 / bf16 / fp16 prepared
                                     loop (accumulation 4, clipping) vs a hand-written one:
                                     weights and step time; exact mid-epoch resume
engines            35       55       tools/bench/engines.py: FSDP2 on 1 GPU (nccl, bf16) vs raw
                                     ``fully_shard``; ZeRO-2 where DeepSpeed imports
offload            70       95       tools/bench/offload_gpu.py: depths 0 and 2, batches 1, 8,
                                     64, host staging register / ring, 8 CPU-busy processes
pretrained         40       60       tools/bench/pretrained.py: a bf16 Llama, 700 MB GPU
                                     budget, ``generate``, vs transformers + Accelerate
disk               12       25       tools/bench/disk_read.py: blocks on "disk", page cache
                                     dropped, first forward's read rate vs a plain read and dd
total              307      480      planned times include writing the checkpoints (4 GB for
                                     offload, 1.4 GB for pretrained, 0.8 GB for disk, under
                                     ``--cache-dir``), as on a fresh machine
=================  =======  =======  ==========================================================

Goals judged (``ok``): accel's tests pass; accel fails no upstream test that Accelerate
passes; weights within 1e-6 of the hand-written loop; resume bit-identical; step time ≤ 1.05×
raw (training, FSDP2); bytes per rank ≤ 1.05× raw; achieved H2D ≥ 85% of the pinned copy at
batch 1; tokens/s growing with the batch until compute-bound; busy ÷ idle ≥ 0.70;
load_pretrained decoding ≥ 1.5× Accelerate's and the same tokens; disk read rate ≥ 0.80× a
plain read. The exit code is 1 when a step failed (a goal missed, a step that broke or ran
past its timeout), else 0; a step not run ("not measured: no CUDA") does not count.

``--dry-run`` runs every step on the CPU with small sizes, accel's side only (under 90 s on
two busy cores): the GPU steps' code paths without a GPU. Speed goals are shown but not judged
there; correctness is. The upstream step runs in a dry run only with an sdist (cached by an
earlier tools/upstream_suite.py run, or given).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS_SCRIPT = ROOT / "tools" / "gpu_check" / "steps.py"
#: (step, timeout in seconds on one H200) in the order they run; the timeouts sum to 480.
STEPS: tuple[tuple[str, float], ...] = (
    ("environment", 25),
    ("accel-gpu-tests", 40),
    ("upstream-gpu", 115),
    ("training", 65),
    ("engines", 55),
    ("offload", 95),
    ("pretrained", 60),
    ("disk", 25),
)
#: Seconds a step's process keeps for itself to write its record before its timeout.
MARGIN = 3.0


# ---------------------------------------------------------------------------------------------
# accel from the checkout's sources
# ---------------------------------------------------------------------------------------------


def _entry_points(project: dict[str, Any]) -> str:
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    return "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()
    )


def source_overlay(folder: Path) -> tuple[list[str], Path | None]:
    """PYTHONPATH entries and a bin folder that make this checkout's accel run uninstalled.

    Empty when ``import accel`` works in this interpreter. Otherwise: ``packages/*/src``, and a
    ``site`` folder with a ``.dist-info`` per package (name, version, entry points: what
    ``importlib.metadata`` reads) plus ``bin/accel`` (``python -m accel_launch``).
    """
    if importlib.util.find_spec("accel") is not None:
        return [], None
    site, bin_dir = folder / "site", folder / "bin"
    for old in site.glob("*.dist-info"):
        for path in old.iterdir():
            path.unlink()
        old.rmdir()
    paths = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        src = pyproject.parent / "src"
        about = next(src.glob("*/__about__.py"))
        found = re.search(r"__version__\s*=\s*[\"']([^\"']+)", about.read_text(encoding="utf-8"))
        if found is None:
            raise SystemExit(f"gpu_check: no __version__ in {about}")
        name = project["name"]
        dist = site / f"{name.replace('-', '_')}-{found.group(1)}.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {found.group(1)}\n"
        (dist / "METADATA").write_text(metadata, encoding="utf-8")
        (dist / "entry_points.txt").write_text(_entry_points(project), encoding="utf-8")
        paths.append(str(src))
    bin_dir.mkdir(parents=True, exist_ok=True)
    command = bin_dir / "accel"
    command.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m accel_launch "$@"\n', encoding="utf-8"
    )
    command.chmod(0o755)
    return [str(site), *paths], bin_dir


def step_environment(cache: Path, dry_run: bool) -> dict[str, str]:
    """The environment of every step's process."""
    env = dict(os.environ)
    paths, bin_dir = source_overlay(cache / "accel-from-sources")
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if bin_dir is not None:
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["ACCEL_DISABLE_PROGRESS_BAR"] = "1"
    if dry_run:  # the CPU, one compute thread per process, as the CPU benchmarks run
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


# ---------------------------------------------------------------------------------------------
# Running the steps
# ---------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text(encoding="utf-8").rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the step's process, its group and everything it started (new groups too)."""
    below = descendants(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def run_step(name: str, timeout: float, args: argparse.Namespace, env: dict[str, str]) -> Any:
    """Run one step's process; its record (written by the step, or by us when it could not)."""
    record_file = args.out / f"{name}.json"
    record_file.unlink(missing_ok=True)
    command = [sys.executable, str(STEPS_SCRIPT), name, "--out", str(args.out)]
    command += ["--cache", str(args.cache_dir), "--budget", f"{timeout - MARGIN:.1f}"]
    command += ["--dry-run"] if args.dry_run else []
    if args.accelerate_sdist is not None:
        command += ["--accelerate-sdist", str(args.accelerate_sdist)]
    log = args.out / f"{name}.log"
    start = time.monotonic()
    with log.open("wb") as handle:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            code = None
        except BaseException:  # Ctrl-C: the step's processes are in a session of their own
            kill_tree(process)
            raise
    seconds = time.monotonic() - start
    record: dict[str, Any] | None = None
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(record_file.read_text(encoding="utf-8"))
    if record is None or code is None:
        last = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        reason = (
            f"ran past its timeout of {timeout:.0f} s (killed)"
            if code is None
            else f"exit code {code}, no record: {' '.join(last)[:300]}"
        )
        record = {"step": name, "status": "failed", "reason": reason, "rows": []}
    record.update(seconds=seconds, timeout=timeout, log=log.name)
    record_file.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def goal_cell(goal: str, ok: bool | None) -> str:
    if ok is None:
        return goal
    verdict = "**ok**" if ok else "**FAILED**"
    return f"{goal}: {verdict}" if goal else verdict


def table(records: list[dict[str, Any]]) -> list[str]:
    """The Markdown lines of the one table."""
    lines = ["| step | accel | Accelerate 1.15 | goal / ok |", "|---|---|---|---|"]
    for record in records:
        name = record["step"]
        if not record["rows"]:
            failed = record["status"] == "failed"
            text = ("**failed**: " if failed else "") + record["reason"]
            lines.append(f"| {name} | {_cell(text)} | | {'**FAILED**' if failed else ''} |")
            continue
        for entry in record["rows"]:
            cells = (entry["what"], entry["accel"], entry["accelerate"])
            goal = goal_cell(entry["goal"], entry["ok"])
            lines.append("| " + " | ".join(_cell(c) for c in (*cells, goal)) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [name for name, _ in STEPS]
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and logs")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small sizes, accel only")
    parser.add_argument("--steps", default=",".join(names), help="comma-separated subset")
    parser.add_argument(
        "--accelerate-sdist", type=Path, help="accelerate-1.15.0.tar.gz for the upstream step"
    )
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies timeouts")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=ROOT / ".cache" / "gpu-check",
        help="generated checkpoints and the source overlay (default .cache/gpu-check)",
    )
    args = parser.parse_args(argv)
    args.step_list = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in args.step_list if s not in names]
    if unknown or not args.step_list:
        parser.error(
            f"--steps: unknown {unknown or args.steps!r}; the steps are {', '.join(names)}"
        )
    if not args.timeout_scale > 0:
        parser.error(f"--timeout-scale must be positive, not {args.timeout_scale}")
    if args.accelerate_sdist is not None and not args.accelerate_sdist.is_file():
        parser.error(f"--accelerate-sdist {args.accelerate_sdist}: no such file")
    args.out = args.out.resolve()
    args.cache_dir = args.cache_dir.resolve()
    if args.accelerate_sdist is not None:
        args.accelerate_sdist = args.accelerate_sdist.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the selected steps, write summary.json, print the table; the exit code."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    env = step_environment(args.cache_dir, args.dry_run)
    command = "python3 tools/gpu_check.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    begin = time.monotonic()
    records = []
    for name, timeout in STEPS:
        if name not in args.step_list:
            continue
        limit = timeout * args.timeout_scale
        print(f"gpu_check: {name} (timeout {limit:.0f} s) ...", flush=True)
        record = run_step(name, limit, args, env)
        reason = f": {record['reason']}" if record["reason"] else ""
        print(f"gpu_check: {name}: {record['status']} in {record['seconds']:.0f} s{reason}")
        records.append(record)
    failed = [r["step"] for r in records if r["status"] == "failed"]
    summary = {
        "command": command,
        "dry_run": args.dry_run,
        "started": started,
        "seconds": time.monotonic() - begin,
        "failed": failed,
        "steps": records,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print()
    print("\n".join(table(records)))
    print()
    print(f"Command: `{command}` ({summary['seconds']:.0f} s; records in {args.out})")
    if failed:
        print(f"gpu_check: FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
