"""A real training run with accel's Accelerator, on built-in data.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tools/examples/train.py
    python tools/examples/train.py --mixed-precision bf16 --gradient-accumulation-steps 2

The loop is plain PyTorch; the five lines marked ``# accel`` are all it takes to run it on one
device, on several processes (DDP over gloo on CPU, NCCL on GPUs), with mixed precision and
gradient accumulation. The data is a fixed synthetic classification task (two interleaved
spirals, 2 048 points), so the run needs no download. The script evaluates with
``gather_for_metrics`` (every validation sample counted exactly once), prints one line per
epoch, and exits with status 1 if the validation loss misses ``--target-loss``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration
from accel_state import set_seed


def spirals(n: int, seed: int) -> TensorDataset:
    """Two interleaved spirals with a little noise: ``n`` points, labels 0/1."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=generator) * 3 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=generator)
    sign = label.float() * 2 - 1
    points = torch.stack([t * torch.cos(t) * sign, t * torch.sin(t) * sign], dim=1) / 5
    points += 0.05 * torch.randn(n, 2, generator=generator)
    return TensorDataset(points, label)


def build_model() -> torch.nn.Module:
    """A small MLP for 2-d inputs and 2 classes."""
    return torch.nn.Sequential(
        torch.nn.Linear(2, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 2),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--mixed-precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--target-loss", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, and report whether the target validation loss was reached."""
    args = parse_args(argv)
    accelerator = Accelerator(  # accel
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    train = DataLoader(spirals(2048, seed=1), batch_size=args.batch_size, shuffle=True)
    valid = DataLoader(spirals(500, seed=2), batch_size=64)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Sized in single-process optimizer steps: the prepared scheduler advances once per
    # process for every step, so the schedule ends with the data on any number of processes.
    steps = args.epochs * math.ceil(len(train) / args.gradient_accumulation_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr * 3, total_steps=steps
    )
    model, optimizer, train, valid, scheduler = accelerator.prepare(  # accel
        model, optimizer, train, valid, scheduler
    )
    accelerator.print(
        f"training on {accelerator.num_processes} process(es), "
        f"{accelerator.distributed_type.value}, device {accelerator.device}; "
        f"{accelerator.policy.describe(optimizer)}"
    )
    start = time.perf_counter()
    valid_loss = float("inf")
    for epoch in range(args.epochs):
        model.train()
        for points, labels in train:
            with accelerator.accumulate(model):  # accel
                loss = torch.nn.functional.cross_entropy(model(points), labels)
                accelerator.backward(loss)  # accel
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        losses, hits = [], []
        with torch.no_grad():
            for points, labels in valid:
                logits = model(points)
                logits, labels = accelerator.gather_for_metrics((logits, labels))  # accel
                losses.append(torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
                hits.append(logits.argmax(dim=1) == labels)
        all_losses = torch.cat(losses)
        valid_loss = all_losses.mean().item()
        accuracy = torch.cat(hits).float().mean().item()
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            accelerator.print(
                f"epoch {epoch + 1:3d}: validation loss {valid_loss:.4f}, accuracy "
                f"{accuracy:.3f} on {all_losses.numel()} samples"
            )
    elapsed = time.perf_counter() - start
    reached = valid_loss <= args.target_loss
    accelerator.print(
        f"done in {elapsed:.1f}s: validation loss {valid_loss:.4f} "
        f"({'reached' if reached else 'MISSED'} target {args.target_loss})"
    )
    accelerator.end_training()
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
