"""Run a decoder that does not fit its memory budget: some blocks stay on disk.

    python tools/examples/bigmodel_offload.py                  # ~300 MB model, 150 MB for cpu
    python tools/examples/bigmodel_offload.py --size-mb 40 --dir /tmp/demo

On the first run the script writes a GPT-like decoder checkpoint (seeded random fp32 weights,
4 safetensors shards + ``model.safetensors.index.json``) into ``.cache/bigmodel-demo/`` of the
repository (or ``--dir``); later runs reuse it. Then, as a user with a large model would:

1. build the model under ``init_empty_weights()`` (no memory used: every weight is on "meta");
2. ``load_checkpoint_and_dispatch(model, folder, device_map="auto", max_memory={"cpu": budget},
   no_split_module_classes=["Block"], offload_folder=...)``: the planner fills the cpu budget
   block by block and sends the rest to "disk". For a safetensors checkpoint nothing is
   written: disk-mapped weights are read in place from the checkpoint files;
3. run one forward on a fixed batch of token ids.

It prints the device map, the load time, the peak memory, the bytes written to the offload
folder, and checks the logits against the same model loaded whole into RAM (``torch.equal``).
Exit status 0 only if the map puts blocks on both cpu and disk and the logits are identical.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from decoder import INDEX, VOCAB, Decoder, fp32_bytes, write_checkpoint  # tools/examples/decoder.py
from safetensors.torch import load_file

from accel_bigmodel import init_empty_weights, load_checkpoint_and_dispatch

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
SHARDS = 4
MB = 1_000_000


def shape_for(size_mb: float) -> tuple[int, int]:
    """(width, blocks) whose fp32 weights come closest to ``size_mb`` MB, at least 4 blocks."""
    width = 768 if size_mb >= 200 else 256
    block, outside = fp32_bytes(width)
    return width, max(4, round((size_mb * MB - outside) / block))


def ensure_checkpoint(base: Path, width: int, blocks: int) -> Path:
    """The checkpoint folder for this shape, written on first use (atomically: rename)."""
    folder = base / f"decoder-w{width}-b{blocks}-seed{SEED}"
    if (folder / INDEX).exists():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=base))
    try:
        start = time.perf_counter()
        write_checkpoint(staging, width, blocks, SHARDS, SEED)
        staging.rename(folder)
        print(f"wrote the checkpoint in {time.perf_counter() - start:.1f} s: {folder}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def status_kb(field: str) -> int | None:
    """A field of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory() -> bool:
    """Reset the peak RSS to the current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def peak_memory_mb() -> float:
    """Peak RSS in MB: since the last reset on Linux (VmHWM), else for the process's lifetime."""
    peak = status_kb("VmHWM")
    if peak is None:  # ru_maxrss: KiB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / MB
    return peak * 1024 / MB


