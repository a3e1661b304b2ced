"""Benchmark: wall time of launching 2 CPU processes of a no-op script, accel vs torchrun vs
Accelerate 1.15.

    python tools/bench/launch.py [--repeats 5] [--no-accelerate]

Each measurement is the wall time from starting the command to its exit, for a script that
only imports torch and joins the gloo group (``torch.distributed.init_process_group``) then
leaves: ``accel launch --cpu --num_processes 2 -q noop.py`` (this interpreter, accel-launch
installed), raw ``python -m torch.distributed.run --standalone --nproc_per_node 2 noop.py``,
and ``accelerate launch --multi_gpu --num_processes 2 noop.py`` with ``ACCELERATE_USE_CPU=1``
(Accelerate's way to really start 2 CPU processes) from its own venv. The three run in
rotating order, ``--repeats`` rounds; reported: medians and the difference to torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

NOOP = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def timed(command: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit; the command must succeed."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    """Run the rounds and print the Markdown rows."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-accelerate", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "noop.py")
        script.write_text(NOOP)
        commands: dict[str, tuple[list[str], dict[str, str]]] = {
            "torchrun": (
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    "2",
                    str(script),
                ],
                env,
            ),
            "accel launch": (
                [
                    sys.executable,
                    "-m",
                    "accel_launch",
                    "launch",
                    "--cpu",
                    "--num_processes",
                    "2",
                    "-q",
                    str(script),
                ],
                env,
            ),
        }
        if not args.no_accelerate:
            ensure: Callable[[], Path] = importlib.import_module(
                "reference_venv"
            ).ensure_accelerate_venv
            python = ensure()
            accelerate = python.parent / "accelerate"
            commands["accelerate launch"] = (
                [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", str(script)],
                {**env, "ACCELERATE_USE_CPU": "1"},
            )
        times: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for round_index in range(args.repeats):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                command, command_env = commands[name]
                times[name].append(timed(command, command_env))
    base = statistics.median(times["torchrun"])
    print("| launcher (2 CPU processes, no-op script) | median wall s | vs torchrun |")
    print("|---|---|---|")
    for name in names:
        value = statistics.median(times[name])
        print(f"| {name} (median of {args.repeats}) | {value:.2f} | {value - base:+.2f} s |")


if __name__ == "__main__":
    main()
