"""A tiny training script for the engine-refusal tests: one DDP step, then a weight digest.

engine_train.py                    # Accelerator() as the environment says
engine_train.py fsdp-plugin        # Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
engine_train.py deepspeed-plugin   # Accelerator(deepspeed_plugin=DeepSpeedPlugin())
engine_train.py megatron-plugin    # Accelerator(megatron_lm_plugin=MegatronLMPlugin())

Each rank prints ``TRAINED <rank> <digest> <distributed type>`` after its optimizer step; a
refused engine must stop every rank before that line.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from accel import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accel.utils import MegatronLMPlugin


def main() -> int:
    """Train one step and print the digest of the weights."""
    kwargs = {}
    if sys.argv[1:] == ["fsdp-plugin"]:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    if sys.argv[1:] == ["deepspeed-plugin"]:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=2)
    if sys.argv[1:] == ["megatron-plugin"]:
        kwargs["megatron_lm_plugin"] = MegatronLMPlugin()
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.arange(32.0).reshape(8, 4), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    batch = next(iter(data))
    accelerator.backward(model(batch).pow(2).mean())
    optimizer.step()
    weight = accelerator.unwrap_model(model).weight
    if hasattr(weight, "full_tensor"):  # an FSDP2 shard: gather the full weight (collective)
        weight = weight.full_tensor()
    weights = weight.detach().tolist()
    digest = hashlib.sha256(repr(weights).encode()).hexdigest()[:16]
    kind = accelerator.distributed_type.value
    # One write, so that the two ranks' reports do not interleave on the shared stdout.
    sys.stdout.write(f"TRAINED {accelerator.process_index} {digest} {kind}\n")
    sys.stdout.flush()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