def folder_bytes(folder: Path) -> tuple[int, int]:
    """(bytes, files) below ``folder``; (0, 0) when it does not exist."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return sum(p.stat().st_size for p in files), len(files)


def describe(device_map: dict[str, object], sizes: dict[str, int]) -> list[str]:
    """Counts and MB per device, then the map with runs of blocks on one device merged."""
    per_device: dict[str, list[str]] = {}
    for name, device in device_map.items():
        per_device.setdefault(str(device), []).append(name)
    summary = ", ".join(
        f"{device} {len(names)} ({sum(sizes[n] for n in names) / MB:.0f} MB)"
        for device, names in per_device.items()
    )
    lines = [f"device map: {len(device_map)} entries; {summary}"]
    items = list(device_map.items())
    start = 0
    while start < len(items):
        end = start
        while (
            end + 1 < len(items)
            and items[end + 1][1] == items[start][1]
            and items[end + 1][0].startswith("blocks.")
            and items[start][0].startswith("blocks.")
        ):
            end += 1
        label = items[start][0] if end == start else f"{items[start][0]} ... {items[end][0]}"
        lines.append(f"  {label:<24} {items[start][1]}")
        start = end + 1
    return lines


def main(argv: list[str] | None = None) -> int:
    """Build, load under the budget, run, compare; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300, help="fp32 weights, MB")
    parser.add_argument(
        "--cpu-budget-mb", type=float, default=None, help="max_memory for cpu (default: half)"
    )
    parser.add_argument(
        "--dir", type=Path, default=ROOT / ".cache" / "bigmodel-demo", help="checkpoint cache"
    )
    args = parser.parse_args(argv)
    if args.size_mb <= 0:
        parser.error(f"--size-mb must be positive, got {args.size_mb}")
    budget_mb = args.cpu_budget_mb if args.cpu_budget_mb is not None else args.size_mb / 2
    torch.set_num_threads(1)
    width, blocks = shape_for(args.size_mb)
    checkpoint = ensure_checkpoint(args.dir, width, blocks)
    offload = args.dir / "offload"
    shutil.rmtree(offload, ignore_errors=True)
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(SEED + 1))

    with init_empty_weights():  # accel
        model = Decoder(width, blocks)
    sizes = {n: sum(4 * p.numel() for p in m.parameters()) for n, m in model.named_modules()}
    print(
        f"model: decoder, width {width}, {blocks} blocks, {sizes[''] / MB:.0f} MB fp32 in "
        f"{SHARDS} safetensors shards; cpu budget {budget_mb:.0f} MB"
    )
    exact_peak = reset_peak_memory()
    rss_before = status_kb("VmRSS")
    anon_before = status_kb("RssAnon")
    start = time.perf_counter()
    load_checkpoint_and_dispatch(  # accel
        model,
        str(checkpoint),
        device_map="auto",
        max_memory={"cpu": f"{budget_mb:.0f}MB"},
        no_split_module_classes=["Block"],
        offload_folder=str(offload),
    )
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids)
    forward_s = time.perf_counter() - start
    peak_mb = peak_memory_mb()
    anon_after = status_kb("RssAnon")
    written, files = folder_bytes(offload)

    device_map: dict[str, object] = dict(model.hf_device_map)  # type: ignore[arg-type]
    for line in describe(device_map, sizes):
        print(line)
    print(
        f"load_checkpoint_and_dispatch: {load_s:.2f} s; first forward (1x32 tokens): "
        f"{forward_s:.2f} s"
    )
    if exact_peak and rss_before is not None:
        print(
            f"peak memory (RSS) during load + forward: {peak_mb:.0f} MB, "
            f"{peak_mb - rss_before * 1024 / MB:+.0f} MB over the {rss_before * 1024 / MB:.0f} MB "
            "before loading"
        )
    if anon_before is not None and anon_after is not None:
        print(
            f"  of which the process's own memory (RssAnon) after the forward: "
            f"{(anon_after - anon_before) * 1024 / MB:+.0f} MB; the rest are pages of the "
            "memory-mapped checkpoint files (page cache, shared, reclaimable)"
        )
    else:
        print(f"peak memory (ru_maxrss, whole process): {peak_mb:.0f} MB")
    print(f"written to the offload folder: {written} bytes in {files} files")

    with torch.device("meta"):
        plain = Decoder(width, blocks)
    index = json.loads((checkpoint / INDEX).read_text(encoding="utf-8"))
    for shard in dict.fromkeys(index["weight_map"].values()):
        plain.load_state_dict(load_file(str(checkpoint / shard)), assign=True, strict=False)
    with torch.inference_mode():
        expected = plain(ids)
    same = torch.equal(logits, expected)
    print(
        f"forward: logits {tuple(logits.shape)}, next tokens {logits[0, -4:].argmax(-1).tolist()};"
        f" identical to the in-RAM model: {'yes' if same else 'NO'}"
    )
    shutil.rmtree(offload, ignore_errors=True)
    devices = {str(d) for d in device_map.values()}
    if not same:
        print("FAILED: the dispatched model's logits differ from the in-RAM model's")
        return 1
    if not {"cpu", "disk"} <= devices:
        print(f"FAILED: expected blocks on both cpu and disk, got {sorted(devices)}")
        return 1
    print("big-model demo: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
