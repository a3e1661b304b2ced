"""Benchmark: filling the offload engine's pinned ring on the host, idle and beside a busy CPU.

    python tools/bench/staging.py [--mb 256] [--repeats 5] [--busy 2] [--threads 1,2,4]
                                  [--json FILE]

Run it with an interpreter that has accel-bigmodel installed (e.g. .venv/bin/python). No GPU
is needed: this is the host half of the ring route of accel's GPU staging
(``ACCEL_OFFLOAD_STAGING=ring``, and the disk tier), the part that competes with other work
for the CPU. The direct route (page-locked in place) does no host copy at all and is measured
on a GPU by ``tools/gpu_check.py``.

What it does: a source of ``--mb`` MB is copied into a destination buffer of the same size
(both in RAM; on a CUDA machine the destination is page-locked) by

- ``torch copy_``: one ``dst.copy_(src)`` call, with torch's intra-op pool at its default size
  (what the engine did before issue 30: it splits the copy over OpenMP threads);
- ``memmove xN``: accel's :class:`~accel_bigmodel.prefetch.copy_threads.ParallelCopier` with N
  threads (ctypes ``memmove``, GIL released, no OpenMP), for each N of ``--threads``;

once on an idle machine and once while ``--busy`` processes spin on the CPU (each a Python
loop). Reported: the median GB/s over ``--repeats`` copies, and busy / idle for each method.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
try:
    from accel_bigmodel.prefetch.copy_threads import ParallelCopier, Piece
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "packages" / "accel-state" / "src"))
    sys.path.insert(0, str(ROOT / "packages" / "accel-bigmodel" / "src"))
    from accel_bigmodel.prefetch.copy_threads import ParallelCopier, Piece

GB = 1e9


def _spin(stop: multiprocessing.synchronize.Event) -> None:
    value = 0
    while not stop.is_set():
        for _ in range(10_000):
            value += 1


def _bandwidth(copy: Callable[[], None], nbytes: int, repeats: int) -> float:
    copy()  # warm-up: pages touched, threads started
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        rates.append(nbytes / (time.perf_counter() - start) / GB)
    return statistics.median(rates)


def measure(mb: int, repeats: int, threads: list[int]) -> dict[str, float]:
    """GB/s of each method, in this process, as the machine is now."""
    nbytes = mb * 1_000_000
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    pinned = torch.cuda.is_available()
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    results = {"torch copy_": _bandwidth(lambda: target.copy_(source), nbytes, repeats)}
    for count in threads:
        copier = ParallelCopier(count)
        piece = [Piece(target.data_ptr(), source.data_ptr(), nbytes)]
        results[f"memmove x{count}"] = _bandwidth(
            functools.partial(copier.copy, piece), nbytes, repeats
        )
        copier.close()
        if not torch.equal(target, source):
            raise SystemExit(f"memmove x{count} copied wrong bytes")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    threads = [int(part) for part in args.threads.split(",") if part]
    idle = measure(args.mb, args.repeats, threads)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    try:
        time.sleep(0.5)
        busy = measure(args.mb, args.repeats, threads)
    finally:
        stop.set()
        for process in spinners:
            process.join()
    print(
        f"Host fill of a {args.mb} MB ring, {os.cpu_count()} CPUs, torch intra-op threads "
        f"{torch.get_num_threads()}, destination {'pinned' if torch.cuda.is_available() else 'RAM'}"
        f"; busy = {args.busy} spinning processes.\n"
    )
    print("| method | idle GB/s | busy GB/s | busy ÷ idle |")
    print("|---|---|---|---|")
    for method in idle:
        ratio = busy[method] / idle[method]
        print(f"| {method} | {idle[method]:.2f} | {busy[method]:.2f} | {ratio:.2f} |")
    command = " ".join(["python", "tools/bench/staging.py", *sys.argv[1:]])
    print(f"\nCommand: `{command}`")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"idle": idle, "busy": busy, "args": vars(args)}, default=str)
        )


if __name__ == "__main__":
    main()
