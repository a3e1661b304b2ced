"""Benchmark: loading a ~2 GB sharded safetensors checkpoint, and running it with blocks on disk.

    python tools/bench/bigmodel.py [--size-gb 2] [--repeats 3] [--forwards 5] [--dir DIR]
                                   [--no-accelerate] [--quick]

Run it with an interpreter that has accel-bigmodel installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate 1.15 runs from its own venv (tools/reference_venv.py creates it, its
workers run with ACCELERATE_USE_CPU=1). Everything runs on the CPU, one thread per worker
(OMP_NUM_THREADS=1).

Checkpoint: a GPT-like decoder (token embedding, N blocks of LayerNorm + causal attention
(qkv and output Linear) + LayerNorm + GELU MLP (4x), final LayerNorm, untied lm_head; vocabulary
4096, width 1024 (512 below 0.5 GB), fp32, no buffers) with about `--size-gb` GB (1e9 B) of
weights, drawn from a seeded generator, written once with `safetensors.torch.save_file` as 5
shards + `model.safetensors.index.json` under `--dir` (default: a folder in the system temp
dir) and reused by later runs with the same settings. Before measuring, every file is read once
so that all loads hit a warm page cache (dropping it needs root).

Each measurement runs in a fresh worker process, so that its peak RSS (`ru_maxrss`) is its own.
The baseline is the RSS after the imports and after the empty model is built on the meta device;
"peak RSS delta" = ru_maxrss - baseline. Reported against the model size (the checkpoint's
`total_size`). A thread also samples /proc/self/status every 5 ms for the anonymous part
(RssAnon): file-backed pages of a memory-mapped checkpoint count in RSS but are the shared page
cache, not memory the process allocated.

1. Load into RAM (`--repeats` workers of each, order rotating):
   - accel: `load_checkpoint_and_dispatch(model, dir, device_map={"": "cpu"})` on a model made
     under `init_empty_weights()`;
   - raw: per shard, `safetensors.torch.load_file` + `model.load_state_dict(sd, assign=True,
     strict=False)` on a model built under `torch.device("meta")` (the fastest plain way);
   - Accelerate 1.15: the same call as accel, in its own venv.
   Timed: the load call alone (garbage collector off). Checked: after the measurement, each
   worker runs the model on a fixed batch of token ids; the SHA-1 of the logits must equal raw's.
2. Disk offload (`--repeats` workers of accel and of Accelerate): the embedding, final norm and
   lm_head on "cpu", every block on "disk", `offload_folder` given (a fresh folder, deleted and
   `os.sync()`ed after each worker). Measured: load time, bytes in the offload folder afterwards
   (all files, walked) and the bytes the process wrote anywhere (/proc/self/io write_bytes: also
   catches temporary folders), peak RSS after the load and one forward. Then the same worker
   loads the plain in-RAM model (raw way), checks that both models' logits are identical
   (`torch.equal`; the run fails otherwise) and times `--forwards` forwards of each, alternating
   (after one warm-up each); reported: median forward latency and the median of the per-pair
   ratios offloaded/in-RAM. The batch is 1 x 32 token ids.

Goals (accel issue 8): load <= 1.1x raw, peak RSS <= 1.1x the model size, 0 bytes written for a
safetensors checkpoint. Prints a Markdown table for docs/benchmarks.md. `--quick` is a smoke run
(0.1 GB, 1 repeat, 2 forwards).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from tools.bench.measure import (  # noqa: E402
    AnonSampler,
    folder_bytes,
    forward,
    median,
    proc_status_kb,
    shard_files,
    timed,
)
from tools.examples.decoder import VOCAB, Decoder, fp32_bytes, write_checkpoint  # noqa: E402

SEED = 0
SHARDS = 5
BATCH = (1, 32)
GB = 1_000_000_000
MB = 1_000_000
STAMP = "bench-config.json"
FORMAT_VERSION = 1
LOADS = ("raw", "accel", "accelerate")


def shape_for(size_gb: float) -> dict[str, int]:
    """Width and number of blocks whose fp32 weights come closest to ``size_gb`` GB."""
    width = 1024 if size_gb >= 0.5 else 512
    block, outside = fp32_bytes(width)
    blocks = max(1, round((size_gb * GB - outside) / block))
    return {"width": width, "blocks": blocks, "vocab": VOCAB}


def token_ids() -> torch.Tensor:
    """The fixed batch every forward runs on."""
    return torch.randint(0, VOCAB, BATCH, generator=torch.Generator().manual_seed(SEED + 1))


# ---------------------------------------------------------------------------------------------
# Checkpoint (parent process)
# ---------------------------------------------------------------------------------------------


def ensure_checkpoint(base: Path, size_gb: float) -> tuple[Path, int, dict[str, int]]:
    """Return the checkpoint folder for ``size_gb`` (built on first use), its size and shape."""
    shape = shape_for(size_gb)
    wanted = {"format": FORMAT_VERSION, "seed": SEED, "shards": SHARDS, **shape}
    folder = base / f"decoder-w{shape['width']}-b{shape['blocks']}"
    try:
        stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
        if stamp["config"] == wanted and all(
            (folder / name).stat().st_size == size for name, size in stamp["files"].items()
        ):
            return folder, int(stamp["total_size"]), shape
    except (OSError, ValueError, KeyError):
        pass
    estimate = 4 * (shape["blocks"] * 12 * shape["width"] ** 2 + 2 * VOCAB * shape["width"])
    free = shutil.disk_usage(base).free
    if free < 1.5 * estimate:
        raise SystemExit(f"{base}: {free / MB:.0f} MB free, about {estimate / MB:.0f} MB needed")
    print(f"writing the checkpoint ({estimate / GB:.2f} GB) to {folder} ...", flush=True)
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=base))
    try:
        total = write_checkpoint(staging, shape["width"], shape["blocks"], SHARDS, SEED)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        stamp_doc = {"config": wanted, "total_size": total, "files": files}
        (staging / STAMP).write_text(json.dumps(stamp_doc, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"  written in {time.perf_counter() - start:.1f} s", flush=True)
    return folder, total, shape


def warm_page_cache(folder: Path) -> float:
    """Read every file of ``folder`` once; return the seconds it took."""
    start = time.perf_counter()
    for path in sorted(folder.iterdir()):
        with path.open("rb", buffering=0) as handle:
            while handle.read(64 << 20):
                pass
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


def write_bytes() -> int:
    """Bytes this process caused to be written to storage so far (/proc/self/io), or -1."""
    try:
        with open("/proc/self/io", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def reset_peak_rss() -> dict[str, int]:
    """Reset the peak RSS (VmHWM) to the current RSS; return VmRSS and RssAnon in bytes.

    A worker's ``ru_maxrss`` starts at its parent's peak (fork/vfork before exec keeps the
    parent's high-water mark), so it cannot measure a worker smaller than the parent; VmHWM,
    reset here through /proc/self/clear_refs, can.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError as error:
        raise SystemExit(f"cannot reset the peak RSS (/proc/self/clear_refs): {error}") from None
    status = proc_status_kb("VmRSS", "RssAnon", "RssFile")
    return {
        "rss": status["VmRSS"] * 1024,
        "anon": status.get("RssAnon", 0) * 1024,
        "file": status.get("RssFile", 0) * 1024,
    }


def peak_rss_bytes() -> int:
    """Peak RSS since the last reset (VmHWM), in bytes."""
    return proc_status_kb("VmHWM")["VmHWM"] * 1024


def library(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``init_empty_weights`` and ``load_checkpoint_and_dispatch`` of accel or Accelerate."""
    module = importlib.import_module("accelerate" if impl == "accelerate" else "accel_bigmodel")
    return module.init_empty_weights, module.load_checkpoint_and_dispatch


def raw_load(model: nn.Module, checkpoint: Path) -> None:
    """The plain way: each shard read whole, its tensors assigned as the model's parameters."""
    for path in shard_files(checkpoint):
        model.load_state_dict(load_file(str(path)), assign=True, strict=False)


def meta_model(shape: dict[str, int]) -> nn.Module:
    with torch.device("meta"):
        return Decoder(shape["width"], shape["blocks"], shape["vocab"])


def digest(tensor: torch.Tensor) -> str:
    sha = hashlib.sha1(usedforsecurity=False)
    sha.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def load_worker(impl: str, checkpoint: Path, shape: dict[str, int]) -> dict[str, Any]:
    """Time one load into RAM; memory and output digest as a dict."""
    if impl == "raw":
        model = meta_model(shape)

        def load() -> None:
            raw_load(model, checkpoint)

    else:
        init_empty_weights, load_checkpoint_and_dispatch = library(impl)
        with init_empty_weights():
            model = Decoder(shape["width"], shape["blocks"], shape["vocab"])

        def load() -> None:
            load_checkpoint_and_dispatch(model, str(checkpoint), device_map={"": "cpu"})

    ids = token_ids()
    base = reset_peak_rss()
    written = write_bytes()
    with AnonSampler().running() as sampler:
        seconds = timed(load)
        load_peak = peak_rss_bytes()
        left_on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if left_on_meta:
            raise SystemExit(f"{impl}: parameters still on meta after the load: {left_on_meta[:5]}")
        start = time.perf_counter()
        logits = forward(model, ids)
        first = time.perf_counter() - start
    return {
        "seconds": seconds,
        "first_forward": first,
        "baseline": base["rss"],
        "anon_baseline": base["anon"],
        "load_peak": load_peak,
        "peak": peak_rss_bytes(),
        "anon_peak": sampler.peak_kb * 1024,
        "written": write_bytes() - written,
        "digest": digest(logits),
    }


def offload_worker(
    impl: str, checkpoint: Path, shape: dict[str, int], offload: Path, forwards: int
) -> dict[str, Any]:
    """Load with every block on disk, check against the in-RAM model, time both forwards."""
    init_empty_weights, load_checkpoint_and_dispatch = library(impl)
    with init_empty_weights():
        model = Decoder(shape["width"], shape["blocks"], shape["vocab"])
    device_map: dict[str, str] = {"embed": "cpu"}
    device_map.update({f"blocks.{i}": "disk" for i in range(shape["blocks"])})
    device_map.update({"norm": "cpu", "lm_head": "cpu"})
    ids = token_ids()
    base = reset_peak_rss()
    written = write_bytes()
    with AnonSampler().running() as sampler:
        seconds = timed(
            lambda: load_checkpoint_and_dispatch(
                model, str(checkpoint), device_map=device_map, offload_folder=str(offload)
            )
        )
        load_peak = peak_rss_bytes()
        written = write_bytes() - written
        start = time.perf_counter()
        offloaded = forward(model, ids)  # also the warm-up of the offloaded model
        first = time.perf_counter() - start
    peak = peak_rss_bytes()
    anon_peak = sampler.peak_kb * 1024
    folder, files = folder_bytes(offload)
    after = proc_status_kb("RssAnon", "RssFile")

    plain = meta_model(shape)
    raw_load(plain, checkpoint)
    in_ram = forward(plain, ids)  # warm-up of the in-RAM model
    if not torch.equal(offloaded, in_ram):
        diff = (offloaded - in_ram).abs().max().item()
        raise SystemExit(f"{impl}: disk-offloaded logits differ from in-RAM ones (max {diff})")
    times: dict[str, list[float]] = {"offload": [], "ram": []}
    models = {"offload": model, "ram": plain}
    for index in range(forwards):
        for name in ("offload", "ram") if index % 2 == 0 else ("ram", "offload"):
            start = time.perf_counter()
            output = forward(models[name], ids)
            times[name].append(time.perf_counter() - start)
            if not torch.equal(output, in_ram):
                raise SystemExit(f"{impl}: {name} logits changed between forwards")
    return {
        "seconds": seconds,
        "first_forward": first,
        "baseline": base["rss"],
        "anon_baseline": base["anon"],
        "file_baseline": base["file"],
        "load_peak": load_peak,
        "peak": peak,
        "anon_peak": anon_peak,
        "rss_anon_after": after.get("RssAnon", 0) * 1024,
        "rss_file_after": after.get("RssFile", 0) * 1024,
        "written": written,
        "folder_bytes": folder,
        "folder_files": files,
        "forward": times,
        "digest": digest(in_ram),
    }


def worker(args: argparse.Namespace) -> None:
    shape = json.loads(args.shape)
    kind, impl = args.worker.split("-", 1)
    if kind == "load":
        result = load_worker(impl, args.checkpoint, shape)
    else:
        result = offload_worker(impl, args.checkpoint, shape, args.offload, args.forwards)
    print(json.dumps({"impl": impl, "kind": kind, **result}), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def run_worker(
    python: str, name: str, checkpoint: Path, shape: dict[str, int], extra: list[str]
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if name.endswith("accelerate"):
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", name]
    command += ["--checkpoint", str(checkpoint), "--shape", json.dumps(shape), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def ranged(values: list[float], fmt: str) -> str:
    """``median`` formatted, with the range when there is more than one value."""
    text = f"{median(values):{fmt}}"
    return f"{text} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else text


def report(
    loads: dict[str, list[dict[str, Any]]],
    offloads: dict[str, list[dict[str, Any]]],
    total: int,
    shape: dict[str, int],
    command: str,
) -> None:
    """Print the Markdown table and the notes."""
    impls = ("accel", "accelerate", "raw")
    raw_load = median([r["seconds"] for r in loads["raw"]])
    raw_first = median([r["seconds"] + r["first_forward"] for r in loads["raw"]])

    def cells(values: dict[str, str]) -> str:
        return " | ".join(values.get(impl, "—") for impl in impls)

    def per_impl(
        results: dict[str, list[dict[str, Any]]], show: Callable[[str, list[dict[str, Any]]], str]
    ) -> dict[str, str]:
        return {impl: show(impl, runs) for impl, runs in results.items()}

    def vs_raw(seconds: float, raw: float, impl: str) -> str:
        return f"{seconds:.3f}" if impl == "raw" else f"{seconds:.3f} (**{seconds / raw:.2f}×**)"

    def rss(runs: list[dict[str, Any]]) -> str:
        delta = max(r["peak"] - r["baseline"] for r in runs)
        anon = max(r["anon_peak"] - r["anon_baseline"] for r in runs)
        return f"{delta / MB:.0f} (**{delta / total:.2f}×**; anon. {anon / MB:.0f})"

    def written(runs: list[dict[str, Any]]) -> str:
        folder = max(r["folder_bytes"] for r in runs)
        process = max(r["written"] for r in runs)
        files = max(r["folder_files"] for r in runs)
        return f"**{folder / MB:.0f}** in {files} files ({process / MB:.0f})"

    def latency(runs: list[dict[str, Any]]) -> str:
        off = [t for r in runs for t in r["forward"]["offload"]]
        ram = [t for r in runs for t in r["forward"]["ram"]]
        ratios = [
            a / b
            for r in runs
            for a, b in zip(r["forward"]["offload"], r["forward"]["ram"], strict=True)
        ]
        return f"{median(off) * 1e3:.0f} vs {median(ram) * 1e3:.0f} (**{median(ratios):.2f}×**)"

    rows = [
        (
            'load into RAM, `device_map={"": "cpu"}`: s (× raw)',
            per_impl(loads, lambda i, rs: vs_raw(median([r["seconds"] for r in rs]), raw_load, i)),
            "≤ 1.1× raw",
        ),
        (
            "load + first forward (time to first logits): s (× raw)",
            per_impl(
                loads,
                lambda i, rs: vs_raw(
                    median([r["seconds"] + r["first_forward"] for r in rs]), raw_first, i
                ),
            ),
            "",
        ),
        (
            "peak RSS over baseline, load + first forward: MB (× model size; anonymous MB)",
            per_impl(loads, lambda i, rs: rss(rs)),
            "≤ 1.1× model",
        ),
        (
            "all blocks on disk: load, s (× raw load into RAM)",
            per_impl(
                offloads, lambda i, rs: vs_raw(median([r["seconds"] for r in rs]), raw_load, i)
            ),
            "",
        ),
        (
            "all blocks on disk: MB written to the offload folder (process write_bytes, MB)",
            per_impl(offloads, lambda i, rs: written(rs)),
            "0",
        ),
        (
            f"all blocks on disk: forward 1×{BATCH[1]} tokens, ms, offloaded vs in RAM "
            "(median per-pair ratio)",
            per_impl(offloads, lambda i, rs: latency(rs)),
            "",
        ),
        (
            "all blocks on disk: peak RSS over baseline, load + first forward: MB "
            "(× model size; anonymous MB)",
            per_impl(offloads, lambda i, rs: rss(rs)),
            "",
        ),
    ]
    print()
    print(f"Command: `{command}`")
    print(
        f"Model: decoder, width {shape['width']}, {shape['blocks']} blocks, vocabulary "
        f"{shape['vocab']}, fp32, {total / MB:.0f} MB in {SHARDS} safetensors shards; "
        f"{len(loads['raw'])} worker(s) per library and measurement; medians."
    )
    print()
    print("| measurement | accel | Accelerate 1.15 | raw torch | goal |")
    print("|---|---|---|---|---|")
    for label, values, goal in rows:
        if values:
            print(f"| {label} | {cells(values)} | {goal} |")
    print()
    print("Ranges over the workers (seconds):")
    for impl, runs in loads.items():
        print(
            f"- {impl}: load {ranged([r['seconds'] for r in runs], '.3f')}, first forward "
            f"{ranged([r['first_forward'] for r in runs], '.3f')}"
        )
    for impl, runs in offloads.items():
        ratios = [
            a / b
            for r in runs
            for a, b in zip(r["forward"]["offload"], r["forward"]["ram"], strict=True)
        ]
        last = runs[-1]
        print(
            f"- {impl}, blocks on disk: load {ranged([r['seconds'] for r in runs], '.3f')}, "
            f"first forward {ranged([r['first_forward'] for r in runs], '.3f')}, "
            f"per-pair forward ratio {ranged(ratios, '.3f')}; after the first forward, over "
            f"baseline: RssAnon {(last['rss_anon_after'] - last['anon_baseline']) / MB:+.0f} MB, "
            f"RssFile {(last['rss_file_after'] - last['file_baseline']) / MB:+.0f} MB"
        )
    print()
    print(
        "Peak RSS: VmHWM of the worker, reset (/proc/self/clear_refs) after the imports and the "
        "meta model, minus the RSS at that moment; 'anonymous': peak RssAnon sampled every 5 ms "
        "minus its value then (file-backed pages of a memory-mapped checkpoint count in RSS "
        "but are the shared page cache). Every worker's logits have the SHA-1 of raw's, and "
        "each disk-offload worker checked its logits equal (torch.equal) to the in-RAM "
        "model's on every forward."
    )


def main() -> None:
    """Parse options, build the checkpoint, run the workers, print the report."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=None, help="fp32 weights, GB (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="workers per row (default 3)")
    parser.add_argument("--forwards", type=int, default=None, help="timed pairs (default 5)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="checkpoint cache (default: a temp-dir folder)"
    )
    parser.add_argument("--no-accelerate", action="store_true", help="skip Accelerate 1.15")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.1 GB, 1 repeat")
    parser.add_argument("--no-accel", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--offload", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    size_gb = args.size_gb if args.size_gb is not None else (0.1 if args.quick else 2.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    forwards = args.forwards if args.forwards is not None else (2 if args.quick else 5)
    if size_gb <= 0 or repeats < 1 or forwards < 1:
        parser.error("--size-gb, --repeats and --forwards must be positive")

    pythons = {"raw": sys.executable, "accel": sys.executable}
    if args.no_accel:
        del pythons["accel"]
    if not args.no_accelerate:
        ensure: Callable[[], Path] = importlib.import_module(
            "reference_venv"
        ).ensure_accelerate_venv
        pythons["accelerate"] = str(ensure())
    base = (
        args.dir if args.dir is not None else Path(tempfile.gettempdir()) / "accel-bench-bigmodel"
    )
    base.mkdir(parents=True, exist_ok=True)
    checkpoint, total, shape = ensure_checkpoint(base, size_gb)
    print(f"page cache warmed: {warm_page_cache(checkpoint):.1f} s", flush=True)

    loads: dict[str, list[dict[str, Any]]] = {impl: [] for impl in LOADS if impl in pythons}
    offloads: dict[str, list[dict[str, Any]]] = {impl: [] for impl in pythons if impl != "raw"}
    order = list(loads)
    for index in range(repeats):
        shift = index % len(order)
        for impl in order[shift:] + order[:shift]:
            result = run_worker(pythons[impl], f"load-{impl}", checkpoint, shape, [])
            loads[impl].append(result)
            print(f"load {impl}: {result['seconds']:.3f} s", flush=True)
    names = list(offloads)
    for index in range(repeats):
        for impl in names if index % 2 == 0 else names[::-1]:
            offload = Path(tempfile.mkdtemp(prefix="offload-", dir=base))
            shutil.rmtree(offload)  # the library creates it; an absent folder is also fine
            try:
                extra = ["--offload", str(offload), "--forwards", str(forwards)]
                result = run_worker(pythons[impl], f"offload-{impl}", checkpoint, shape, extra)
            finally:
                shutil.rmtree(offload, ignore_errors=True)
                os.sync()
            offloads[impl].append(result)
            print(f"offload {impl}: load {result['seconds']:.3f} s", flush=True)

    reference = loads["raw"][0]["digest"]
    for impl, runs in [*loads.items(), *offloads.items()]:
        for run in runs:
            if run["digest"] != reference:
                raise SystemExit(f"{impl}: logits differ from the raw-loaded model's")
    command = "python tools/bench/bigmodel.py " + " ".join(sys.argv[1:])
    report(loads, offloads, total, shape, command.strip())


if __name__ == "__main__":
    main()
