"""What ``import accel`` costs on top of ``import torch``, beside Accelerate 1.15.

Each sample is a fresh interpreter that times ``import torch`` and then ``import <module>``
(so torch's own time is measured in the same process); the table gives the median over
``--samples`` interpreters of each, and their ratio. Modules are measured in turns, one
interpreter each, so that drift of the machine spreads over all of them.

Bytecode: by default every interpreter reads compiled bytecode from a cache made by a
warm-up run (``PYTHONPYCACHEPREFIX`` in a temporary folder), as an installed wheel has it;
``--no-bytecode-cache`` compiles every module in every interpreter instead
(``PYTHONDONTWRITEBYTECODE=1`` with an editable install, which is what a checkout without
``__pycache__`` gives).

Usage::

    .venv/bin/python tools/bench/import_cost.py --samples 21
    .venv/bin/python tools/bench/import_cost.py --samples 21 --json /tmp/import.json
    .venv/bin/python tools/bench/import_cost.py --samples 21 --no-bytecode-cache --only accel

Another checkout's packages (an earlier commit) are measured by putting their ``src`` folders
first on ``PYTHONPATH``: they then shadow the editable install of this one.

Accelerate is measured when ``tools/reference_venv.py`` has made its venv (or
``--accelerate-python`` names an interpreter that imports it); ``--no-accelerate`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / ".bench-venvs" / "accelerate-1.15" / "bin" / "python"
CODE = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import {module}; t2 = time.perf_counter(); print(t1 - t0, t2 - t0)"
)


def sample(python: str, module: str, env: dict[str, str]) -> tuple[float, float]:
    """Seconds to ``import torch``, and to ``import torch`` then ``module``, in a new process."""
    done = subprocess.run(
        [python, "-c", CODE.format(module=module)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    )
    first, second = (float(x) for x in done.stdout.split())
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=21, help="fresh interpreters per module")
    parser.add_argument("--no-bytecode-cache", action="store_true")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--accelerate-python", default=str(REFERENCE))
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--only", nargs="+", help="measure only these rows (e.g. accel 'accelerate 1.15')"
    )
    args = parser.parse_args()

    cases = [
        ("accel", sys.executable, "accel"),
        ("accel (Accelerator built)", sys.executable, "accel; accel.Accelerator(cpu=True)"),
        ("accel_state", sys.executable, "accel_state"),
        ("accel_data", sys.executable, "accel_data"),
        ("accel_bigmodel", sys.executable, "accel_bigmodel"),
    ]
    if not args.no_accelerate and Path(args.accelerate_python).exists():
        cases.append(("accelerate 1.15", args.accelerate_python, "accelerate"))
    if args.only:
        cases = [case for case in cases if case[0] in args.only]
    with tempfile.TemporaryDirectory(prefix="import-cost-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        if args.no_bytecode_cache:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            env["PYTHONPYCACHEPREFIX"] = os.path.join(cache, "never-written")
        for _, python, module in cases:  # warm-up: fill the bytecode cache and page cache
            sample(python, module, env)
            sample(python, module, env)
        results: dict[str, tuple[list[float], list[float]]] = {c[0]: ([], []) for c in cases}
        for _ in range(args.samples):
            for label, python, module in cases:
                torch_s, total_s = sample(python, module, env)
                results[label][0].append(torch_s)
                results[label][1].append(total_s)
    mode = "no bytecode cache" if args.no_bytecode_cache else "bytecode cached"
    print(
        f"| `import X` after `import torch` ({mode}, median of {args.samples}) | torch s "
        "| torch + X s | ratio |"
    )
    print("|---|---|---|---|")
    rows = []
    for label, (torch_times, totals) in results.items():
        torch_s, total_s = statistics.median(torch_times), statistics.median(totals)
        rows.append(
            {
                "module": label,
                "torch_s": torch_s,
                "total_s": total_s,
                "ratio": total_s / torch_s,
                "bytecode_cached": not args.no_bytecode_cache,
                "samples": args.samples,
            }
        )
        print(f"| {label} | {torch_s:.3f} | {total_s:.3f} | {total_s / torch_s:.3f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
