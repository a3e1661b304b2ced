"""A script for ``accel launch`` tests: report the process group, or fail on purpose.

launch_probe.py report                # rank, world size, distributed type, restart count
launch_probe.py exit <rank> <code>    # that rank exits with the code, the others wait
launch_probe.py kill <rank>           # that rank SIGKILLs itself, the others wait
launch_probe.py sleep                 # every rank sleeps (for signals to the launcher)
launch_probe.py crash-once <marker>   # rank 1 crashes on the first attempt only
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from accel_state import PartialState


def main() -> int:
    """Do what the first argument says."""
    action = sys.argv[1]
    state = PartialState()
    rank = state.process_index
    if action == "report":
        print(
            "PROBE "
            + json.dumps(
                {
                    "rank": rank,
                    "world": state.num_processes,
                    "type": str(state.distributed_type),
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
        if rank == 1 and not marker.exists():
            marker.write_text("crashed")
            return 5
        print(
            "PROBE "
            + json.dumps({"rank": rank, "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")}),
            flush=True,
        )
        state.wait_for_everyone()
        return 0
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    sys.exit(main())
