"""Fuzz: every file of a checkpoint, truncated or garbled at several offsets, then loaded.

A checkpoint taken inside an accumulation window (so it has every kind of file: safetensors
weights and gradients, the optimizer, scheduler, loader, random-state and custom-object
pickles, the manifest), in both serialisations. Each case copies it, damages one file, and
calls ``load_state``, with the manifest and without it (as a checkpoint written by Accelerate
has none, so the readers themselves must notice). Every case must end in a
``CheckpointError`` naming the damaged file, with the run unchanged (weights, optimizer,
scheduler, loader position, registered object, random state, gradients) and nothing
written; or load exactly what the undamaged checkpoint gives (bytes the format does not read:
zip timestamps, a manifest's last newline); or load other values only where the damage lies
inside a tensor's raw bytes (safetensors data, torch's zip data records: neither format can
tell a changed number without a checksum). Found by it: a loader state loaded and saved
again before iterating recorded where an earlier iteration had stopped (fixed in
accel-data).
"""

from __future__ import annotations

import random
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.checkpointing import MANIFEST_NAME, CheckpointError
from accel_state.safetensors_header import read_safetensors_header

SEED = 2026


class _Counter:
    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


def _run(accelerator: Accelerator) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return model, optimizer, loader, scheduler, counter


def _train(accelerator: Accelerator, objects: tuple[Any, ...], steps: int) -> None:
    model, optimizer, loader, scheduler, counter = objects
    for index, (xb, yb) in enumerate(loader):
        if index == steps:
            return
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.n += 1


def _fingerprint(objects: tuple[Any, ...]) -> list[Any]:
    model, optimizer, loader, scheduler, counter = objects
    state = [
        {k: v.clone() for k, v in model.state_dict().items()},
        {
            p: {k: v.clone() for k, v in s.items()}
            for p, s in optimizer.state_dict()["state"].items()
        },
        [g["lr"] for g in optimizer.param_groups],
        scheduler.state_dict(),
        loader.state_dict(),
        counter.n,
        torch.get_rng_state(),
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    ]
    return state


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if isinstance(first, list | tuple):
        return len(first) == len(second) and all(map(_same, first, second))
    return bool(first == second)


def _data_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of ``path`` holding raw tensor values (safetensors or torch's zip)."""
    if path.suffix == ".safetensors":
        header = read_safetensors_header(path)
        return [(entry.start, entry.end) for entry in header.tensors.values()]
    if not zipfile.is_zipfile(path):
        return []
    ranges = []
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if "/data/" not in info.filename:
                continue
            # The local header: 30 bytes, then the name and the extra field, then the data.
            name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
            start = info.header_offset + 30 + name_length + extra_length
            ranges.append((start, start + info.compress_size))
    return ranges


def _cases(path: Path, draw: random.Random) -> list[tuple[str, bytes]]:
    data = path.read_bytes()
    size = len(data)
    cases = []
    for cut in sorted({0, 1, 8, size // 3, size // 2, size - 1}):
        if cut < size:
            cases.append((f"truncated to {cut} bytes", data[:cut]))
    for where in sorted({0, 8, size // 2, max(0, size - 8)}):
        junk = bytes(draw.randrange(256) for _ in range(8))
        garbled = data[:where] + junk + data[where + 8 :]
        garbled = garbled[:size]
        if garbled != data:
            cases.append((f"8 bytes garbled at {where}", garbled))
    return cases


@pytest.mark.parametrize("safe", [True, False])
def test_every_damaged_file_is_named_and_changes_nothing(tmp_path: Path, safe: bool) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    objects = _run(accelerator)
    _train(accelerator, objects, 3)  # inside a window: the gradient file is written too
    original = Path(accelerator.save_state(tmp_path / "original", safe_serialization=safe))
    _train(accelerator, objects, 2)  # the run moves on: a load must change it back, or not
    names = sorted(p.name for p in original.iterdir())
    assert "accel_gradients_0.safetensors" in names and MANIFEST_NAME in names
    draw = random.Random(SEED)
    tried, loaded_raw_values, harmless = 0, 0, 0
    accelerator.load_state(str(original))
    reference = _fingerprint(objects)
    _train(accelerator, objects, 2)
    for with_manifest in (True, False):
        for name in names:
            if name == MANIFEST_NAME and not with_manifest:
                continue
            for label, content in _cases(original / name, draw):
                tried += 1
                case = tmp_path / "case"
                if case.exists():
                    shutil.rmtree(case)
                shutil.copytree(original, case)
                if not with_manifest:
                    (case / MANIFEST_NAME).unlink()
                (case / name).write_bytes(content)
                listing = sorted(p.name for p in case.iterdir())
                before = _fingerprint(objects)
                where = f"{name} {label} (manifest: {with_manifest})"
                try:
                    accelerator.load_state(str(case))
                except CheckpointError as error:
                    assert name in str(error), f"{where}: {error}"
                    assert _same(before, _fingerprint(objects)), f"{where}: the run changed"
                else:
                    after = _fingerprint(objects)
                    if _same(after, reference):
                        harmless += 1  # bytes the format does not read (zip times, padding)
                    else:
                        # Otherwise only a change inside a tensor's raw bytes can load.
                        ranges = _data_ranges(original / name)
                        changed = [
                            i
                            for i, (a, b) in enumerate(
                                zip(content, (original / name).read_bytes(), strict=False)
                            )
                            if a != b
                        ]
                        inside = len(content) == (original / name).stat().st_size and all(
                            any(lo <= i < hi for lo, hi in ranges) for i in changed
                        )
                        assert inside, f"{where}: loaded other values"
                        loaded_raw_values += 1
                assert sorted(p.name for p in case.iterdir()) == listing, where
    print(
        f"checkpoint fuzz (safe={safe}): {tried} cases, {harmless} harmless, "
        f"{loaded_raw_values} loaded changed tensor values, the rest refused naming the file"
    )
    assert tried > 100
    accelerator.end_training()
