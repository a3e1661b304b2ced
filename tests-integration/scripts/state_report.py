"""Write, as one JSON file per rank (OUT_DIR/rank<i>.json), what a bare PartialState() sees.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests-integration/scripts/state_report.py OUT_DIR

Used by tests-integration/test_torchrun.py: under torchrun on a CPU-only machine both ranks
must report MULTI_CPU with 2 processes (Accelerate stays single-process there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from accel_state import PartialState, gather, gather_object


def main() -> None:
    state = PartialState()
    ranks = gather(torch.tensor([state.process_index])).tolist()
    names = gather_object([f"rank{state.process_index}"])
    out = Path(sys.argv[1]) / f"rank{state.process_index}.json"
    out.write_text(
        json.dumps(
            {
                "distributed_type": state.distributed_type.value,
                "num_processes": state.num_processes,
                "process_index": state.process_index,
                "local_process_index": state.local_process_index,
                "backend": state.backend,
                "device": str(state.device),
                "gathered": ranks,
                "names": names,
            }
        )
    )
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
