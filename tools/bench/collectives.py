"""Benchmark: accel_state.gather vs raw torch.distributed vs Accelerate 1.15, and import cost.

    python tools/bench/collectives.py [--repeats 3] [--no-accelerate]

Run it with an interpreter that has accel-state installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate runs from its own venv (tools/reference_venv.py creates it). Each
measurement is a 2-process gloo run on 127.0.0.1 under torchrun: `gather` of 1,000 float32
per rank, median microseconds per call, raw `all_gather` + `torch.cat` timed in the same run
in alternating blocks. The ratio library/raw is what to compare (goal for accel: <= 1.05).
Import cost: median over fresh interpreters of the time to import the package after torch
vs importing torch alone. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from reference_venv import ensure_accelerate_venv  # noqa: E402

WORKER = ROOT / "tools" / "bench" / "_gather_worker.py"


def run_gather(python: str, impl: str, env_extra: dict[str, str]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **env_extra}
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        "--impl",
        impl,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{impl} gather run failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)  # type: ignore[no-any-return]


def import_seconds(python: str, module: str, samples: int) -> tuple[float, float]:
    """Median seconds to import torch alone, and torch followed by ``module``."""
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        f"import {module}; t2 = time.perf_counter(); print(t1 - t0, t2 - t0)"
    )
    torch_only, total = [], []
    for _ in range(samples):
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
        first, second = (float(x) for x in out.stdout.split())
        torch_only.append(first)
        total.append(second)
    return statistics.median(torch_only), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="torchrun launches per library")
    parser.add_argument("--import-samples", type=int, default=15)
    parser.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate side")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {"accel": []}
    pythons = {"accel": sys.executable}
    envs: dict[str, dict[str, str]] = {"accel": {}}
    modules = {"accel": "accel_state"}
    if not args.no_accelerate:
        pythons["accelerate"] = str(ensure_accelerate_venv())
        envs["accelerate"] = {"ACCELERATE_USE_CPU": "1"}
        modules["accelerate"] = "accelerate"
        runs["accelerate"] = []
    for _ in range(args.repeats):
        for impl in runs:
            runs[impl].append(run_gather(pythons[impl], impl, envs[impl]))

    print("| measurement | library | raw torch | ratio |")
    print("|---|---|---|---|")
    for impl, results in runs.items():
        ratios = [r["library_us"] / r["raw_us"] for r in results]
        lib = statistics.median(r["library_us"] for r in results)
        raw = statistics.median(r["raw_us"] for r in results)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(
            f"| {impl} `gather` 1k fp32, 2 gloo ranks (median µs/call; ratio median of "
            f"{len(ratios)} runs, range {spread}) | {lib:.1f} | {raw:.1f} | "
            f"{statistics.median(ratios):.3f}× |"
        )
    for impl, module in modules.items():
        torch_s, total_s = import_seconds(pythons[impl], module, args.import_samples)
        print(
            f"| `import {module}` after `import torch` (median of {args.import_samples} fresh "
            f"interpreters, s) | {total_s:.3f} | {torch_s:.3f} | {total_s / torch_s:.3f}× |"
        )


if __name__ == "__main__":
    main()
