"""Save a checkpoint with one library, load it with the other (accel <-> Accelerate 1.15).

    python compat_checkpoint.py --lib accel|accelerate --mode save|load --dir DIR

Single process on CPU: a small MLP, AdamW, StepLR, trained 3 steps, then ``save_state``
(safetensors). ``--mode save`` also writes ``DIR.expected.json`` with the weights, the
optimizer's moments and the scheduler's position; ``--mode load`` builds the same objects
from another seed, calls ``load_state`` and checks them against that file, then prints
``compat: OK``. The script imports only the library named by ``--lib``, so it runs in
either virtualenv.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import torch


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and scheduler, initialised from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """What must survive the round trip, as JSON-friendly lists."""
    state = optimizer.state_dict()
    return {
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "moments": [
            [s["exp_avg"].tolist(), s["exp_avg_sq"].tolist(), float(s["step"])]
            for _, s in sorted(state["state"].items())
        ],
        "scheduler": {"last_epoch": scheduler.state_dict()["last_epoch"]},
        "lr": scheduler.get_last_lr(),
    }


def main() -> int:
    """Save or load with the library named on the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=["accel", "accelerate"], required=True)
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    accelerator = importlib.import_module(args.lib).Accelerator(cpu=True)
    model, optimizer, scheduler = build(seed=0 if args.mode == "save" else 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if args.mode == "save":
        data = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
        for step in range(3):
            loss = model(data[2 * step : 2 * step + 2]).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.save_state(args.dir)
        with open(f"{args.dir}.expected.json", "w") as stream:
            json.dump(snapshot(model, optimizer, scheduler), stream)
        print(f"compat: saved with {args.lib}")
        return 0
    accelerator.load_state(args.dir)
    with open(f"{args.dir}.expected.json") as stream:
        expected = json.load(stream)
    got = json.loads(json.dumps(snapshot(model, optimizer, scheduler)))
    for key in expected:
        if got[key] != expected[key]:
            print(f"compat: MISMATCH in {key}")
            return 1
    print(f"compat: OK (loaded with {args.lib})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
