"""Record the batches a prepared loader yields over three epochs, for accel or Accelerate.

Usage: ``python data_order.py --lib accel|accelerate --out DIR`` (under torchrun for several
processes); each rank writes ``DIR/<rank>.json``: for every combination of
``use_seedable_sampler`` and a user generator, the batches of epochs 0, 1 and 2 after
``set_seed(0)``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch
from reference_exit import leave
from torch.utils.data import DataLoader


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=["accel", "accelerate"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    library = importlib.import_module(args.lib)
    utils = importlib.import_module(f"{args.lib}.utils")
    state = importlib.import_module(f"{args.lib}.state")
    orders = {}
    for seedable in (True, False):
        for own_generator in (False, True):
            utils.set_seed(0)
            config = utils.DataLoaderConfiguration(use_seedable_sampler=seedable)
            accelerator = library.Accelerator(dataloader_config=config)
            generator = torch.Generator().manual_seed(5) if own_generator else None
            loader = accelerator.prepare(
                DataLoader(list(range(20)), batch_size=4, shuffle=True, generator=generator)
            )
            epochs = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                epochs.append([batch.tolist() for batch in loader])
            orders[f"use_seedable_sampler={seedable}, generator={own_generator}"] = epochs
            state.AcceleratorState._reset_state(reset_partial_state=False)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    (args.out / f"{rank}.json").write_text(json.dumps(orders))
    return leave(args.lib, 0)


if __name__ == "__main__":
    sys.exit(main())
