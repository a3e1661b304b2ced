"""Benchmark: ms per training step of a prepared loop vs the same raw PyTorch loop.

    python tools/bench/train_step.py [--pairs 40] [--block 20] [--no-accel | --no-accelerate]
                                     [--no-ddp] [--json FILE]

Run it with an interpreter that has accel installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate 1.15 runs from its own venv (tools/reference_venv.py creates it).
The model is an MLP (256 -> 512 -> 512 -> 10, ReLU), fp32, SGD with momentum, batch 64 of a
fixed synthetic TensorDataset (shuffled DataLoader), cross-entropy loss. The raw loop is
`loss.backward(); optimizer.step(); optimizer.zero_grad()` over a plain DataLoader; the
prepared loop is the same with `accelerator.prepare(model, optimizer, loader)` and
`accelerator.backward(loss)`. Both run in the same process on separate model copies, timed in
paired blocks of `--block` steps (order alternating, each loop resuming its own iterator), so
drift on a shared machine hits both halves of a pair alike. Rows: single process, and 2 gloo
processes under torchrun (raw `DistributedDataParallel` + `DistributedSampler` vs the
Accelerator's DDP; rank 0 reports). Reported: median ms/step of each, and the median of the
per-pair ratios prepared/raw with its interquartile range. Prints a Markdown table for
docs/benchmarks.md; `--json FILE` also writes every block's ms/step, per library and row, with
the command and the machine (tools/bench/record.py).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))
from tools.bench.record import write_record  # noqa: E402

BATCH = 64
ROWS = 64 * 200
SEED = 0


def build(torch: Any) -> Any:
    """The benchmark MLP."""
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def worker(impl: str, pairs: int, block: int) -> None:
    """Time raw vs prepared steps in this process; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    accelerator_cls: Callable[..., Any] = importlib.import_module(impl).Accelerator
    accelerator = accelerator_cls(cpu=True)
    distributed = accelerator.num_processes > 1
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    data = TensorDataset(
        torch.randn(ROWS, 256, generator=generator),
        torch.randint(0, 10, (ROWS,), generator=generator),
    )
    loss_fn = torch.nn.functional.cross_entropy

    raw_model = build(torch)
    prepared_model = build(torch)
    prepared_model.load_state_dict(raw_model.state_dict())
    if distributed:
        raw_model = torch.nn.parallel.DistributedDataParallel(raw_model)
        sampler = DistributedSampler(data, seed=SEED)
        raw_loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    else:
        raw_loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(
        prepared_model,
        torch.optim.SGD(prepared_model.parameters(), lr=0.01, momentum=0.9),
        DataLoader(data, batch_size=BATCH, shuffle=True),
    )

    def batches(source: Any) -> Iterator[Any]:
        while True:
            yield from source

    raw_iter, prepared_iter = batches(raw_loader), batches(loader)

    def raw_block() -> float:
        start = time.perf_counter()
        for _ in range(block):
            x, y = next(raw_iter)
            loss = loss_fn(raw_model(x), y)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad()
        return (time.perf_counter() - start) / block * 1e3

    def prepared_block() -> float:
        start = time.perf_counter()
        for _ in range(block):
            x, y = next(prepared_iter)
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return (time.perf_counter() - start) / block * 1e3

    raw_block(), prepared_block()  # warm-up
    times: dict[str, list[float]] = {"raw": [], "prepared": []}
    gc.disable()
    try:
        for index in range(pairs):
            order = ("raw", "prepared") if index % 2 else ("prepared", "raw")
            for name in order:
                times[name].append(raw_block() if name == "raw" else prepared_block())
    finally:
        gc.enable()
    if distributed:
        dist.barrier()
    if accelerator.is_main_process:
        print(json.dumps({"impl": impl, "processes": accelerator.num_processes, **times}))


def run(python: str, impl: str, processes: int, pairs: int, block: int) -> dict[str, Any]:
    """Run the worker (under torchrun for several processes) and return rank 0's result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if impl == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"
    script = [str(Path(__file__).resolve()), "--worker", impl]
    script += ["--pairs", str(pairs), "--block", str(block)]
    if processes > 1:
        command = [python, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node", str(processes), *script]
    else:
        command = [python, *script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{impl} x{processes} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def main() -> None:
    """Parse options, run every configuration, print the Markdown rows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=40, help="paired blocks per run")
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--no-accel", action="store_true", help="skip the accel side")
    skip.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate side")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process rows")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--worker", choices=["accel", "accelerate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pairs < 4 or args.block < 1:
        parser.error("--pairs must be >= 4 and --block >= 1")
    if args.worker:
        worker(args.worker, args.pairs, args.block)
        return
    pythons: dict[str, str] = {}
    if not args.no_accel:
        pythons["accel"] = sys.executable
    if not args.no_accelerate:
        ensure: Callable[[], Path] = importlib.import_module(
            "reference_venv"
        ).ensure_accelerate_venv
        pythons["accelerate"] = str(ensure())
    rows: list[dict[str, Any]] = []
    print("| measurement | prepared ms/step | raw ms/step | ratio |")
    print("|---|---|---|---|")
    for processes in (1,) if args.no_ddp else (1, 2):
        for impl, python in pythons.items():
            result = run(python, impl, processes, args.pairs, args.block)
            rows.append(result)
            ratios = [p / r for p, r in zip(result["prepared"], result["raw"], strict=True)]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            what = "single process" if processes == 1 else "2-process DDP (gloo) vs raw DDP"
            print(
                f"| {impl} training step, MLP 256-512-512-10 fp32, batch {BATCH}, SGD, cpu, "
                f"{what} (median of {len(ratios)} paired {args.block}-step blocks, IQR "
                f"{q1:.3f}-{q3:.3f}) | {statistics.median(result['prepared']):.3f} | "
                f"{statistics.median(result['raw']):.3f} | {statistics.median(ratios):.3f}× |"
            )
    if args.json is not None:
        figures = {"batch": BATCH, "pairs": args.pairs, "block": args.block, "rows": rows}
        write_record(args.json, "train_step", figures)


if __name__ == "__main__":
    main()
