"""Disk tier: how fast a forward reads the weights it finds on "disk", against a plain read.

    python tools/bench/disk_read.py [--device cuda|cpu] [--width 2048] [--blocks 4]
                                    [--tokens 16] [--dir DIR] [--out FILE] [--dry-run]

Part of tools/gpu_check.py (accel issue 30); it runs alone too, on a GPU or on the CPU. Linux
only (posix_fadvise, mincore, /proc/self/io). accel-bigmodel comes from this interpreter
(installed, or the repository's sources).

Model: tools/examples/decoder.py's decoder (width `--width`, default 2048; `--blocks` blocks,
default 4, 201 MB each in fp32; vocabulary 4096), seeded, written once as 5 safetensors shards
under `--dir` (default: accel-bench-gpu in the system temp dir; give a folder on the disk to
measure: a tmpfs cannot drop its pages). Device map: embedding, final norm and lm_head on the
compute device (`cuda:0`, or the CPU), every block on "disk", which accel reads in place from
the shards. `load_checkpoint_and_dispatch` with the library's default prefetching, a warm-up
forward of batch 1 x `--tokens` token ids (one-time setup and the reference logits); then:

1. the blocks' byte ranges in the shards are dropped from the page cache (the process's own
   mappings zapped with madvise, then posix_fadvise(POSIX_FADV_DONTNEED); mincore checks that
   at most 5% stays, as in tools/bench/offload.py), and one forward is timed (device
   synchronised): its read throughput is the blocks' bytes / its time (the bytes the process
   read from storage, /proc/self/io, are reported beside them); its logits must equal the
   warm-up's;
2. a warm forward (weights in the page cache) is timed, for the compute and copy share;
3. the same ranges are dropped again and read sequentially with one 16 MB buffer: the disk's
   plain read bandwidth; with `dd` on PATH, the shard files, dropped once more, are also read
   with `dd if=FILE of=/dev/null bs=16M`.

Reported: the forward's read throughput ÷ the plain read's (goal, accel issue 30: >= 0.80).
`--dry-run`: a tiny model (width 256) on the CPU. `--out` writes JSON; a Markdown table is
printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.bench.offload import (  # noqa: E402
    PageCache,
    block_ranges,
    io_counter,
    plain_read,
    range_bytes,
    whole_files,
)
from tools.bench.offload_gpu import ensure_checkpoint, make_model, token_ids  # noqa: E402

MB = 1_000_000
GOAL = 0.80


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    sync(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids)
    sync(ids.device)
    return logits.float().cpu(), time.perf_counter() - start


def dd_read(cache: PageCache, files: list[Path]) -> float | None:
    """Bytes per second of ``dd`` over the files after dropping them; None without dd."""
    dd = shutil.which("dd")
    if dd is None:
        return None
    cache.drop_checked(whole_files(files))
    start = time.perf_counter()
    for path in files:
        command = [dd, f"if={path}", "of=/dev/null", "bs=16M"]
        subprocess.run(command, check=True, capture_output=True)
    return sum(p.stat().st_size for p in files) / (time.perf_counter() - start)


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Load with the blocks on disk, time a cold and a warm forward, then the plain reads."""
    from accel_bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    shape = {"width": args.width, "blocks": args.blocks, "vocab": 512 if args.dry_run else 4096}
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir()) / "accel-bench-gpu"
    base.mkdir(parents=True, exist_ok=True)
    checkpoint = ensure_checkpoint(base, shape)
    place: int | str = 0 if device.type == "cuda" else "cpu"
    device_map: dict[str, int | str] = {"embed": place, "norm": place, "lm_head": place}
    device_map.update({f"blocks.{i}": "disk" for i in range(args.blocks)})
    ranges = block_ranges(checkpoint, tuple(f"blocks.{i}." for i in range(args.blocks)))
    cache = PageCache()
    with init_empty_weights():
        model = make_model(shape)
    offload = Path(tempfile.mkdtemp(prefix="disk-offload-", dir=base))
    try:
        load_checkpoint_and_dispatch(
            model, str(checkpoint), device_map=device_map, offload_folder=str(offload)
        )
        ids = token_ids(args.tokens, shape["vocab"], device)
        reference, warmup = timed_forward(model, ids)
        left = cache.drop_checked(ranges)
        before = io_counter("read_bytes")
        cold_logits, cold = timed_forward(model, ids)
        read = io_counter("read_bytes") - before if before >= 0 else -1
        warm_logits, warm = timed_forward(model, ids)
        left = max(left, cache.drop_checked(ranges))
        plain_bytes, plain_seconds = plain_read(ranges)
        dd = dd_read(cache, sorted(Path(p) for p in ranges))
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    needed = range_bytes(ranges)
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "shape": shape,
        "tokens": args.tokens,
        "bytes": needed,
        "read_bytes": read,
        "resident_after_drop": left,
        "warmup_forward": warmup,
        "cold_forward": cold,
        "warm_forward": warm,
        "forward_bandwidth": needed / cold,
        "plain_bandwidth": plain_bytes / plain_seconds,
        "dd_bandwidth": dd,
        "ratio": (needed / cold) / (plain_bytes / plain_seconds),
        "logits_equal": bool(
            torch.equal(cold_logits, reference) and torch.equal(warm_logits, reference)
        ),
    }


def report(result: dict[str, Any], command: str) -> None:
    dd = result["dd_bandwidth"]
    shape = result["shape"]
    print()
    print(
        f"Device: {result['device']}. Decoder width {shape['width']}, {shape['blocks']} blocks "
        f"on disk ({result['bytes'] / MB:.0f} MB); batch 1 x {result['tokens']} tokens."
    )
    print()
    rows = [
        (
            "cold forward, s (warm forward, s)",
            f"{result['cold_forward']:.3f} ({result['warm_forward']:.3f})",
            "",
        ),
        (
            "cold forward read throughput, MB/s (MB read from storage)",
            f"{result['forward_bandwidth'] / MB:.0f} ({result['read_bytes'] / MB:.0f})",
            "",
        ),
        (
            "plain sequential read of the same ranges, MB/s",
            f"{result['plain_bandwidth'] / MB:.0f}",
            "",
        ),
        ("`dd bs=16M` of the shard files, MB/s", f"{dd / MB:.0f}" if dd else "no `dd` on PATH", ""),
        ("forward ÷ plain read", f"**{result['ratio']:.2f}**", f"≥ {GOAL:.2f}"),
        (
            "cold and warm logits equal to the warm-up's",
            "yes" if result["logits_equal"] else "**no**",
            "yes",
        ),
    ]
    print("| measurement | value | goal |")
    print("|---|---|---|")
    for label, value, goal in rows:
        print(f"| {label} | {value} | {goal} |")
    print()
    print(f"Command: `{command}`")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (CI)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any"
    )
    parser.add_argument("--width", type=int, default=None, help="default 2048 (dry run: 256)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint folder (on the disk)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if not PageCache.available():
        raise SystemExit("disk_read: needs Linux (posix_fadvise, mincore)")
    wanted = args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.width = args.width if args.width is not None else (256 if args.dry_run else 2048)
    if min(args.width, args.blocks, args.tokens) < 1 or args.width % 64:
        parser.error("--width must be a positive multiple of 64; --blocks and --tokens positive")
    device = torch.device("cuda:0" if wanted == "cuda" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = measure(args, device)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report(result, ("python tools/bench/disk_read.py " + " ".join(sys.argv[1:])).strip())
    if not result["logits_equal"]:
        raise SystemExit("disk_read: the cold forward's logits differ from the warm-up's")


if __name__ == "__main__":
    main()
