"""Benchmark: per-batch overhead of accel_data.prepare_data_loader vs Accelerate 1.15 vs raw.

    python tools/bench/dataloader.py [--repeats 20] [--rows 100000] [--no-accel | --no-accelerate]

Run it with an interpreter that has accel-data installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate runs from its own venv (tools/reference_venv.py creates it). Each
library runs in its own single-process worker (no torch.distributed): a TensorDataset of
`--rows` rows x 16 float32 features (fixed seed), DataLoader batch size 32, prepared with
`prepare_data_loader(loader, device=cpu, num_processes=1, process_index=0, put_on_device=True)`.
After one checked warm-up epoch of each, the raw DataLoader and the prepared loader are timed
in the same process in paired blocks of 100 batches (raw then prepared, then prepared then
raw, ...; each keeps its own iterator across blocks and restarts it at the end of an epoch),
`--repeats` epochs' worth of batches each, with the garbage collector off. Sequential and
shuffle=True loaders are separate rows. Reported: median microseconds per batch of each, and
the median of the per-pair ratios prepared/raw with its interquartile range, which is what to
compare (whole epochs vary by 30% on a shared 2-core machine; paired blocks resolve 1%).
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
# Imported by name: mypy on this file alone finds neither tools/ nor the libraries' packages.
MODULES = {"accel": "accel_data", "accelerate": "accelerate.data_loader"}
FEATURES = 16
BATCH_SIZE = 32
BLOCK = 100  # batches per timed block
DATA_SEED = 0


def time_block(iterators: dict[str, Any], loaders: dict[str, Any], name: str) -> float:
    """Microseconds per batch over BLOCK batches of one loader (restarting it at epoch ends)."""
    iterator = iterators[name]
    start = time.perf_counter()
    for _ in range(BLOCK):
        try:
            next(iterator)
        except StopIteration:
            iterator = iterators[name] = iter(loaders[name])
            next(iterator)
    return (time.perf_counter() - start) / BLOCK * 1e6


def worker(impl: str, rows: int, repeats: int) -> None:
    """Time raw vs prepared epochs in this interpreter; print one JSON line per variant."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    prepare: Callable[..., Any] = importlib.import_module(MODULES[impl]).prepare_data_loader

    torch.manual_seed(DATA_SEED)
    generator = torch.Generator().manual_seed(DATA_SEED)
    dataset = TensorDataset(torch.randn(rows, FEATURES, generator=generator))
    expected_batches = -(-rows // BATCH_SIZE)
    for shuffle in (False, True):
        raw = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=shuffle)
        prepared = prepare(
            raw,
            device=torch.device("cpu"),
            num_processes=1,
            process_index=0,
            put_on_device=True,
        )
        # Warm-up epoch of each, checked: same rows, same batching (same order unless shuffled).
        raw_batches = [batch[0] for batch in raw]
        prepared_batches = [batch[0] for batch in prepared]
        assert len(raw_batches) == len(prepared_batches) == expected_batches, (
            f"{impl}: {len(raw_batches)} raw vs {len(prepared_batches)} prepared batches"
        )
        assert all(batch.device.type == "cpu" for batch in prepared_batches)
        if shuffle:
            assert torch.equal(
                torch.cat(prepared_batches)[:, 0].sort().values,
                dataset.tensors[0][:, 0].sort().values,
            ), f"{impl}: shuffled prepared loader does not yield every row once"
        else:
            assert all(
                torch.equal(a, b) for a, b in zip(raw_batches, prepared_batches, strict=True)
            ), f"{impl}: sequential prepared loader yields different batches than the raw one"
        del raw_batches, prepared_batches

        # Paired blocks: BLOCK batches of one loader, then BLOCK of the other (order
        # alternating), each loader resuming its own iterator and restarting it at the end
        # of an epoch. Drift on a shared machine hits both halves of a pair alike, so the
        # median of the per-pair ratios is stable to about 1% where whole epochs vary 30%.
        iterators = {"raw": iter(raw), "prepared": iter(prepared)}
        loaders = {"raw": raw, "prepared": prepared}
        per_batch: dict[str, list[float]] = {"raw": [], "prepared": []}
        pairs = repeats * expected_batches // BLOCK
        gc.disable()
        try:
            for index in range(pairs):
                names = ("raw", "prepared") if index % 2 else ("prepared", "raw")
                for name in names:
                    per_batch[name].append(time_block(iterators, loaders, name))
        finally:
            gc.enable()
        result = {
            "impl": impl,
            "shuffle": shuffle,
            "batches": pairs * BLOCK,
            "raw_us": per_batch["raw"],
            "prepared_us": per_batch["prepared"],
        }
        print(json.dumps(result), flush=True)


def run_worker(
    python: str, impl: str, env_extra: dict[str, str], rows: int, repeats: int
) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    command = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        impl,
        "--rows",
        str(rows),
        "--repeats",
        str(repeats),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        hint = " (no accel_data here? pass --no-accel)" if impl == "accel" else ""
        raise SystemExit(f"{impl} worker failed{hint}:\n{done.stdout}\n{done.stderr}")
    return [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=20, help="epochs of batches timed per loader"
    )
    parser.add_argument("--rows", type=int, default=100_000, help="rows in the TensorDataset")
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--no-accel", action="store_true", help="skip the accel side")
    skip.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate side")
    parser.add_argument("--worker", choices=["accel", "accelerate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.rows < 1:
        parser.error("--repeats and --rows must be positive")

    if args.worker:
        worker(args.worker, args.rows, args.repeats)
        return

    pythons: dict[str, str] = {}
    envs: dict[str, dict[str, str]] = {}
    if not args.no_accel:
        pythons["accel"] = sys.executable
        envs["accel"] = {}
    if not args.no_accelerate:
        ensure_accelerate_venv: Callable[[], Path] = importlib.import_module(
            "reference_venv"
        ).ensure_accelerate_venv
        pythons["accelerate"] = str(ensure_accelerate_venv())
        envs["accelerate"] = {"ACCELERATE_USE_CPU": "1"}

    print("| measurement | prepared | raw DataLoader | ratio |")
    print("|---|---|---|---|")
    for impl, python in pythons.items():
        for result in run_worker(python, impl, envs[impl], args.rows, args.repeats):
            raw_us, prepared_us = result["raw_us"], result["prepared_us"]
            lib = statistics.median(prepared_us)
            raw = statistics.median(raw_us)
            ratios = [p / r for p, r in zip(prepared_us, raw_us, strict=True)]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            kind = "shuffle=True" if result["shuffle"] else "sequential"
            print(
                f"| {impl} `prepare_data_loader`, {args.rows:,}x{FEATURES} fp32, batch "
                f"{BATCH_SIZE}, {kind}, cpu (median µs/batch; ratio = median of "
                f"{len(ratios)} paired {BLOCK}-batch blocks, IQR {q1:.3f}-{q3:.3f}) | "
                f"{lib:.1f} | {raw:.1f} | {statistics.median(ratios):.3f}× |"
            )


if __name__ == "__main__":
    main()
