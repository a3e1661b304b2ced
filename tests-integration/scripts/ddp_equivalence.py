"""Under torchrun: 2 processes with batch b train to the same weights as 1 process with 2b.

Each rank records the sample ids of its batches; the ranks gather them, and every rank replays
the global batches (rank 0's rows then rank 1's) in a plain single-process PyTorch loop. The
script prints (from rank 0) one JSON line per rank with the largest weight difference per
mode.
"""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration
from accel_state import AcceleratorState, GradientState, gather_object


def run(config: DataLoaderConfiguration, accumulation: int) -> float:
    """Largest |w_ddp - w_reference| after 2 epochs in one configuration."""
    accelerator = Accelerator(dataloader_config=config, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    features = torch.randn(64, 4)
    targets = features @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    ids = torch.arange(64)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    batch = 8 if config.split_batches else 4
    loader = DataLoader(TensorDataset(ids), batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05), loader
    )
    seen: list[list[int]] = []
    for _ in range(2):
        for (batch_ids,) in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(features[batch_ids]), targets[batch_ids])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen.append(accelerator.gather(batch_ids).tolist())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for start in range(0, len(seen), accumulation):
        window = seen[start : start + accumulation]
        for global_ids in window:
            index = torch.tensor(global_ids)
            loss = torch.nn.functional.mse_loss(reference(features[index]), targets[index])
            (loss / accumulation).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(trained.parameters(), reference.parameters(), strict=True)
    )
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return difference


def main() -> None:
    """Run every mode and print this rank's differences."""
    results = {
        "shard": run(DataLoaderConfiguration(use_seedable_sampler=True), 1),
        "split": run(DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True), 1),
        "dispatch": run(DataLoaderConfiguration(dispatch_batches=True), 1),
        "shard+accumulation": run(DataLoaderConfiguration(use_seedable_sampler=True), 2),
    }
    state = AcceleratorState(cpu=True)
    # One printer: two ranks writing to the same stdout can interleave their lines.
    every = gather_object([{"rank": state.process_index, **results}])
    if state.is_main_process:
        for line in every:
            print(json.dumps(line), flush=True)
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
