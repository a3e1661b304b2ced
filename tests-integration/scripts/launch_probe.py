"""A script for ``accel launch`` tests: report the process group, or fail on purpose.

launch_probe.py report                # rank, world size, distributed type, restart count
launch_probe.py exit <rank> <code>    # that rank exits with the code, the others wait
launch_probe.py kill <rank>           # that rank SIGKILLs itself, the others wait
launch_probe.py sleep                 # every rank sleeps (for signals to the launcher)
launch_probe.py crash-once <marker>   # rank 1 crashes on the first attempt only, after a
                                      # collective; on later attempts rank 0 starts last (it
                                      # waits for rank 1's <marker>.attempt<N> file), so rank 1
                                      # would read the first attempt's stale addresses from
                                      # torchrun's store if nothing kept attempts apart
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from accel_state import PartialState, reduce


def rank_one_started(marker: Path, attempt: int, rank: str | None, timeout: float = 60.0) -> None:
    """Rank 1 says it is about to join the group; rank 0 waits for that before it joins."""
    started = marker.with_name(f"{marker.name}.attempt{attempt}")
    if rank == "1":
        started.write_text("rank 1 is joining the group")
        return
    deadline = time.monotonic() + timeout
    while not started.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank 1 did not write {started} within {timeout:.0f} s")
        time.sleep(0.05)


def main() -> int:
    """Do what the first argument says."""
    action = sys.argv[1]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if action == "crash-once" and attempt > 0:
        # Rank 1 reaches the store first and must not take old keys for new.
        rank_one_started(Path(sys.argv[2]), attempt, os.environ.get("RANK"))
    state = PartialState()
    rank = state.process_index
    if action == "report":
        print(
            "PROBE "
            + json.dumps(
                {
                    "rank": rank,
                    "world": state.num_processes,
                    "type": state.distributed_type.value,
                    "pid": os.getpid(),
                    "mixed_precision": os.environ.get("ACCEL_MIXED_PRECISION"),
                    "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                }
            ),
            flush=True,
        )
        state.wait_for_everyone()
        return 0
    if action == "exit":
        if rank == int(sys.argv[2]):
            return int(sys.argv[3])
        time.sleep(120)
        return 0
    if action == "kill":
        if rank == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
        return 0
    if action == "sleep":
        print(f"PROBE sleeping {os.getpid()}", flush=True)
        time.sleep(120)
        return 0
    if action == "crash-once":
        marker = Path(sys.argv[2])
        total = reduce(torch.tensor([float(rank + 1)]), reduction="sum")
        if rank == 1 and not marker.exists():
            marker.write_text("crashed")
            return 5
        print(
            "PROBE " + json.dumps({"rank": rank, "restarts": attempt, "sum": float(total.item())}),
            flush=True,
        )
        state.wait_for_everyone()
        return 0
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    sys.exit(main())
