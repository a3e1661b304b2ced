"""Benchmark: how long a save stops training, synchronous vs asynchronous, vs raw torch and DCP.

    python tools/bench/checkpoint_async.py [--size-mb 300] [--repeats 5] [--steps 6]
                                           [--dir /tmp] [--json out.json] [--dry-run]

Run it with an interpreter that has accel installed (.venv/bin/python after `nox -s dev`).
One process on the CPU: a stack of `Linear(2048, 2048)` layers with about `--size-mb` MB of
fp32 weights, AdamW after one step (optimizer state = 2x the weights), a loader and a
scheduler, prepared by `Accelerator(cpu=True)`.

Measured, per round (`--repeats` rounds, medians reported):
- copy: the time to copy every tensor of the model and optimizer state into host buffers
  allocated beforehand (`Tensor.copy_`): the floor for any snapshot on this machine.
- blocked, async: the time `save_state(dir, async_save=True)` takes to return (after one
  warm-up save that allocates the snapshot buffers), then the background write is awaited.
- blocked, sync: `save_state(dir)`.
- raw torch: `safetensors.torch.save_file` of the weights + `torch.save` of the optimizer
  state (no fsync), and torch DCP's `async_save` of the same state dicts, time until it
  returns (over a 1-process gloo group; skipped with the reason when it does not run).
- write: from the asynchronous call until the checkpoint is complete (the writer thread
  runs at `--writer-nice`, accel's default 19: it takes the cores training leaves idle).
- training during the write: `--steps` training steps (forward, backward, AdamW on a batch
  of `--batch` rows) started right after the asynchronous call, against `--steps` steps with
  no write, in the same round (the order alternates between rounds); the speed ratio is
  no-write time / under-write time (1.0: unchanged), median and range over the rounds.
Checked once: an asynchronous save's files are byte-identical to a synchronous save's of the
same state. `--dry-run`: a 20 MB model, 1 round (seconds), to check the script.
Prints a Markdown table for docs/benchmarks.md; `--json FILE` writes the raw numbers with the
command and the machine (tools/bench/record.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.bench.record import write_record  # noqa: E402

WIDTH = 2048
MB = 1_000_000


def _model(size_mb: float) -> torch.nn.Module:
    layers = max(1, round(size_mb * MB / (4 * (WIDTH * WIDTH + WIDTH))))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, list | tuple):
        return [t for value in state for t in _tensors(value)]
    return []


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _fresh(directory: Path) -> Path:
    if directory.exists():
        shutil.rmtree(directory)
    os.sync()
    return directory


def _dcp_async(model: Any, optimizer: Any, directory: Path) -> tuple[float, str]:
    """Seconds until DCP's async_save returns (then waited for), or NaN and why not."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    try:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29571")
            dist.init_process_group("gloo", rank=0, world_size=1)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(directory))
        blocked = time.perf_counter() - start
        future.result()
        return blocked, ""
    except Exception as error:  # noqa: BLE001 - reported in the table instead of a number
        return float("nan"), f"{type(error).__name__}: {error}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader, TensorDataset

    import accel.async_save
    from accel import Accelerator

    accel.async_save.WRITER_NICE = args.writer_nice

    work = Path(tempfile.mkdtemp(prefix="accel-bench-async-", dir=args.dir))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _model(args.size_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    rows = torch.randn(args.batch * 64, WIDTH)
    loader = DataLoader(TensorDataset(rows, rows), batch_size=args.batch, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    batches = iter(loader)

    def step() -> float:
        nonlocal batches
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        start = time.perf_counter()
        accelerator.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    step()  # Adam's state exists from here on
    state_tensors = _tensors(model.state_dict()) + _tensors(optimizer.state_dict())
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors)
    buffers = [torch.empty_like(t) for t in state_tensors]

    # Byte-identical check, and the warm-up save that allocates the snapshot buffers.
    accelerator.save_state(_fresh(work / "sync"))
    accelerator.save_state(_fresh(work / "async"), async_save=True)
    accelerator.wait_for_checkpoint()
    sync_files, async_files = _files(work / "sync"), _files(work / "async")
    identical = sync_files == async_files
    checkpoint_mb = sum(len(b) for b in sync_files.values()) / MB
    del sync_files, async_files

    results: dict[str, list[float]] = {
        k: []
        for k in (
            "copy",
            "async",
            "write_seconds",
            "sync",
            "raw",
            "dcp_async",
            "step_idle",
            "step_writing",
            "covered",
        )
    }
    dcp_note = ""
    for _ in range(args.repeats):
        start = time.perf_counter()
        for buffer, tensor in zip(buffers, state_tensors, strict=True):
            buffer.copy_(tensor)
        results["copy"].append(time.perf_counter() - start)

        def idle_block() -> None:
            os.sync()  # no write-back of an earlier save running under the idle steps
            results["step_idle"].append(sum(step() for _ in range(args.steps)))

        def writing_block() -> None:
            target = _fresh(work / "async")
            start = time.perf_counter()
            accelerator.save_state(target, async_save=True)
            results["async"].append(time.perf_counter() - start)
            results["step_writing"].append(sum(step() for _ in range(args.steps)))
            results["covered"].append(float(accelerator._background_saves.in_flight))
            accelerator.wait_for_checkpoint()
            results["write_seconds"].append(time.perf_counter() - start)

        # Alternate the order, so that drift of the machine's speed hits both sides.
        blocks = [idle_block, writing_block]
        if len(results["copy"]) % 2 == 0:
            blocks.reverse()
        for block in blocks:
            block()

        target = _fresh(work / "sync")
        start = time.perf_counter()
        accelerator.save_state(target)
        results["sync"].append(time.perf_counter() - start)

        target = _fresh(work / "raw")
        target.mkdir()
        start = time.perf_counter()
        inner = accelerator.unwrap_model(model)
        save_file(inner.state_dict(), target / "model.safetensors", metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), target / "optimizer.bin")
        results["raw"].append(time.perf_counter() - start)

        blocked, dcp_note = _dcp_async(inner, optimizer.optimizer, _fresh(work / "dcp"))
        results["dcp_async"].append(blocked)
    accelerator.end_training()
    shutil.rmtree(work, ignore_errors=True)
    return {
        "state_mb": state_bytes / MB,
        "checkpoint_mb": checkpoint_mb,
        "byte_identical": identical,
        "dcp_note": dcp_note,
        "threads": torch.get_num_threads(),
        "writer_nice": args.writer_nice,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        **results,
    }


