"""Trained by test_xla.py with ``accel launch --tpu --main_training_function train`` on the fake
torch_xla's processes: 2 epochs, accumulation 2, clipping, a mid-epoch checkpoint that is
restored at the end and trained again. Writes ``result_<rank>.json`` into ``sys.argv[1]``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.utils import broadcast, broadcast_object_list, gather_object

#: 11 batches per rank and epoch: more than the preloader's 8 ahead, and an odd number, so that
#: each epoch ends on a window of one micro-batch (end_of_dataloader forces its step).
NUM_SAMPLES = 88
PER_RANK_BATCH = 4
EPOCHS = 2
SAVE_AT = (1, 2)  # (epoch, batches consumed): save_state there
#: Each rank's two micro-batches of the num_items window (uneven on purpose).
NUM_ITEMS_BATCHES = ([[0, 1], [2, 3, 4]], [[5], [6, 7, 8, 9]])


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_SAMPLES, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


def fake_log(event: str) -> None:
    import torch_xla._fake as fake

    fake.record(event)


@dataclass
class Trace:
    """What each rank's loop saw, batch by batch."""

    seen: list[list[int]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    syncs: list[bool] = field(default_factory=list)
    #: Whether GradientState's active loader was the one the loop iterates (not the shard
    #: the preloader thread iterates).
    active: list[bool] = field(default_factory=list)


def train_step(accelerator, model, optimizer, loader, batch, trace: Trace) -> None:
    x, y, index = batch
    with accelerator.accumulate(model):
        trace.syncs.append(accelerator.sync_gradients)
        trace.active.append(accelerator.gradient_state.active_dataloader is loader)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            trace.norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    trace.seen.append([int(i) for i in index])


def train() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(data(), batch_size=PER_RANK_BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    trace = Trace()
    checkpoint = out / "checkpoint"
    for epoch in range(EPOCHS):
        for batch in loader:
            train_step(accelerator, model, optimizer, loader, batch, trace)
            if (epoch, len(trace.seen) - epoch * len(loader)) == SAVE_AT:
                fake_log("before_save_state")
                accelerator.save_state(str(checkpoint))
                fake_log("after_save_state")
    final = {k: v.tolist() for k, v in accelerator.get_state_dict(model).items()}
    # Back to the checkpoint: the rest of epoch 1 again, from where the loop (not the
    # preloader, which ran ahead) stood.
    accelerator.load_state(str(checkpoint))
    again = Trace()
    for batch in loader:
        train_step(accelerator, model, optimizer, loader, batch, again)
    resumed = {k: v.tolist() for k, v in accelerator.get_state_dict(model).items()}
    evaluation = DataLoader(data(), batch_size=5)  # 88 = 2 ranks x 9 batches, padded
    evaluation = accelerator.prepare(evaluation)
    ids = []
    for _, _, index in evaluation:
        ids.extend(accelerator.gather_for_metrics(index).tolist())
    objects = gather_object([accelerator.process_index])
    rank = accelerator.process_index
    torch.manual_seed(2)
    probe = nn.Linear(4, 1)
    probe, probe_optimizer = accelerator.prepare(probe, torch.optim.SGD(probe.parameters(), lr=0.0))
    x_all, y_all, _ = data().tensors
    for index in NUM_ITEMS_BATCHES[rank]:
        with accelerator.accumulate(probe):
            loss = ((probe(x_all[index]) - y_all[index]) ** 2).sum()
            accelerator.backward(loss, num_items=len(index))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(probe.parameters(), 1e9)  # averages first
                num_items_grads = {n: p.grad.tolist() for n, p in probe.named_parameters()}
            probe_optimizer.step()
            probe_optimizer.zero_grad()
    collectives = {
        "sum": accelerator.reduce(torch.tensor([rank + 1.0]), "sum").tolist(),
        "mean": accelerator.reduce(torch.tensor([rank + 1.0]), "mean").tolist(),
        "max": accelerator.reduce(torch.tensor([rank + 1.0]), "max").tolist(),
        "broadcast": broadcast(torch.tensor([rank * 10.0]), from_process=1).tolist(),
        "objects": broadcast_object_list([f"rank {rank}"], from_process=1),
        "padded": list(accelerator.pad_across_processes(torch.ones(rank + 1)).shape),
    }
    result = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "loader": type(loader).__name__,
        "batches_per_epoch": len(loader),
        "seen": trace.seen,
        "norms": trace.norms,
        "syncs": trace.syncs,
        "active": trace.active,
        "final": final,
        "again": again.seen,
        "again_syncs": again.syncs,
        "resumed": resumed,
        "metric_ids": ids,
        "objects": objects,
        "collectives": collectives,
        "num_items_grads": num_items_grads,
        "probe": {n: p.tolist() for n, p in probe.named_parameters()},
        "checkpoint_files": sorted(p.name for p in checkpoint.iterdir()),
    }
    accelerator.wait_for_everyone()
    (out / f"result_{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    print("xla_train.py is started by accel launch --tpu, not run directly")
