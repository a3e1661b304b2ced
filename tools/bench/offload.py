"""Benchmark: running a ~2 GB decoder with every block on disk, with and without prefetching.

    python tools/bench/offload.py [--size-gb 2] [--repeats 3] [--forwards 5] [--tokens 64]
                                  [--cold-repeats 2] [--cold-forwards 3] [--depths 0,1,2]
                                  [--cold-depths 0,1] [--dir DIR] [--no-accelerate] [--quick]
                                  [--json FILE]

Run it with an interpreter that has accel-bigmodel installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate 1.15 runs from its own venv (tools/reference_venv.py creates it, its
workers run with ACCELERATE_USE_CPU=1). Linux only for the cold-cache part (/proc, mincore,
posix_fadvise); elsewhere that part is reported as not measured.

Model (accel issue 9): tools/examples/decoder.py's decoder (token embedding, 16 blocks of
LayerNorm + causal attention + LayerNorm + 4x GELU MLP, final LayerNorm, untied lm_head,
vocabulary 4096, fp32), seeded, written once as 5 safetensors shards + index under `--dir`
(default: accel-bench-offload in the system temp dir) and reused. The issue names hidden 2048,
but 16 of these blocks (12 w^2 weights each) weigh 3.3 GB at width 2048; the width is therefore
the multiple of 64 that brings 16 blocks closest to `--size-gb` (1600 for 2 GB: 123 MB a block).

Device map: embedding, final norm and lm_head on "cpu", every block on "disk", an offload
folder given (fresh per worker, deleted and `os.sync()`ed afterwards). Execution on the CPU with
one compute thread (`torch.set_num_threads(1)`, OMP_NUM_THREADS=1): the machine this was written
for has 2 cores, so a prefetching reader has a core of its own and the comparison with the
in-RAM forward is not skewed by thread scheduling. Batch: 1 x `--tokens` token ids (default 64);
at 64 tokens one block computes in about the time its 123 MB take to read from this machine's
disk (~80 ms vs ~120 ms at ~1 GB/s), so hiding one under the other is what decides the latency.

Every measurement runs in a fresh worker process:

1. raw (`--repeats` workers): the plain load, per shard `safetensors.torch.load_file` +
   `load_state_dict(sd, assign=True, strict=False)` on a meta model (a memory map: no bytes are
   read until the forward). Timed: the load call.
2. warm (`--repeats` workers per accel depth in `--depths`, and for Accelerate 1.15), page cache
   warm: `load_checkpoint_and_dispatch(model, folder, device_map, offload_folder=...,
   prefetch_depth=d)` on an `init_empty_weights()` model (Accelerate: the same call without
   `prefetch_depth`). Measured: the load call; bytes in the offload folder afterwards and bytes
   the process wrote (/proc/self/io write_bytes); RssAnon sampled every 5 ms over the load and
   two forwards, over its value before the load (file-backed pages of the memory-mapped shards
   are shared page cache, not the process's own memory), against the bound the issue sets:
   largest block x (prefetch_depth + 2) + the weights not offloaded. Then the same worker loads
   the in-RAM model the raw way and times `--forwards` forwards of each, alternating, after one
   warm-up each: median latency and median of the per-pair ratios offloaded / in RAM.
3. cold (`--cold-repeats` workers per accel depth in `--cold-depths`, and Accelerate): before each
   offloaded forward the bytes the forward reads (the blocks' byte ranges in the shards for
   accel, the offload folder's .dat files for Accelerate) are dropped from the page cache:
   the worker's own mappings of those ranges are zapped (madvise MADV_DONTNEED, as mapped pages
   cannot be evicted) and `posix_fadvise(POSIX_FADV_DONTNEED)` is applied; mincore then checks
   that at most 5% of them is still resident (the run fails otherwise). The disk's sequential
   read bandwidth is measured in the same worker by a plain read (16 MB `readinto`) of the
   same ranges after dropping them. The in-RAM model here holds anonymous copies of the
   weights (a memory map of the shards would keep their pages resident). Each of
   `--cold-forwards` rounds measures the bandwidth, then runs one in-RAM forward (the compute
   time) and one cold forward, in alternating order. Reported, per cold forward and then the
   median: its latency vs max(compute, bytes read / bandwidth), the latency of perfect
   overlap, and vs their sum, the latency of synchronous loading.

Every offloaded forward's logits are checked `torch.equal` to the in-RAM model's (the run fails
otherwise). Goals (accel issue 9), warm: forward <= 1.05x in RAM, load <= 1.1x raw, 0 bytes
written, anonymous RSS <= the bound; cold: forward <= 1.15x max(compute, bytes / bandwidth).
Prints a Markdown table for docs/benchmarks.md and the exact command; `--json FILE` also writes
every worker's figures with the command and the machine (tools/bench/record.py). `--quick` is a
smoke run (tiny model, 1 repeat, 2 forwards, 16 tokens).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import inspect
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.bench.measure import (  # noqa: E402
    AnonSampler,
    folder_bytes,
    forward,
    median,
    proc_status_kb,
    shard_files,
    timed,
)
from tools.bench.record import write_record  # noqa: E402
from tools.examples.decoder import VOCAB, Decoder, fp32_bytes, write_checkpoint  # noqa: E402

SEED = 0
SHARDS = 5
BLOCKS = 16
MB = 1_000_000
GB = 1_000_000_000
STAMP = "bench-config.json"
FORMAT_VERSION = 1
READ_CHUNK = 16 << 20
MADV_DONTNEED = 4
MAX_RESIDENT = 0.05


# ---------------------------------------------------------------------------------------------
# Model and checkpoint
# ---------------------------------------------------------------------------------------------


def shape_for(size_gb: float) -> dict[str, int]:
    """The width (a multiple of 64) whose 16 fp32 blocks bring the model closest to ``size_gb``."""

    def total(width: int) -> int:
        block, outside = fp32_bytes(width)
        return BLOCKS * block + outside

    width = min(range(64, 8193, 64), key=lambda w: abs(total(w) - size_gb * GB))
    return {"width": width, "blocks": BLOCKS, "vocab": VOCAB}


def make_model(shape: dict[str, int]) -> nn.Module:
    return Decoder(shape["width"], shape["blocks"], shape["vocab"])


def meta_model(shape: dict[str, int]) -> nn.Module:
    with torch.device("meta"):
        return make_model(shape)


def device_map_for(shape: dict[str, int]) -> dict[str, str]:
    """Embedding, final norm and lm_head on the CPU; every block on disk."""
    device_map = {"embed": "cpu"}
    device_map.update({f"blocks.{i}": "disk" for i in range(shape["blocks"])})
    device_map.update({"norm": "cpu", "lm_head": "cpu"})
    return device_map


def token_ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(SEED + 1))


def ensure_checkpoint(base: Path, shape: dict[str, int]) -> tuple[Path, int]:
    """The checkpoint folder for ``shape`` (written on first use) and its total bytes."""
    wanted = {"format": FORMAT_VERSION, "seed": SEED, "shards": SHARDS, **shape}
    folder = base / f"decoder-w{shape['width']}-b{shape['blocks']}"
    try:
        stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
        if stamp["config"] == wanted and all(
            (folder / name).stat().st_size == size for name, size in stamp["files"].items()
        ):
            return folder, int(stamp["total_size"])
    except (OSError, ValueError, KeyError):
        pass
    block, outside = fp32_bytes(shape["width"], shape["vocab"])
    estimate = shape["blocks"] * block + outside
    free = shutil.disk_usage(base).free
    if free < 1.5 * estimate:
        raise SystemExit(f"{base}: {free / MB:.0f} MB free, about {estimate / MB:.0f} MB needed")
    print(f"writing the checkpoint ({estimate / GB:.2f} GB) to {folder} ...", flush=True)
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=base))
    try:
        total = write_checkpoint(staging, shape["width"], shape["blocks"], SHARDS, SEED)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        document = {"config": wanted, "total_size": total, "files": files}
        (staging / STAMP).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"  written in {time.perf_counter() - start:.1f} s", flush=True)
    return folder, total


def safetensors_spans(path: Path) -> dict[str, tuple[int, int]]:
    """``{tensor name: (start, end)}`` byte offsets in the file, from its header."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    base = 8 + length
    return {
        name: (base + info["data_offsets"][0], base + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


Ranges = dict[str, list[tuple[int, int]]]


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def block_ranges(checkpoint: Path, prefixes: tuple[str, ...]) -> Ranges:
    """Byte ranges of the tensors under ``prefixes`` (module names + '.'), per shard file."""
    ranges: Ranges = {}
    for path in shard_files(checkpoint):
        spans = [
            span for name, span in safetensors_spans(path).items() if name.startswith(prefixes)
        ]
        if spans:
            ranges[os.path.realpath(path)] = merged(spans)
    return ranges


def whole_files(paths: list[Path]) -> Ranges:
    return {os.path.realpath(p): [(0, p.stat().st_size)] for p in paths if p.stat().st_size}


def range_bytes(ranges: Ranges) -> int:
    return sum(end - start for spans in ranges.values() for start, end in spans)


# ---------------------------------------------------------------------------------------------
# Process memory and I/O counters
# ---------------------------------------------------------------------------------------------


def io_counter(field: str) -> int:
    """``read_bytes``/``write_bytes`` of /proc/self/io (all threads), or -1 without it."""
    try:
        with open("/proc/self/io", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# ---------------------------------------------------------------------------------------------
# Page cache control (Linux)
# ---------------------------------------------------------------------------------------------


class PageCache:
    """Residency (mincore), eviction (madvise + posix_fadvise) and cold reads of byte ranges."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.page = mmap.PAGESIZE

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")

    def resident(self, ranges: Ranges) -> float:
        """Fraction of the ranges' pages that are in the page cache."""
        present = total = 0
        for path, spans in ranges.items():
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                address = self.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
                try:
                    pages = -(-size // self.page)
                    vector = ctypes.create_string_buffer(pages)
                    if self.mincore(address, size, vector) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore on {path} failed")
                    flags = vector.raw
                finally:
                    self.munmap(address, size)
            finally:
                os.close(fd)
            for start, end in spans:
                first, last = start // self.page, -(-end // self.page)
                present += sum(flag & 1 for flag in flags[first:last])
                total += last - first
        return present / total if total else 0.0

    def _own_mappings(self, paths: set[str]) -> list[tuple[str, int, int, int]]:
        """(path, start address, end address, file offset) of this process's mappings."""
        found = []
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in paths:
                    low, high = (int(x, 16) for x in parts[0].split("-"))
                    found.append((parts[5].strip(), low, high, int(parts[2], 16)))
        return found

    def drop(self, ranges: Ranges) -> None:
        """Evict the ranges: unmap this process's pages of them, then POSIX_FADV_DONTNEED."""
        for path, low, high, offset in self._own_mappings(set(ranges)):
            for start, end in ranges[path]:
                begin, finish = max(start, offset), min(end, offset + high - low)
                first = -(-(low + begin - offset) // self.page) * self.page
                last = (low + finish - offset) // self.page * self.page
                if last > first and self.madvise(first, last - first, MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), f"madvise on a mapping of {path} failed")
        for path, spans in ranges.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages (a file just written) cannot be dropped
                for start, end in spans:
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def drop_checked(self, ranges: Ranges) -> float:
        """Drop the ranges; return the resident fraction left (fail above ``MAX_RESIDENT``)."""
        self.drop(ranges)
        left = self.resident(ranges)
        if left > MAX_RESIDENT:
            self.drop(ranges)
            left = self.resident(ranges)
        if left > MAX_RESIDENT:
            raise SystemExit(
                f"could not drop the weights from the page cache: {left:.1%} still resident "
                "after madvise(MADV_DONTNEED) + posix_fadvise(POSIX_FADV_DONTNEED)"
            )
        return left


def plain_read(ranges: Ranges) -> tuple[int, float]:
    """Read the ranges in file order with one 16 MB buffer; (bytes, seconds)."""
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    done = 0
    start = time.perf_counter()
    for path, spans in ranges.items():
        with open(path, "rb", buffering=0) as handle:
            for first, last in spans:
                handle.seek(first)
                left = last - first
                while left > 0:
                    got = handle.readinto(view[: min(left, READ_CHUNK)])
                    if not got:
                        break
                    done += got
                    left -= got
    return done, time.perf_counter() - start


def cold_bandwidth(cache: PageCache, ranges: Ranges) -> float:
    """Sequential read bandwidth of the ranges after dropping them, bytes per second."""
    cache.drop_checked(ranges)
    done, seconds = plain_read(ranges)
    return done / seconds


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


def library(impl: str) -> Any:
    return importlib.import_module("accelerate" if impl == "accelerate" else "accel_bigmodel")


def timed_forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    output = forward(model, ids)
    return output, time.perf_counter() - start


def raw_load(model: nn.Module, checkpoint: Path, anonymous: bool = False) -> None:
    """Each shard through ``load_file`` (a memory map), assigned as the model's parameters.

    ``anonymous`` copies every tensor into the process's own memory instead, so that no mapping
    keeps the shards' pages resident.
    """
    for path in shard_files(checkpoint):
        state = load_file(str(path))
        if anonymous:
            state = {name: tensor.clone() for name, tensor in state.items()}
        model.load_state_dict(state, assign=True, strict=False)
        del state


def empty_model(impl: str, shape: dict[str, int]) -> nn.Module:
    """The model built under the library's ``init_empty_weights()``."""
    with library(impl).init_empty_weights():
        return make_model(shape)


def offload_load(
    impl: str, depth: int, model: nn.Module, checkpoint: Path, shape: dict[str, int], offload: Path
) -> float:
    """Load ``model`` with every block on disk; the seconds of the load call."""
    load = library(impl).load_checkpoint_and_dispatch
    options: dict[str, Any] = {}
    if impl == "accel":
        if "prefetch_depth" in inspect.signature(load).parameters:
            options["prefetch_depth"] = depth
        elif depth != 0:
            raise SystemExit(f"this accel_bigmodel has no prefetch_depth (asked for {depth})")
    return timed(
        lambda: load(
            model,
            str(checkpoint),
            device_map=device_map_for(shape),
            offload_folder=str(offload),
            **options,
        )
    )


def check_equal(impl: str, output: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.equal(output, expected):
        diff = (output - expected).abs().max().item()
        raise SystemExit(f"{impl}: {what} logits differ from the in-RAM model's (max {diff})")


def raw_worker(checkpoint: Path, shape: dict[str, int]) -> dict[str, Any]:
    model = meta_model(shape)
    return {"seconds": timed(lambda: raw_load(model, checkpoint))}


def warm_worker(
    impl: str, depth: int, checkpoint: Path, shape: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """Load, memory over two forwards, then alternating forwards against the in-RAM model."""
    ids = token_ids(args.tokens)
    model = empty_model(impl, shape)
    forward(make_model({"width": 64, "blocks": 1, "vocab": 64}), ids % 64)  # torch's lazy setup
    gc.collect()
    anon_base = proc_status_kb("RssAnon").get("RssAnon", 0) * 1024
    written = io_counter("write_bytes")
    with AnonSampler().running() as sampler:
        seconds = offload_load(impl, depth, model, checkpoint, shape, args.offload)
        written = io_counter("write_bytes") - written
        first, first_seconds = timed_forward(model, ids)
        second, second_seconds = timed_forward(model, ids)
    after = proc_status_kb("RssAnon", "RssFile")
    folder, files = folder_bytes(args.offload)
    os.sync()  # Accelerate's .dat files: written back before anything is timed

    plain = meta_model(shape)
    raw_load(plain, checkpoint)
    in_ram = forward(plain, ids)
    check_equal(impl, first, in_ram, "first offloaded")
    check_equal(impl, second, in_ram, "second offloaded")
    times: dict[str, list[float]] = {"offload": [], "ram": []}
    models = {"offload": model, "ram": plain}
    for index in range(args.forwards):
        for name in ("offload", "ram") if index % 2 == 0 else ("ram", "offload"):
            output, spent = timed_forward(models[name], ids)
            check_equal(impl, output, in_ram, f"{name} (forward {index + 1})")
            times[name].append(spent)
    return {
        "seconds": seconds,
        "written": written,
        "folder_bytes": folder,
        "folder_files": files,
        "anon_peak": sampler.peak_kb * 1024 - anon_base,
        "anon_after": after.get("RssAnon", 0) * 1024 - anon_base,
        "file_after": after.get("RssFile", 0) * 1024,
        "first_forward": first_seconds,
        "second_forward": second_seconds,
        "forward": times,
    }


def cold_worker(
    impl: str, depth: int, checkpoint: Path, shape: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """Forwards with the offloaded weights dropped from the page cache before each one."""
    cache = PageCache()
    ids = token_ids(args.tokens)
    model = empty_model(impl, shape)
    offload_load(impl, depth, model, checkpoint, shape, args.offload)
    os.sync()  # dirty pages cannot be dropped
    if impl == "accelerate":
        ranges = whole_files(sorted(args.offload.rglob("*.dat")))
    else:
        disk = tuple(
            name + "." for name, device in device_map_for(shape).items() if device == "disk"
        )
        ranges = block_ranges(checkpoint, disk)
    if not ranges:
        raise SystemExit(f"{impl}: found no offloaded weights to drop from the page cache")
    plain = meta_model(shape)
    raw_load(plain, checkpoint, anonymous=True)
    in_ram = forward(plain, ids)
    check_equal(impl, forward(model, ids), in_ram, "warm-up offloaded")

    times: dict[str, list[float]] = {"cold": [], "ram": []}
    bandwidths: list[float] = []
    read: list[int] = []
    resident: list[float] = []
    for index in range(args.forwards):
        bandwidths.append(cold_bandwidth(cache, ranges))
        for name in ("cold", "ram") if index % 2 == 0 else ("ram", "cold"):
            if name == "ram":
                output, spent = timed_forward(plain, ids)
            else:
                resident.append(cache.drop_checked(ranges))
                before = io_counter("read_bytes")
                output, spent = timed_forward(model, ids)
                read.append(io_counter("read_bytes") - before)
            check_equal(impl, output, in_ram, f"{name} (forward {index + 1})")
            times[name].append(spent)
    return {
        "bytes": range_bytes(ranges),
        "files": len(ranges),
        "bandwidth": bandwidths,
        "forward": times,
        "read_bytes": read,
        "resident_after_drop": max(resident),
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    shape = json.loads(args.shape)
    kind, impl, depth = args.worker.split(":")
    if kind == "raw":
        result = raw_worker(args.checkpoint, shape)
    elif kind == "warm":
        result = warm_worker(impl, int(depth), args.checkpoint, shape, args)
    else:
        result = cold_worker(impl, int(depth), args.checkpoint, shape, args)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def run_worker(
    python: str,
    name: str,
    checkpoint: Path,
    shape: dict[str, int],
    args: argparse.Namespace,
    forwards: int = 0,
    offload: Path | None = None,
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if name.split(":")[1] == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", name]
    command += ["--checkpoint", str(checkpoint), "--shape", json.dumps(shape)]
    command += ["--forwards", str(forwards), "--tokens", str(args.tokens)]
    if offload is not None:
        command += ["--offload", str(offload)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def run_offload_worker(
    python: str,
    name: str,
    checkpoint: Path,
    shape: dict[str, int],
    args: argparse.Namespace,
    forwards: int,
) -> dict[str, Any]:
    offload = Path(tempfile.mkdtemp(prefix="offload-", dir=checkpoint.parent))
    shutil.rmtree(offload)  # the library creates it
    try:
        return run_worker(python, name, checkpoint, shape, args, forwards, offload)
    finally:
        shutil.rmtree(offload, ignore_errors=True)
        os.sync()


def warm(checkpoint: Path) -> None:
    for path in sorted(checkpoint.iterdir()):
        plain_read({str(path): [(0, path.stat().st_size)]})


def check_page_cache(checkpoint: Path) -> dict[str, Any]:
    """Whether dropping works here: a shard's re-read time warm and after the drop."""
    if not PageCache.available():
        return {"works": False, "why": "no posix_fadvise/mincore on this platform"}
    cache = PageCache()
    ranges = whole_files(shard_files(checkpoint)[:1])
    plain_read(ranges)
    done, warm_seconds = plain_read(ranges)
    try:
        left = cache.drop_checked(ranges)
    except SystemExit as error:
        return {"works": False, "why": str(error)}
    _, cold_seconds = plain_read(ranges)
    files = whole_files(shard_files(checkpoint))
    bandwidth = cold_bandwidth(cache, files)
    warm(checkpoint)
    return {
        "works": True,
        "bytes": done,
        "warm_seconds": warm_seconds,
        "cold_seconds": cold_seconds,
        "resident_after_drop": left,
        "bandwidth": bandwidth,
        "checkpoint_bytes": range_bytes(files),
    }


def spread(values: list[float], fmt: str) -> str:
    text = f"{median(values):{fmt}}"
    return f"{text} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else text


def label(impl: str, depth: int) -> str:
    return "Accelerate 1.15" if impl == "accelerate" else f"accel, prefetch_depth={depth}"


def cold_figures(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per cold forward: latency, compute, I/O time at the bandwidth measured just before it."""
    figures: dict[str, list[float]] = {}
    for run in runs:
        for latency, compute, bandwidth in zip(
            run["forward"]["cold"], run["forward"]["ram"], run["bandwidth"], strict=True
        ):
            io = run["bytes"] / bandwidth
            values = {
                "latency": latency,
                "compute": compute,
                "io": io,
                "bandwidth": bandwidth,
                "vs_max": latency / max(compute, io),
                "vs_sum": latency / (compute + io),
            }
            for key, value in values.items():
                figures.setdefault(key, []).append(value)
    return figures


def report(results: dict[str, Any], command: str) -> None:
    """Print the Markdown table and the notes."""
    shape, total = results["shape"], results["total"]
    raw = median([r["seconds"] for r in results["raw"]])
    warm_runs: dict[str, list[dict[str, Any]]] = results["warm"]
    cold_runs: dict[str, list[dict[str, Any]]] = results["cold"]
    columns = list(dict.fromkeys([*warm_runs, *cold_runs]))
    block = results["largest_block"]
    resident = results["not_offloaded"]

    def bound(key: str) -> int:
        depth = 0 if key.startswith("accelerate") else int(key.split(":")[1])
        return block * (depth + 2) + resident

    def load_cell(runs: list[dict[str, Any]]) -> str:
        seconds = median([r["seconds"] for r in runs])
        return f"{seconds:.3f} (**{seconds / raw:.2f}×**)"

    def written_cell(runs: list[dict[str, Any]]) -> str:
        folder = max(r["folder_bytes"] for r in runs)
        files = max(r["folder_files"] for r in runs)
        process = max(r["written"] for r in runs)
        return f"**{folder / MB:.0f}** in {files} files ({process / MB:.0f})"

    def latency_cell(runs: list[dict[str, Any]]) -> str:
        off = [t for r in runs for t in r["forward"]["offload"]]
        ram = [t for r in runs for t in r["forward"]["ram"]]
        ratios = [
            a / b
            for r in runs
            for a, b in zip(r["forward"]["offload"], r["forward"]["ram"], strict=True)
        ]
        return f"{median(off) * 1e3:.0f} vs {median(ram) * 1e3:.0f} (**{median(ratios):.2f}×**)"

    def anon_cell(key: str, runs: list[dict[str, Any]]) -> str:
        peak = max(r["anon_peak"] for r in runs)
        limit = bound(key)
        return f"**{peak / MB:.0f}** (bound {limit / MB:.0f}: {'yes' if peak <= limit else 'no'})"

    def cold_cell(runs: list[dict[str, Any]], field: str) -> str:
        figures = cold_figures(runs)
        if field == "latency":
            return f"{median(figures['latency']) * 1e3:.0f}"
        if field == "parts":
            compute = median(figures["compute"])
            io = median(figures["io"])
            bandwidth = median(figures["bandwidth"])
            return f"{compute * 1e3:.0f} / {io * 1e3:.0f} ({bandwidth / GB:.2f} GB/s)"
        if field == "read":
            read = median([float(b) for r in runs for b in r["read_bytes"]])
            return f"{read / MB:.0f} of {max(r['bytes'] for r in runs) / MB:.0f}"
        value = median(figures[field])
        return f"**{value:.2f}×**" if field == "vs_max" else f"{value:.2f}×"

    rows: list[tuple[str, dict[str, str], str]] = [
        (
            "warm: load call, s (× raw mmap load)",
            {k: load_cell(v) for k, v in warm_runs.items()},
            "≤ 1.1×",
        ),
        (
            "warm: MB written to the offload folder (process write_bytes, MB)",
            {k: written_cell(v) for k, v in warm_runs.items()},
            "0",
        ),
        (
            f"warm: forward 1×{results['tokens']} tokens, ms, offloaded vs in RAM "
            "(median per-pair ratio)",
            {k: latency_cell(v) for k, v in warm_runs.items()},
            "≤ 1.05×",
        ),
        (
            "warm: anonymous RSS peak over the load and 2 forwards, MB (bound: largest block "
            "× (depth + 2) + weights not offloaded)",
            {k: anon_cell(k, v) for k, v in warm_runs.items()},
            "≤ bound",
        ),
        (
            "cold: forward, ms",
            {k: cold_cell(v, "latency") for k, v in cold_runs.items()},
            "",
        ),
        (
            "cold: compute (in-RAM forward) / I/O (bytes ÷ bandwidth), ms (read bandwidth)",
            {k: cold_cell(v, "parts") for k, v in cold_runs.items()},
            "",
        ),
        (
            "cold: forward ÷ max(compute, I/O)",
            {k: cold_cell(v, "vs_max") for k, v in cold_runs.items()},
            "≤ 1.15×",
        ),
        (
            "cold: forward ÷ (compute + I/O), synchronous loading = 1",
            {k: cold_cell(v, "vs_sum") for k, v in cold_runs.items()},
            "",
        ),
        (
            "cold: MB read from storage per forward (/proc/self/io) of MB dropped",
            {k: cold_cell(v, "read") for k, v in cold_runs.items()},
            "",
        ),
    ]
    names = {key: label(key.split(":")[0], int(key.split(":")[1])) for key in columns}
    check = results["page_cache"]
    print()
    print(f"Command: `{command}`")
    print(
        f"Model: decoder, width {shape['width']}, {shape['blocks']} blocks of "
        f"{block / MB:.0f} MB, vocabulary {shape['vocab']}, fp32, {total / MB:.0f} MB in "
        f"{SHARDS} safetensors shards; blocks on disk, {resident / MB:.0f} MB on the CPU; "
        f"raw mmap load {raw:.3f} s (median of {len(results['raw'])}); "
        f"warm: {results['repeats']} worker(s) per column, {results['forwards']} timed forward "
        f"pairs each; cold: {results['cold_repeats']} worker(s) per column, "
        f"{results['cold_forwards']} pairs each; medians."
    )
    if check["works"]:
        print(
            f"Page cache: a {check['bytes'] / MB:.0f} MB shard re-read in "
            f"{check['warm_seconds']:.3f} s warm and {check['cold_seconds']:.3f} s after "
            f"posix_fadvise(DONTNEED) ({check['resident_after_drop']:.1%} left resident); "
            f"the whole checkpoint read cold at {check['bandwidth'] / GB:.2f} GB/s."
        )
    else:
        print(f"Page cache: cold-cache part not measured ({check['why']}).")
    print()
    print("| measurement | " + " | ".join(names[k] for k in columns) + " | goal |")
    print("|---|" + "---|" * len(columns) + "---|")
    for text, cells, goal in rows:
        if cells:
            values = " | ".join(cells.get(k, "—") for k in columns)
            print(f"| {text} | {values} | {goal} |")
    print()
    print("Ranges over the workers:")
    for key, runs in warm_runs.items():
        ratios = [
            a / b
            for r in runs
            for a, b in zip(r["forward"]["offload"], r["forward"]["ram"], strict=True)
        ]
        print(
            f"- {names[key]}, warm: load {spread([r['seconds'] for r in runs], '.3f')} s, "
            f"per-pair forward ratio {spread(ratios, '.3f')}, first forward "
            f"{spread([r['first_forward'] for r in runs], '.3f')} s; after two forwards "
            f"RssAnon {max(r['anon_after'] for r in runs) / MB:+.0f} MB"
        )
    for key, runs in cold_runs.items():
        figures = cold_figures(runs)
        print(
            f"- {names[key]}, cold: forward "
            f"{spread([t * 1e3 for t in figures['latency']], '.0f')} ms, compute "
            f"{spread([t * 1e3 for t in figures['compute']], '.0f')} ms, "
            f"÷ max {spread(figures['vs_max'], '.2f')}, ÷ sum {spread(figures['vs_sum'], '.2f')}, "
            f"bandwidth {spread([b / GB for b in figures['bandwidth']], '.2f')} GB/s, "
            "resident after the drop "
            f"≤ {max(r['resident_after_drop'] for r in runs):.1%}"
        )
    print()
    print(
        "Every offloaded forward's logits were torch.equal to the in-RAM model's. Anonymous "
        "RSS: RssAnon sampled every 5 ms minus its value before the load. Cold: the forward's "
        "byte ranges dropped (madvise + posix_fadvise) before each offloaded forward; "
        "bandwidth = a plain read of the same ranges after dropping them, just before each "
        "pair of forwards; ratios per forward (its bandwidth, the in-RAM forward of its pair), "
        "then the median."
    )


def parse_depths(text: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        depths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"depths must be comma-separated integers, not {text!r}")
    if any(d < 0 for d in depths):
        parser.error("depths must be >= 0")
    return list(dict.fromkeys(depths))


def main() -> None:
    """Parse options, build the checkpoint, run the workers, print the report."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=None, help="fp32 weights (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="warm workers (default 3)")
    parser.add_argument("--forwards", type=int, default=None, help="warm forwards (default 5)")
    parser.add_argument("--cold-repeats", type=int, default=None, help="cold workers (default 2)")
    parser.add_argument("--cold-forwards", type=int, default=None, help="cold forwards (default 3)")
    parser.add_argument("--tokens", type=int, default=None, help="batch 1 x TOKENS (default 64)")
    parser.add_argument("--depths", default="0,1,2", help="accel prefetch depths, warm cache")
    parser.add_argument("--cold-depths", default="0,1", help="accel prefetch depths, cold cache")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint cache folder")
    parser.add_argument("--no-accelerate", action="store_true", help="skip Accelerate 1.15")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 repeat")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--offload", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    size_gb = args.size_gb if args.size_gb is not None else (0.02 if args.quick else 2.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.forwards = args.forwards if args.forwards is not None else (2 if args.quick else 5)
    args.tokens = args.tokens if args.tokens is not None else (16 if args.quick else 64)
    cold_repeats = args.cold_repeats if args.cold_repeats is not None else (1 if args.quick else 2)
    cold_forwards = (
        args.cold_forwards if args.cold_forwards is not None else (2 if args.quick else 3)
    )
    counts = (repeats, cold_repeats, args.forwards, cold_forwards, args.tokens)
    if size_gb <= 0 or min(counts) < 1:
        parser.error("--size-gb, --tokens and the repeats and forwards must be positive")
    depths = parse_depths(args.depths, parser)
    cold_depths = parse_depths(args.cold_depths, parser)

    pythons = {"accel": sys.executable}
    if not args.no_accelerate:
        from tools.reference_venv import ensure_accelerate_venv

        pythons["accelerate"] = str(ensure_accelerate_venv())
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir()) / "accel-bench-offload"
    base.mkdir(parents=True, exist_ok=True)
    shape = shape_for(size_gb)
    checkpoint, total = ensure_checkpoint(base, shape)
    warm(checkpoint)
    page_cache = check_page_cache(checkpoint)
    print(f"page cache check: {json.dumps(page_cache)}", flush=True)

    warm_keys = [f"accel:{d}" for d in depths]
    cold_keys = [f"accel:{d}" for d in cold_depths] if page_cache["works"] else []
    if "accelerate" in pythons:
        warm_keys.append("accelerate:0")
        cold_keys += ["accelerate:0"] if page_cache["works"] else []
    block, outside = fp32_bytes(shape["width"], shape["vocab"])
    results: dict[str, Any] = {
        "shape": shape,
        "total": total,
        "largest_block": block,
        "not_offloaded": outside,
        "tokens": args.tokens,
        "forwards": args.forwards,
        "repeats": repeats,
        "cold_forwards": cold_forwards,
        "cold_repeats": cold_repeats,
        "page_cache": page_cache,
        "raw": [],
        "warm": {key: [] for key in warm_keys},
        "cold": {key: [] for key in cold_keys},
    }
    for _ in range(repeats):
        result = run_worker(sys.executable, "raw:raw:0", checkpoint, shape, args)
        results["raw"].append(result)
        print(f"raw load: {result['seconds']:.3f} s", flush=True)
    phases = (
        ("warm", warm_keys, repeats, args.forwards),
        ("cold", cold_keys, cold_repeats, cold_forwards),
    )
    for phase, keys, rounds, forwards in phases:
        for index in range(rounds):
            shift = index % len(keys) if keys else 0
            for key in keys[shift:] + keys[:shift]:
                impl = key.split(":")[0]
                result = run_offload_worker(
                    pythons[impl], f"{phase}:{key}", checkpoint, shape, args, forwards
                )
                results[phase][key].append(result)
                if phase == "warm":
                    summary = f"load {result['seconds']:.3f} s"
                else:
                    summary = f"cold forward {median(result['forward']['cold']):.3f} s"
                print(f"{phase} {key}: {summary}", flush=True)
    warm(checkpoint)
    if args.json is not None:
        write_record(args.json, "offload", results)
    report(results, ("python tools/bench/offload.py " + " ".join(sys.argv[1:])).strip())


if __name__ == "__main__":
    main()