def table(result: dict[str, Any]) -> str:
    med = {k: statistics.median(v) for k, v in result.items() if isinstance(v, list) and v}
    copy = med["copy"]
    lines = [
        f"State {result['state_mb']:.0f} MB in tensors, checkpoint {result['checkpoint_mb']:.0f} MB"
        f" on disk; byte-identical async vs sync: {result['byte_identical']}; "
        f"{result['cpus']} CPUs, {result['threads']} torch threads.",
        "",
        "| measurement | seconds (median) | ÷ copy to host |",
        "|---|---|---|",
        f"| copy of the state into host buffers (`copy_`) | {copy:.3f} | 1.00 |",
        f"| accel `save_state(async_save=True)`: training blocked | {med['async']:.3f} | "
        f"{med['async'] / copy:.2f} |",
        f"| accel background write, call to complete (writer nice {result['writer_nice']}) | "
        f"{med['write_seconds']:.3f} | {med['write_seconds'] / copy:.2f} |",
        f"| accel `save_state()` (sync, fsync): training blocked | {med['sync']:.3f} | "
        f"{med['sync'] / copy:.2f} |",
        f"| raw `save_file` + `torch.save` (no fsync) | {med['raw']:.3f} | "
        f"{med['raw'] / copy:.2f} |",
    ]
    if "dcp_async" in med and med["dcp_async"] == med["dcp_async"]:
        lines.append(
            f"| torch DCP `async_save` until it returns | {med['dcp_async']:.3f} | "
            f"{med['dcp_async'] / copy:.2f} |"
        )
    else:
        lines.append(f"| torch DCP `async_save` | not measured: {result['dcp_note']} | |")
    ratios = [i / w for i, w in zip(result["step_idle"], result["step_writing"], strict=True)]
    covered = all(result["covered"])
    lines.append(
        f"| {result['steps']} training steps, no write / under the background write | "
        f"{med['step_idle']:.3f} / {med['step_writing']:.3f} | "
        f"speed {statistics.median(ratios):.2f}× (range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"write still running at the end: {covered}) |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=10, help="idle steps timed before and after each write"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--writer-nice", type=int, default=19, help="the writer thread's nice")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.size_mb, args.repeats, args.steps = 20, 1, 2
    result = run(args)
    print(table(result))
    if args.json is not None:
        write_record(args.json, "checkpoint_async", result)
    if not result["byte_identical"]:
        sys.exit("an asynchronous save's files differ from a synchronous save's")


if __name__ == "__main__":
    main()
