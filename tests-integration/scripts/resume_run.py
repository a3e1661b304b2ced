"""A deterministic 2-process training run that checkpoints, resumes, and can SIGKILL itself.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests-integration/scripts/resume_run.py --project-dir DIR --total-steps 36 \
        --save-every 6 [--resume] [--kill-at SPEC] [--accumulation 2] \
        [--mixed-precision no|bf16] [--trace trace.jsonl] --out weights.safetensors

Trains a small MLP with dropout (AdamW, StepLR, a shuffled seedable loader) for
``--total-steps`` micro-steps, calling ``accelerator.save_state()`` (automatic naming,
``total_limit=2``) every ``--save-every`` micro-steps. The micro-step counter lives in a
custom object registered with ``register_for_checkpointing``. With ``--resume`` the newest
complete checkpoint, if any, is loaded first. Rank 0 writes the final (unwrapped) weights to
``--out`` as safetensors and prints one JSON line describing the run. With ``--trace``, rank 0
also appends, after every micro-step, a JSON line with the step, its loss and a digest of the
weights, so a resumed run can be compared with an uninterrupted one step by step.

``--kill-at`` makes one rank ``SIGKILL`` itself:

* ``train:<n>[:<rank>]`` right after micro-step ``n`` (before a save at ``n``; rank 0 by
  default);
* ``save:<n>:<k>:<rank>`` during the save at micro-step ``n``. The save's events on that rank
  are its file writes (``_torch_save`` / ``_write_bytes`` / ``_save_weights``), then, on rank
  0, the manifest (``_write_manifest``) and the rename (``_commit``). ``k=0`` kills before the
  first event,
  ``k>=1`` right after the ``k``-th one (so the last ``k`` of rank 0 kills after the rename,
  before ``total_limit`` pruning).

Used by tests-integration/test_checkpoint_faults.py.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import accel.checkpoint_writing as checkpointing
from accel import Accelerator, DataLoaderConfiguration
from accel.utils import ProjectConfiguration, set_seed

ROWS = 96
BATCH = 4
SEED = 1234
PATCHED = ("_torch_save", "_write_bytes", "_save_weights", "_write_manifest", "_commit")


class Counter:
    """The micro-step counter, checkpointed through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def die() -> None:
    """SIGKILL this process: no cleanup, no flushing beyond what is already on disk."""
    os.kill(os.getpid(), signal.SIGKILL)


class SaveKiller:
    """Counts this rank's checkpoint-writing events while armed; kills at the chosen one."""

    def __init__(self, kill_after: int) -> None:
        self.kill_after = kill_after
        self.armed = False
        self.events = 0

    def wrap(self, name: str) -> None:
        original = getattr(checkpointing, name)

        @functools.wraps(original)
        def patched(*args: Any, **kwargs: Any) -> Any:
            if self.armed and self.kill_after == 0:
                die()
            result = original(*args, **kwargs)
            if self.armed:
                self.events += 1
                if self.events == self.kill_after:
                    die()
            return result

        setattr(checkpointing, name, patched)


def digest(model: torch.nn.Module) -> str:
    """A hash of every weight's bytes: equal digests mean bit-identical weights."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def parse_kill(spec: str | None) -> dict[str, int | str] | None:
    if spec is None:
        return None
    train = re.fullmatch(r"train:(\d+)(?::(\d+))?", spec)
    if train:
        return {"phase": "train", "step": int(train[1]), "rank": int(train[2] or 0)}
    save = re.fullmatch(r"save:(\d+):(\d+):(\d+)", spec)
    if save:
        return {"phase": "save", "step": int(save[1]), "k": int(save[2]), "rank": int(save[3])}
    raise SystemExit(f"--kill-at {spec!r}: expected train:<n>:<rank> or save:<n>:<k>:<rank>")


def main() -> None:
    args = parse_args()
    kill = parse_kill(args.kill_at)
    set_seed(SEED)

    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
        ),
        gradient_accumulation_steps=args.accumulation,
        mixed_precision=args.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    rank = accelerator.process_index

    data = torch.Generator().manual_seed(SEED)
    features = torch.randn(ROWS, 6, generator=data)
    targets = features @ torch.randn(6, 1, generator=data) + 0.1 * torch.randn(
        ROWS, 1, generator=data
    )
    loader = DataLoader(TensorDataset(features, targets), batch_size=BATCH, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    loaded = None
    if args.resume:
        base = Path(args.project_dir) / "checkpoints"
        if any(re.fullmatch(r"checkpoint_\d+", p.name) for p in base.glob("checkpoint_*")):
            loaded = accelerator.load_state()
            # accel's load_state already continues the numbering after the loaded checkpoint;
            # Accelerate leaves it to the caller, so a script written for both sets it.
            accelerator.project_configuration.iteration = int(loaded.rsplit("_", 1)[1]) + 1
    start = counter.n
    if accelerator.is_main_process:
        print(
            json.dumps(
                {"event": "start", "loaded": loaded and os.path.basename(loaded), "start": start}
            ),
            flush=True,
        )

    killer = None
    if kill is not None and kill["phase"] == "save" and kill["rank"] == rank:
        killer = SaveKiller(int(kill["k"]))
        for name in PATCHED:
            killer.wrap(name)

    unwrapped = accelerator.unwrap_model(model)
    trace = None
    if args.trace is not None and accelerator.is_main_process:
        trace = open(args.trace, "a")  # open for the whole run
    saves = []
    while counter.n < args.total_steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.n += 1
            if trace is not None:
                line = {"n": counter.n, "loss": loss.item(), "weights": digest(unwrapped)}
                trace.write(json.dumps(line) + "\n")
                trace.flush()
            if kill == {"phase": "train", "step": counter.n, "rank": rank}:
                die()
            if counter.n % args.save_every == 0:
                if killer is not None:
                    killer.armed = counter.n == kill["step"]
                saves.append(os.path.basename(accelerator.save_state()))
                if killer is not None and killer.armed:
                    raise SystemExit(
                        f"--kill-at {args.kill_at}: the save had only {killer.events} events"
                    )
            if counter.n >= args.total_steps:
                break

    if trace is not None:
        trace.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = unwrapped.state_dict()
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, args.out)
        report = {"event": "end", "loaded": loaded and os.path.basename(loaded), "start": start}
        print(json.dumps({**report, "saves": saves, "end": counter.n}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
