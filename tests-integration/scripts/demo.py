"""accel's main demo: what the installed packages can do, on 2 CPU processes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests-integration/scripts/demo.py
    (or: python3 tools/dev.py demo, which installs everything first)

It shows the two lower layers at work: the two processes join a gloo group from torchrun's
variables, agree on a random seed, split a list of work items between themselves, compute on
their share, and combine the results with gather / reduce / gather_object; then they read a
shuffled 99-sample dataset through a prepared, sharded DataLoader and gather the results so
that every sample is counted exactly once. The main job (`python3 tools/dev.py demo`) then
runs the real 2-process training run, tools/examples/train.py; the big-model offload run
joins it when accel-bigmodel lands.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel_data import prepare_data_loader
from accel_state import (
    PartialState,
    gather,
    gather_object,
    get_logger,
    reduce,
    set_seed,
    synchronize_rng_state,
)

logger = get_logger("accel.demo", log_level="INFO")


def main() -> int:
    state = PartialState()
    if state.num_processes < 2:
        print("demo: run me under torchrun with --nproc_per_node 2 (python3 tools/dev.py demo)")
        return 2
    logger.info(
        f"joined a {state.distributed_type.value} group of {state.num_processes} ({state.backend})"
    )

    set_seed(1234 + state.process_index)  # deliberately different seeds ...
    synchronize_rng_state("torch")  # ... then every rank takes rank 0's generator state
    weights = torch.randn(8)
    same = gather(weights[None]).unique(dim=0).shape[0] == 1
    logger.info(f"random state synchronised across ranks: {same}")

    items = list(range(1, 11))
    with state.split_between_processes(items) as mine:
        logger.info(f"my share of the work: {mine}", main_process_only=False, in_order=True)
        partial = torch.tensor([float(sum(x * x for x in mine))])
    total = reduce(partial, reduction="sum").item()
    expected = float(sum(x * x for x in items))
    everyone = gather_object([f"rank {state.process_index} handled {len(mine)} items"])
    logger.info(f"sum of squares = {total:.0f} (expected {expected:.0f}); {everyone}")

    # Sharded loading: each rank reads its own batches; gathering them (and dropping the
    # padding the last round needs) gives back every sample exactly once.
    samples = torch.arange(99, dtype=torch.float32)
    loader = prepare_data_loader(
        DataLoader(TensorDataset(samples), batch_size=16, shuffle=True),
        rng_types=["generator"],
    )
    seen = []
    for (batch,) in loader:
        gathered = gather(batch)
        if loader.end_of_dataloader and loader.remainder > 0:
            gathered = gathered[: loader.remainder]
        seen.append(gathered)
    seen_all = torch.cat(seen)
    once = bool(torch.equal(seen_all.sort().values, samples))
    logger.info(
        f"sharded loader: {len(loader)} batches per rank, {seen_all.numel()} samples gathered, "
        f"each of the 99 exactly once: {once}"
    )
    state.wait_for_everyone()
    ok = same and total == expected and once
    if state.is_main_process:
        print(f"demo: {'OK' if ok else 'FAILED'}", flush=True)
    state.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    logger.logger.addHandler(__import__("logging").StreamHandler(sys.stdout))
    sys.exit(main())
