"""Measurement helpers shared by the big-model benchmarks (bigmodel.py, offload.py).

Each benchmark imports this module from its own folder, in accel's interpreter and in the
Accelerate 1.15 side venv alike (the workers run the benchmark script by path, so this folder
is on ``sys.path``). Standard library and torch only.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

INDEX = "model.safetensors.index.json"
SAMPLE_SECONDS = 0.005


def proc_status_kb(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB (empty where there is no /proc)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in fields:
                    values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values


class AnonSampler:
    """Samples RssAnon (the process's own memory, no mapped files) in a background thread."""

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak_kb = max(self.peak_kb, proc_status_kb("RssAnon").get("RssAnon", 0))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                return

    @contextmanager
    def running(self) -> Iterator[AnonSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self._sample()


def shard_files(checkpoint: Path) -> list[Path]:
    """The shard files a checkpoint folder's index names, in order, each once."""
    index = json.loads((checkpoint / INDEX).read_text(encoding="utf-8"))
    return [checkpoint / name for name in dict.fromkeys(index["weight_map"].values())]


def timed(call: Callable[[], Any]) -> float:
    """Seconds one call takes, garbage collection done before and paused during it."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    finally:
        gc.enable()


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One inference-mode forward."""
    with torch.inference_mode():
        return model(ids)


def folder_bytes(folder: Path) -> tuple[int, int]:
    """(bytes, files) under ``folder``; (0, 0) if it does not exist."""
    total = count = 0
    if folder.exists():
        for path in folder.rglob("*"):
            if path.is_file():
                total += path.stat().st_size
                count += 1
    return total, count


def median(values: list[float]) -> float:
    """The median of ``values``."""
    return statistics.median(values)
