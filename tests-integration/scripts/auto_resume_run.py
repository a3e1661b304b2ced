"""A training script that resumes itself, killed at chosen points (for test_auto_resume_launch.py).

Run under ``accel launch --cpu --num_processes 2 --max_restarts N``. It calls
``accelerator.resume()`` once after ``prepare`` and trains ``--total`` micro-steps (several
epochs of a shuffled, seedable loader; AdamW, StepLR, accumulation 2, dropout), saving with
``save_state()`` (automatic naming, ``total_limit=3``) every ``--save-every`` micro-steps.

``--kill i:rank:step:where`` (repeatable) SIGKILLs process ``rank`` at micro-step ``step``
unless ``<project>/kills/<i>`` exists (a restarted attempt passes the same step again):
``where`` is ``step`` (right after the training step) or ``write`` (inside the background
write of the asynchronous save taken at that step, once ``save_state`` has returned and
training has gone on). The marker file records the micro-step the process had reached and
whether a background write was in flight.

Every process prints ``RESUMED {json}`` after ``resume()``; rank 0 writes the final weights
(safetensors) to ``--out`` and prints ``END {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from fsdp2_resume import Net  # the same model (blocks FSDP2 wraps), not a copy of it
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import accel.checkpoint_writing as writing
from accel import Accelerator, DataLoaderConfiguration
from accel.async_save import WRITER_THREAD_NAME
from accel.utils import FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed

ROWS = 96  # 12 batches of 4 per rank and epoch
BATCH = 4
SEED = 7


class Killer:
    """This process's pending kill points, and the micro-step it has reached."""

    def __init__(self, specs: list[str], rank: int, folder: Path, saves: Any) -> None:
        self.folder = folder
        self.saves = saves
        self.points: dict[tuple[int, str], Path] = {}
        for spec in specs:
            index, who, step, where = spec.split(":")
            marker = folder / index
            if int(who) == rank and not marker.exists():
                self.points[(int(step), where)] = marker
        self.seen = 0
        self.returned = threading.Event()
        self.armed: Path | None = None
        self.armed_at = -1
        self.armed_folder = ""
        real = writing._torch_save

        def torch_save(obj: Any, path: Path) -> None:
            if (
                self.armed is not None
                and threading.current_thread().name == WRITER_THREAD_NAME
                and Path(path).parent.name == self.armed_folder  # this save's, not the last's
            ):
                # Wait until save_state has returned and a step ran after it: the kill lands
                # in a write that overlaps training.
                self.returned.wait(30)
                self.die(self.armed, "write")
            real(obj, path)

        writing._torch_save = torch_save

    def die(self, marker: Path, where: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        in_flight = where == "write" or self.saves.in_flight
        marker.write_text(json.dumps({"seen": self.seen, "where": where, "in_flight": in_flight}))
        with open(marker) as handle:
            os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, seen: int) -> None:
        self.seen = seen
        if self.armed is not None and seen > self.armed_at:
            self.returned.set()
        marker = self.points.get((seen, "step"))
        if marker is not None:
            self.die(marker, "step")

    def before_save(self, seen: int, number: int) -> None:
        marker = self.points.get((seen, "write"))
        if marker is not None:
            self.armed, self.armed_at = marker, seen
            self.armed_folder = f".checkpoint_{number}.incomplete"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--engine", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    set_seed(SEED)
    engine: dict[str, Any] = {}
    if args.engine == "fsdp2":
        engine["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", state_dict_type="SHARDED_STATE_DICT"
        )
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir,
            automatic_checkpoint_naming=True,
            total_limit=3,
            async_save=args.async_save,
        ),
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **engine,
    )
    rank = accelerator.process_index
    data = torch.Generator().manual_seed(SEED)
    features = torch.randn(ROWS * accelerator.num_processes, 6, generator=data)
    targets = features.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(features), 1)
    loader = DataLoader(TensorDataset(features, targets), batch_size=BATCH, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    resumed = accelerator.resume()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    report = {
        "rank": rank,
        "attempt": attempt,
        "checkpoint": None if not resumed else Path(resumed.checkpoint).name,
        "batches_seen": resumed.batches_seen,
        "epoch": resumed.epoch,
    }
    print("RESUMED " + json.dumps(report), flush=True)
    # The background saver is read only to report whether a write was in flight at a kill.
    saves = accelerator._background_saves
    killer = Killer(args.kill, rank, Path(args.project_dir) / "kills", saves)
    epochs = -(-args.total // len(loader))
    seen = resumed.batches_seen
    for epoch in range(resumed.epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen += 1
            killer.after_step(seen)
            if seen % args.save_every == 0:
                killer.before_save(seen, accelerator.save_iteration)
                accelerator.save_state()
            if seen == args.total:
                break
    weights = accelerator.get_state_dict(model)  # a collective: full weights on rank 0
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, args.out)
        print("END " + json.dumps({"seen": seen, "attempt": attempt}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
