"""An FSDP2 checkpoint written by one library loads in the other (accel <-> Accelerate 1.15).

    python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_compat.py \
        --lib accel|accelerate --mode save|load --dir DIR

Two CPU ranks, a small model of blocks sharded by FSDP2 (``TRANSFORMER_BASED_WRAP``, the
default ``SHARDED_STATE_DICT``), AdamW. ``save`` trains 2 steps, calls ``save_state(DIR)``,
writes the full weights to ``DIR.saved.json``, trains a third step on a fixed batch and writes
the weights to ``DIR.next.json``. ``load`` builds the model from another seed, calls
``load_state(DIR)``, checks the weights against ``DIR.saved.json``, trains the same third step
and checks ``DIR.next.json`` (the optimizer's moments were restored too), then prints
``compat: OK``.

Accelerate 1.15 drops an FSDP plugin on a CPU run; its own FSDP2 code runs when the state is
forced to FSDP after construction, as its test suite does (engines.md §8). The script imports
only the library named by ``--lib``, so it runs in either virtualenv.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from reference_exit import leave


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)


def accelerator_for(lib: str) -> Any:
    top = importlib.import_module(lib)
    utils = importlib.import_module(f"{lib}.utils")
    plugin = utils.FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP"
    )
    if lib == "accel":
        return top.Accelerator(fsdp_plugin=plugin)
    accelerator = top.Accelerator(fsdp_plugin=plugin)  # plugin dropped on CPU: force it
    state_module = importlib.import_module("accelerate.state")
    accelerator.state.distributed_type = utils.DistributedType.FSDP
    state_module.PartialState._shared_state["distributed_type"] = utils.DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def full_weights(accelerator: Any, model: Any) -> dict[str, list[float]]:
    state = accelerator.get_state_dict(model)
    return {k: v.float().flatten().tolist() for k, v in state.items()}


def step(accelerator: Any, model: Any, optimizer: Any, number: int) -> None:
    x, y = batch(number, accelerator.process_index)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def close(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    return sorted(a) == sorted(b) and all(
        abs(x - y) <= 1e-6 for key in a for x, y in zip(a[key], b[key], strict=True)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=["accel", "accelerate"], required=True)
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    return leave(args.lib, run(args))


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    accelerator = accelerator_for(args.lib)
    torch.manual_seed(0 if args.mode == "save" else 1)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    main_process = accelerator.is_main_process
    saved_file = directory.with_name(directory.name + ".saved.json")
    next_file = directory.with_name(directory.name + ".next.json")
    if args.mode == "save":
        for number in range(2):
            step(accelerator, model, optimizer, number)
        accelerator.save_state(str(directory))
        accelerator.wait_for_everyone()
        saved = full_weights(accelerator, model)
        step(accelerator, model, optimizer, 2)
        after = full_weights(accelerator, model)
        if main_process:
            saved_file.write_text(json.dumps(saved))
            next_file.write_text(json.dumps(after))
            print(f"compat: saved with {args.lib}")
        return 0
    accelerator.load_state(str(directory))
    loaded = full_weights(accelerator, model)
    step(accelerator, model, optimizer, 2)
    after = full_weights(accelerator, model)
    if main_process:
        if not close(loaded, json.loads(saved_file.read_text())):
            print("compat: the loaded weights differ from the saved ones")
            return 1
        if not close(after, json.loads(next_file.read_text())):
            print("compat: the step after loading differs (optimizer state not restored?)")
            return 1
        print(f"compat: OK (loaded with {args.lib})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
