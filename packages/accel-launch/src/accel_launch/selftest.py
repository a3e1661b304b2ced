"""The script ``accel test`` runs through the launcher: a real multi-process self-check.

Each process joins the group the launcher set up, then checks that the collectives agree:
``gather`` of every rank, ``reduce`` of a sum, ``broadcast_object_list`` from rank 0, and a
barrier. Then it runs every check registered under the ``accel.selfchecks`` entry-point group
(a callable returning lines to print): the ``accel`` package registers its training checks
there (DDP against one process, accumulation, bf16/fp16), which accel-launch cannot import
itself. Any failure raises, so the launcher reports the failing rank.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import torch

from accel_state import PartialState, broadcast_object_list, gather, reduce


def main() -> None:
    """Run the checks; print one line on the main process."""
    state = PartialState()
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != expected:
        raise RuntimeError(
            f"rank {state.process_index}: PartialState sees {state.num_processes} processes, "
            f"the launcher started {expected}"
        )
    ranks = gather(torch.tensor([state.process_index], device=state.device))
    if ranks.tolist() != list(range(state.num_processes)):
        raise RuntimeError(f"gather returned {ranks.tolist()}")
    total = reduce(torch.tensor(float(state.process_index + 1), device=state.device), "sum")
    if int(total.item()) != state.num_processes * (state.num_processes + 1) // 2:
        raise RuntimeError(f"reduce returned {total.item()}")
    message = ["hello from rank 0" if state.is_main_process else None]
    broadcast_object_list(message)
    if message[0] != "hello from rank 0":
        raise RuntimeError(f"broadcast_object_list returned {message}")
    state.wait_for_everyone()
    if state.is_main_process:
        print(
            f"accel test: {state.num_processes} process(es), {state.distributed_type.value}, "
            f"backend {state.backend}: gather, reduce, broadcast and barrier agree"
        )
    checks = sorted(entry_points(group="accel.selfchecks"), key=lambda entry: entry.name)
    if not checks and state.is_main_process:
        print(
            "accel test: the training checks come with the accel package (pip install accel); "
            "only the collectives were checked"
        )
    for entry in checks:
        lines = entry.load()()
        state.wait_for_everyone()
        if state.is_main_process:
            for line in lines:
                print(f"accel test: {line}")


if __name__ == "__main__":
    main()
