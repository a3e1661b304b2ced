"""A DeepSpeed checkpoint written by one library loads in the other (accel <-> Accelerate 1.15).

    python -m torch.distributed.run --standalone --nproc_per_node 2 deepspeed_compat.py \
        --lib accel|accelerate --stage 2|3 --mode save|load --dir DIR

Two CPU ranks (gloo), a small MLP under ZeRO-2 or ZeRO-3 with gradient clipping at 1.0 and
AdamW. ``save`` trains 2 steps, calls ``save_state(DIR)``, writes the full weights to
``DIR.saved.json``, trains a third step on a fixed batch and writes the weights to
``DIR.next.json``. ``load`` builds the model from another seed, calls ``load_state(DIR)``,
checks the weights against ``DIR.saved.json``, trains the same third step and checks
``DIR.next.json`` (the optimizer's partitions were restored too), then prints ``compat: OK``.

Accelerate 1.15 runs DeepSpeed on CPU with ``InitProcessGroupKwargs(backend="gloo")`` and no
``ACCELERATE_USE_CPU`` (engines.md §8). The script imports only the library named by
``--lib``, so it runs in either virtualenv.
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


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)


def accelerator_for(lib: str, stage: int) -> Any:
    top = importlib.import_module(lib)
    utils = importlib.import_module(f"{lib}.utils")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # Accelerate's get_state_dict under ZeRO-3 needs the gather
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    plugin = utils.DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
    handlers = [utils.InitProcessGroupKwargs(backend="gloo")] if lib == "accelerate" else []
    return top.Accelerator(deepspeed_plugin=plugin, kwargs_handlers=handlers)


def full_weights(accelerator: Any, model: Any) -> dict[str, list[float]]:
    state = accelerator.get_state_dict(model) or {}  # a collective; None off rank 0 (ZeRO-3)
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
    parser.add_argument("--stage", type=int, choices=[2, 3], required=True)
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    directory = Path(args.dir)
    accelerator = accelerator_for(args.lib, args.stage)
    torch.manual_seed(0 if args.mode == "save" else 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
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
        return finish(accelerator, args.lib, 0)
    accelerator.load_state(str(directory))
    loaded = full_weights(accelerator, model)
    step(accelerator, model, optimizer, 2)
    after = full_weights(accelerator, model)
    code = 0
    if main_process:
        if not close(loaded, json.loads(saved_file.read_text())):
            print("compat: the loaded weights differ from the saved ones")
            code = 1
        elif not close(after, json.loads(next_file.read_text())):
            print("compat: the step after loading differs (optimizer state not restored?)")
            code = 1
        else:
            print(f"compat: OK (loaded with {args.lib})")
    return finish(accelerator, args.lib, code)


def finish(accelerator: Any, lib: str, code: int) -> int:
    """Leave the process group (Accelerate's processes then leave at once: reference_exit)."""
    accelerator.end_training()
    return leave(lib, code)


if __name__ == "__main__":
    sys.exit(main())
