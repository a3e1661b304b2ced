"""A deterministic 2-rank FSDP2 (or DeepSpeed) run that checkpoints, resumes, and can SIGKILL
itself mid-save.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests-integration/scripts/fsdp2_resume.py --project-dir DIR --total-steps 24 \
        --save-every 3 [--stop-at N] [--resume] [--kill-at SPEC] [--state-dict-type TYPE] \
        [--engine fsdp2|zero2|zero3] --out weights.safetensors

An MLP of residual blocks with dropout, sharded by FSDP2 (TRANSFORMER_BASED_WRAP), AdamW,
StepLR, a shuffled seedable loader and 2 accumulation steps; ``save_state()`` (automatic
naming, ``total_limit=2``) every ``--save-every`` micro-steps, so saves land inside
accumulation windows too. ``--resume`` loads the newest complete checkpoint first. Rank 0
writes the final full weights to ``--out`` and prints one JSON line.

``--kill-at <where>:<step>:<rank>`` SIGKILLs one rank during the save at micro-step ``step``:
``dcp-model`` after this rank wrote its model shards, ``dcp-optimizer`` after its optimizer
shards, ``ds-save`` after DeepSpeed wrote this rank's files (``--engine zero2/3``),
``manifest`` before the manifest is written (rank 0), ``commit`` right after the rename,
before pruning (rank 0).

Used by tests-integration/test_fsdp2_faults.py (and the DeepSpeed cases of
test_deepspeed_launch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import accel.checkpoint_writing as checkpointing
from accel import Accelerator, DataLoaderConfiguration
from accel.utils import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
    set_seed,
)

ROWS = 64
BATCH = 4
SEED = 99


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill: str | None, rank: int) -> tuple[int, Any]:
    """Install the kill point; return (step, a flag holder to switch it on at that save)."""
    armed = {"on": False}
    if kill is None:
        return -1, armed
    match = re.fullmatch(r"(dcp-model|dcp-optimizer|ds-save|manifest|commit):(\d+):(\d+)", kill)
    if match is None:
        raise SystemExit(f"--kill-at {kill!r}: expected <where>:<step>:<rank>")
    where, step, who = match[1], int(match[2]), int(match[3])
    if who != rank:
        return step, armed
    if where == "ds-save":
        from accel.engines.deepspeed_checkpoint import DeepSpeedLayout

        original_layout_save = DeepSpeedLayout.save

        def layout_save(self: Any, *args: Any, **kwargs: Any) -> None:
            original_layout_save(self, *args, **kwargs)
            if armed["on"]:
                die()

        DeepSpeedLayout.save = layout_save  # type: ignore[method-assign]
    elif where.startswith("dcp-"):
        original_save = dcp.save
        calls = {"n": 0}
        target = 1 if where == "dcp-model" else 2

        def save(*args: Any, **kwargs: Any) -> Any:
            result = original_save(*args, **kwargs)
            if armed["on"]:
                calls["n"] += 1
                if calls["n"] == target:
                    die()
            return result

        dcp.save = save
    else:
        name = "_write_manifest" if where == "manifest" else "_commit"
        original = getattr(checkpointing, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            if armed["on"] and name == "_write_manifest":
                die()
            result = original(*args, **kwargs)
            if armed["on"]:
                die()
            return result

        setattr(checkpointing, name, patched)
    return step, armed


def engine_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The Accelerator's engine plugin for ``--engine``."""
    if args.engine == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", state_dict_type=args.state_dict_type
        )
        return {"fsdp_plugin": plugin}
    stage = int(args.engine[-1])
    return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--engine", choices=["fsdp2", "zero2", "zero3"], default="fsdp2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    set_seed(SEED)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
        ),
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **engine_arguments(args),
    )
    rank = accelerator.process_index
    data = torch.Generator().manual_seed(SEED)
    features = torch.randn(ROWS, 6, generator=data)
    targets = features.sum(dim=1, keepdim=True) + 0.1 * torch.randn(ROWS, 1, generator=data)
    loader = DataLoader(TensorDataset(features, targets), batch_size=BATCH, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    loaded = None
    if args.resume:
        base = Path(args.project_dir) / "checkpoints"
        if any(re.fullmatch(r"checkpoint_\d+", p.name) for p in base.glob("checkpoint_*")):
            loaded = os.path.basename(accelerator.load_state())
    start = counter.n
    kill_step, armed = arm(args.kill_at, rank)
    stop = args.stop_at if args.stop_at is not None else args.total_steps
    saves = []
    while counter.n < stop:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.n += 1
            if counter.n % args.save_every == 0:
                armed["on"] = counter.n == kill_step
                saves.append(os.path.basename(accelerator.save_state()))
                armed["on"] = False
            if counter.n >= stop:
                break
    weights = accelerator.get_state_dict(model)  # a collective: full weights on rank 0
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, args.out)
        report = {"event": "end", "loaded": loaded, "start": start, "saves": saves}
        print(json.dumps({**report, "end": counter.n}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
