"""Run by test_xla.py in one process on the fake torch_xla: state, refusals, bf16, prepare.

Prints one JSON object: each check's name to what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

results: dict[str, Any] = {}

import accel  # noqa: E402
from accel import Accelerator  # noqa: E402
from accel.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accel_data import prepare_data_loader  # noqa: E402
from accel_state import AcceleratorState, GradientState, PartialState  # noqa: E402

results["torch_xla_imported_by_import_accel"] = "torch_xla" in sys.modules
results["accel_file"] = accel.__file__ is not None


def reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def error_of(function: Any) -> str | None:
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


# The state without any switch: XLA.
state = PartialState()
results["state"] = [str(state.distributed_type), state.backend, str(state.device)]
results["topology_source"] = state.topology.source
reset()

# USE_TORCH_XLA=false and ACCEL_USE_CPU=true keep it off.
for name, value in (("USE_TORCH_XLA", "false"), ("ACCEL_USE_CPU", "true")):
    os.environ[name] = value
    results[f"{name}={value}"] = str(PartialState().distributed_type)
    del os.environ[name]
    reset()

# bf16 sets torch_xla's variables; ACCEL_DOWNCAST_BF16 chooses the downcast.
Accelerator(mixed_precision="bf16")
results["bf16"] = [os.environ.get("XLA_USE_BF16"), os.environ.get("XLA_DOWNCAST_BF16")]
reset()
os.environ["ACCEL_DOWNCAST_BF16"] = "true"
accelerator = Accelerator(mixed_precision="bf16")
results["bf16_downcast"] = [
    os.environ.get("XLA_USE_BF16"),
    os.environ.get("XLA_DOWNCAST_BF16"),
    accelerator.state.downcast_bfloat,
]
reset()
results["downcast_without_bf16"] = error_of(lambda: Accelerator(mixed_precision="no"))
del os.environ["ACCEL_DOWNCAST_BF16"]
reset()

# An engine that shards the model is refused on XLA, before any state exists.
results["fsdp_on_xla"] = error_of(lambda: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()))
results["state_after_refusal"] = PartialState._shared_state == {}
reset()

# A model and an optimizer on different devices are refused.
accelerator = Accelerator()
on_meta = torch.nn.Linear(2, 2, device="meta")
results["devices_differ"] = error_of(
    lambda: accelerator.prepare(on_meta, torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
)

# Moving to the XLA device replaces parameters: the optimizer built before is re-pointed.
torch.__future__.set_overwrite_module_params_on_conversion(True)
model = torch.nn.Linear(3, 1)
old_weight = model.weight
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model, optimizer = accelerator.prepare(model, optimizer)
torch.__future__.set_overwrite_module_params_on_conversion(False)
results["parameters_replaced"] = model.weight is not old_weight
results["optimizer_repointed"] = optimizer.param_groups[0]["params"][0] is model.weight
before = model.weight.detach().clone()
model(torch.ones(2, 3)).sum().backward()
optimizer.step()
results["moved_model_trains"] = not torch.equal(before, model.weight.detach())

# Loaders: wrapped for the preloader; dispatching is refused.
loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
results["loader"] = type(accelerator.prepare(loader)).__name__
results["dispatch"] = error_of(lambda: prepare_data_loader(loader, dispatch_batches=True))
skipped = accelerator.skip_first_batches(accelerator.prepare(loader), 2)
results["skip_first_batches"] = [type(skipped).__name__, [b[0].tolist() for b in skipped]]

# save_state: the XLA seed is saved and restored.
with tempfile.TemporaryDirectory() as folder:
    accelerator.save_state(os.path.join(folder, "c"))
    saved = torch.load(os.path.join(folder, "c", "random_states_0.pkl"), weights_only=False)
    results["xm_seed_saved"] = saved.get("xm_seed")
    accelerator.load_state(os.path.join(folder, "c"))

print(json.dumps(results))
