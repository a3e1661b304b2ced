"""Benchmark: per-batch overhead of accel_data.prepare_data_loader vs Accelerate 1.15 vs raw.

    python tools/bench/dataloader.py [--repeats 20] [--rows 100000] [--no-accel | --no-accelerate]

Run it with an interpreter that has accel-data installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate runs from its own venv (tools/reference_venv.py creates it). Each
library runs in its own single-process worker (no torch.distributed): a TensorDataset of
`--rows` rows x 16 float32 features (fixed seed), DataLoader batch size 32, prepared with
`prepare_data_loader(loader, device=cpu, num_processes=1, process_index=0, put_on_device=True)`.
Full epochs of the raw DataLoader and of the prepared loader are timed in the same process in
interleaved rounds (raw, prepared, then prepared, raw, ...), after one checked warm-up epoch of
each; sequential and shuffle=True loaders are separate rows. Reported: median microseconds per
batch of each, and the ratio prepared/raw (with the range of the per-round ratios), which is
what to compare. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
# Imported by name: mypy on this file alone finds neither tools/ nor the libraries' packages.
MODULES = {"accel": "accel_data", "accelerate": "accelerate.data_loader"}
FEATURES = 16
BATCH_SIZE = 32
DATA_SEED = 0


def epoch_seconds(loader: Iterable[Any]) -> tuple[float, int]:
    """Seconds to iterate ``loader`` once, and the number of batches it yielded."""
    batches = 0
    start = time.perf_counter()
    for _ in loader:
        batches += 1
    return time.perf_counter() - start, batches


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

        seconds: dict[str, list[float]] = {"raw": [], "prepared": []}
        order: list[tuple[str, Iterable[Any]]] = [("raw", raw), ("prepared", prepared)]
        for _ in range(repeats):
            for name, loader in order:
                elapsed, batches = epoch_seconds(loader)
                assert batches == expected_batches, f"{impl} {name}: {batches} batches"
                seconds[name].append(elapsed)
            order.reverse()
        result = {
            "impl": impl,
            "shuffle": shuffle,
            "batches": expected_batches,
            "raw_us": [s / expected_batches * 1e6 for s in seconds["raw"]],
            "prepared_us": [s / expected_batches * 1e6 for s in seconds["prepared"]],
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
    parser.add_argument("--repeats", type=int, default=20, help="timed epochs per loader")
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
            spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
            kind = "shuffle=True" if result["shuffle"] else "sequential"
            print(
                f"| {impl} `prepare_data_loader`, {args.rows:,}x{FEATURES} fp32, batch "
                f"{BATCH_SIZE}, {kind}, cpu (median µs/batch of {len(raw_us)} epochs; "
                f"per-round ratio range {spread}) | {lib:.1f} | {raw:.1f} | {lib / raw:.3f}× |"
            )


if __name__ == "__main__":
    main()
