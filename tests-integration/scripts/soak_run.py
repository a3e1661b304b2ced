"""A long run with asynchronous checkpoints, watched for leaks (for test_checkpoint_soak.py).

Every process trains ``--steps`` steps of a small MLP (about 1M parameters: weights and AdamW
state are a 12 MB snapshot) under DDP, saving with ``save_state()`` every ``--every`` steps
(automatic naming, ``total_limit=3``, ``async_save=True``), and samples its resident memory
and open file descriptors (less a checkpoint file being written at that moment) every
``--sample`` steps. After ``end_training`` it records the
threads still alive, and writes ``soak_<rank>.json`` into ``--report-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.utils import ProjectConfiguration, set_seed


def _open_descriptors(project: str) -> int:
    """Open file descriptors, except a checkpoint file the writer thread holds right now."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            continue
        count += not target.startswith(project)
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--sample", type=int, default=10)
    parser.add_argument("--report-dir", required=True)
    args = parser.parse_args()
    set_seed(3)
    threads_before = sorted(t.name for t in threading.enumerate())
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir,
            automatic_checkpoint_naming=True,
            total_limit=3,
            async_save=True,
        )
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 960)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    features = torch.randn(256, 64)
    loader = DataLoader(TensorDataset(features, torch.randn(256, 960)), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    process = psutil.Process()
    project = os.path.realpath(args.project_dir)
    samples: list[dict[str, int]] = []
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every == 0:
                accelerator.save_state()
            if step % args.sample == 0:
                fds = _open_descriptors(project)
                samples.append({"step": step, "rss": process.memory_info().rss, "fds": fds})
            if step == args.steps:
                break
    snapshot_bytes = accelerator._background_saves.snapshot.nbytes
    rank = accelerator.process_index
    accelerator.end_training()
    report = {
        "rank": rank,
        "samples": samples,
        "snapshot_bytes": snapshot_bytes,
        "threads_before": threads_before,
        "threads_after": sorted(t.name for t in threading.enumerate()),
    }
    path = os.path.join(args.report_dir, f"soak_{rank}.json")
    with open(path, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
