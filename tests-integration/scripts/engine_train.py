"""A tiny training script for the engine-refusal tests: one DDP step, then a weight digest.

engine_train.py                    # Accelerator() as the environment says
engine_train.py fsdp-plugin        # Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
engine_train.py deepspeed-plugin   # Accelerator(deepspeed_plugin=DeepSpeedPlugin())
engine_train.py megatron-plugin    # Accelerator(megatron_lm_plugin=MegatronLMPlugin())

Each rank prints ``TRAINED <rank> <digest> <distributed type>`` after its optimizer step; a
refused engine must stop every rank before that line. At exit, after accel's own exit handler,
each rank prints ``EXIT-THREADS <rank> <its gloo threads, comma-separated>``: none may be left
for interpreter finalization (where they can abort a finished run).

With ``ENGINE_TRAIN_HOLD_SIGTERM=1`` a rank blocks SIGTERM until ``Accelerator()`` has returned
or raised: torchrun stops the other workers as soon as one fails, and the refusal tests need
each rank's own refusal, not the first one's.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import sys
from pathlib import Path

# Held from the first line on: torchrun may stop this rank while it is still importing torch.
HOLD_SIGTERM = os.environ.get("ENGINE_TRAIN_HOLD_SIGTERM") == "1"
if HOLD_SIGTERM:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import torch  # noqa: E402

from accel import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin  # noqa: E402
from accel.utils import MegatronLMPlugin  # noqa: E402


def _report_gloo_threads_at_exit() -> None:
    # Registered before accel's handler (the Accelerator does not exist yet), so it runs after
    # it: atexit calls handlers last-in, first-out.
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    names = sorted((task / "comm").read_text().strip() for task in tasks.iterdir())
    gloo = ",".join(name for name in names if "gloo" in name)
    sys.stdout.write(f"EXIT-THREADS {os.environ.get('RANK', '0')} {gloo or '-'}\n")
    sys.stdout.flush()


def _accelerator_holding_sigterm(kwargs: dict[str, object]) -> Accelerator:
    try:
        accelerator = Accelerator(**kwargs)
    except Exception as error:  # noqa: BLE001 - reported as the refusal
        # Report, then leave at once: a pending SIGTERM ends the process as soon as it is
        # unblocked, so the refusal is written while the signal is still held.
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        sys.stderr.flush()
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return accelerator


def main() -> int:
    """Train one step and print the digest of the weights."""
    atexit.register(_report_gloo_threads_at_exit)
    kwargs = {}
    if sys.argv[1:] == ["fsdp-plugin"]:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    if sys.argv[1:] == ["deepspeed-plugin"]:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=2)
    if sys.argv[1:] == ["megatron-plugin"]:
        kwargs["megatron_lm_plugin"] = MegatronLMPlugin()
    if HOLD_SIGTERM:
        accelerator = _accelerator_holding_sigterm(kwargs)
    else:
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
