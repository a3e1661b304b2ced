"""``torch_xla.distributed.xla_multiprocessing.spawn``: one process per fake device."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

from torch_xla import _fake


def _child(
    index: int, world: int, store: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ["FAKE_XLA_ORDINAL"] = str(index)
    os.environ["FAKE_XLA_WORLD_SIZE"] = str(world)
    os.environ["FAKE_XLA_STORE"] = store
    fn(index, *args)


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> None:
    """Run ``fn(index, *args)`` in every process; raise if one fails (as torch_xla)."""
    if nprocs not in (None, 1):
        raise ValueError(f"fake torch_xla: nprocs={nprocs!r}; PJRT supports None or 1")
    world = 1 if nprocs == 1 else int(os.environ.get("FAKE_XLA_DEVICES", "1"))
    _fake.record("spawn", nprocs=nprocs, world=world)
    context = multiprocessing.get_context(start_method)
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        processes = [
            context.Process(target=_child, args=(i, world, store, fn, args), daemon=daemon)
            for i in range(world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = [i for i, process in enumerate(processes) if process.exitcode != 0]
        if failed:
            raise RuntimeError(
                f"fake torch_xla: process {failed[0]} exited with {processes[failed[0]].exitcode}"
            )
