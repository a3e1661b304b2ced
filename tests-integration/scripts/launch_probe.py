"""A script for ``accel launch`` tests: report the process group, or fail on purpose.

launch_probe.py report                # rank, world size, distributed type, restart count
launch_probe.py exit <rank> <code>    # that rank exits with the code, the others wait
launch_probe.py kill <rank>           # that rank SIGKILLs itself, the others wait
launch_probe.py sleep                 # every rank sleeps (for signals to the launcher)
launch_probe.py crash-once <marker>   # rank 1 crashes on the first attempt only, after a
                                      # collective; on later attempts rank 0 starts only once
                                      # rank 1 waits in torchrun's store (a file handshake), so
                                      # rank 1 would read the first attempt's stale keys if
                                      # nothing kept attempts apart
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from accel_state import PartialState, reduce

# The restart handshake's keys (accel_state.process_group): rank 1 publishes join/1 first.
GENERATION_KEY = "accel/generation"


def rank_one_started(marker: Path, attempt: int, rank: str | None, timeout: float = 60.0) -> None:
    """Order a restarted group: rank 0 joins only once rank 1 is already waiting in the store.

    Rank 1 returns at once (and goes on to join); a thread of its own writes
    ``<marker>.attempt<N>`` when rank 1's join token of this attempt is in the store, that is
    when rank 1 is polling for rank 0's answer with the earlier attempt's answer still there.
    Rank 0 waits for that file.
    """
    started = marker.with_name(f"{marker.name}.attempt{attempt}")
    if rank == "1":
        _announce_when_waiting(started, timeout)
        return
    deadline = time.monotonic() + timeout
    while not started.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank 1 did not write {started} within {timeout:.0f} s")
        time.sleep(0.05)


def _announce_when_waiting(started: Path, timeout: float) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Rank 0 hosts the store, new for every attempt: no earlier keys to be misled by.
        started.write_text("rank 1 is joining the group")
        return
    store, _, _ = next(
        dist.rendezvous("env://", rank=1, world_size=2, timeout=timedelta(seconds=timeout))
    )
    key = f"{GENERATION_KEY}/join/1"
    before = bytes(store.get(key)) if store.check([key]) else None

    def announce() -> None:
        deadline = time.monotonic() + timeout
        while not store.check([key]) or bytes(store.get(key)) == before:
            if time.monotonic() > deadline:
                return  # rank 0 then times out and names the file
            time.sleep(0.01)
        started.write_text("rank 1 is waiting for rank 0 in the store")

    threading.Thread(target=announce, name="probe-announce", daemon=True).start()


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
