"""Worker for tools/bench/collectives.py: times gather on one rank of a 2-process gloo run.

Started by torchrun (python -m torch.distributed.run --standalone --nproc_per_node 2
tools/bench/_gather_worker.py --impl accel|accelerate). Raw calls (all_gather + cat) and calls
of the library's gather are timed in alternating blocks, so drift on a shared machine hits
both alike. Rank 0 prints one JSON line with the median microseconds of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["accel", "accelerate"], required=True)
    parser.add_argument("--numel", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=100)
    args = parser.parse_args()

    if args.impl == "accel":
        from accel_state import PartialState, gather

        state = PartialState()
    else:
        from accelerate import PartialState
        from accelerate.utils import gather

        state = PartialState(cpu=True)
    assert state.num_processes == 2, f"{args.impl} did not join the 2-process group: {state}"
    world = dist.get_world_size()
    tensor = torch.rand(args.numel)

    def raw() -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor)
        return torch.cat(out)

    def library() -> torch.Tensor:
        return gather(tensor)  # type: ignore[no-any-return]

    assert torch.equal(raw(), library())
    samples: dict[str, list[float]] = {"raw": [], "library": []}
    for _ in range(args.block * 2):
        raw()
        library()
    for round_index in range(args.rounds):
        order = [("raw", raw), ("library", library)]
        if round_index % 2:
            order.reverse()
        for name, fn in order:
            for _ in range(args.block):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    if state.process_index == 0:
        raw_us = statistics.median(samples["raw"]) * 1e6
        lib_us = statistics.median(samples["library"]) * 1e6
        print(json.dumps({"impl": args.impl, "raw_us": raw_us, "library_us": lib_us}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
