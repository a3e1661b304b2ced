"""Benchmark: a CPU-offloaded decoder on one GPU, accel's prefetching vs Accelerate 1.15.

On a GPU machine (one command, a few minutes; no network needed: torch and safetensors are
taken from the machine, accel-state and accel-bigmodel from this repository's sources when
they are not installed):

    python3 tools/bench/offload_gpu.py --out $OUT/offload_gpu.json

(equivalently, after `pip install -e packages/accel-state -e packages/accel-bigmodel`). On a
machine without CUDA, `--dry-run` runs the same code path on the CPU with a tiny model (CI):

    python tools/bench/offload_gpu.py --dry-run

What it does. tools/examples/decoder.py's decoder (width `--width` 4096, `--blocks` 8 blocks
of 805 MB, vocabulary 4096, fp32: 6.6 GB), seeded, written once as 5 safetensors shards under
`--dir` (default: a folder in the system temp dir). The device map comes from accel's
`infer_auto_device_map(model, max_memory={0: budget, "cpu": ...}, no_split_module_classes=
["Block"])` with `--gpu-budget-gb` (default 2): the model is larger than the budget, so most
blocks are placed on "cpu" and are copied to the GPU at every forward. The same map is given to
every library. Each measurement runs in a fresh worker process:

- copy: torch's host-to-device bandwidth, a pinned host tensor of the largest block's size
  copied to the GPU 10 times after 3 warm-ups (CUDA events), and the same from pageable memory;
- resident: the whole model on the GPU (`device_map={"": 0}`): the compute-only forward time
  and the reference logits;
- accel at each `--depths` prefetch depth (default 0, 1, 2; 0 = synchronous) and Accelerate
  1.15 when `import accelerate` works in this interpreter (else "not measured"):
  `load_checkpoint_and_dispatch(model, folder, device_map=plan[, prefetch_depth=d])` on an
  `init_empty_weights()` model, 2 warm-up forwards, then `--forwards` timed forwards of a batch
  of 1 x `--tokens` token ids (default 64), each between two `torch.cuda.synchronize()`.

Reported: median forward latency; tokens/s (tokens / latency) and its ratio to Accelerate's;
achieved H2D bandwidth = bytes of the "cpu"-placed weights / latency, against the pinned-copy
bandwidth; the bound max(resident forward, offloaded bytes / pinned bandwidth); peak GPU memory
allocated; whether the logits equal the resident model's (the run fails when an accel forward
is off by more than 1e-3 relative). Goals (accel issue 9): tokens/s >= 2x Accelerate's, achieved
H2D >= 70% of the pinned-copy bandwidth. Prints a Markdown table; `--out` also writes JSON.

`--dry-run`: the same workers on the CPU (no CUDA): tiny model (width 128, 6 blocks,
vocabulary 512), a
"cpu" budget instead of a GPU one, so the overflow goes to "disk" (blocks placed on "cpu"
are not offloaded when the forward runs on the CPU), and a plain tensor copy instead of the
pinned one.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if importlib.util.find_spec("accel_bigmodel") is None:  # not installed: the repository's sources
    for dist in ("accel-state", "accel-bigmodel"):
        sys.path.insert(1, str(ROOT / "packages" / dist / "src"))
from tools.examples.decoder import VOCAB, Decoder, write_checkpoint  # noqa: E402

SEED = 0
SHARDS = 5
MB = 1_000_000
GB = 1_000_000_000
STAMP = "bench-config.json"
ACCURACY = 1e-3


# ---------------------------------------------------------------------------------------------
# Shared
# ---------------------------------------------------------------------------------------------


def make_model(shape: dict[str, int]) -> Decoder:
    return Decoder(shape["width"], shape["blocks"], shape["vocab"])


def ensure_checkpoint(base: Path, shape: dict[str, int]) -> Path:
    """The checkpoint folder for ``shape``, written on first use."""
    folder = base / f"decoder-w{shape['width']}-b{shape['blocks']}"
    wanted = {"seed": SEED, "shards": SHARDS, **shape}
    try:
        if json.loads((folder / STAMP).read_text(encoding="utf-8")) == wanted:
            return folder
    except (OSError, ValueError):
        pass
    print(f"writing the checkpoint to {folder} ...", flush=True)
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=base))
    try:
        write_checkpoint(staging, shape["width"], shape["blocks"], SHARDS, SEED, shape["vocab"])
        (staging / STAMP).write_text(json.dumps(wanted) + "\n", encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"  written in {time.perf_counter() - start:.1f} s", flush=True)
    return folder


def plan(shape: dict[str, int], budget: int, dry_run: bool) -> dict[str, Any]:
    """accel's device map under the budget, and the bytes it offloads."""
    from accel_bigmodel import infer_auto_device_map

    with torch.device("meta"):
        model = make_model(shape)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    max_memory: dict[int | str, int] = {"cpu": budget} if dry_run else {0: budget, "cpu": 4 * total}
    device_map = dict(
        infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=["Block"])
    )
    tier = "disk" if dry_run else "cpu"
    offloaded = 0
    for name, tensor in model.state_dict().items():
        owner = max((k for k in device_map if k == "" or name.startswith(k + ".")), key=len)
        if device_map[owner] == tier:
            offloaded += tensor.numel() * tensor.element_size()
    largest = max(
        sum(t.numel() * t.element_size() for t in block.state_dict().values())
        for block in model.blocks
    )
    return {
        "device_map": device_map,
        "total": total,
        "offloaded": offloaded,
        "tier": tier,
        "largest_block": largest,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def token_ids(tokens: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, vocab, (1, tokens), generator=generator).to(device)


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


def copy_worker(nbytes: int, device: torch.device) -> dict[str, Any]:
    """Host-to-device bandwidth of pinned and pageable memory, bytes per second."""
    results: dict[str, Any] = {"bytes": nbytes}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kinds = ("pinned", "pageable") if device.type == "cuda" else ("pageable",)
    for kind in kinds:
        source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        for _ in range(3):
            target.copy_(source, non_blocking=True)
        sync(device)
        repeats = 10
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(repeats):
                target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            for _ in range(repeats):
                target.copy_(source)
            seconds = time.perf_counter() - start
        results[kind] = repeats * nbytes / seconds
        del source
    if "pinned" not in results:  # dry run: no pinned memory without CUDA
        results["pinned"] = results["pageable"]
    return results


def timed_forwards(
    model: nn.Module, ids: torch.Tensor, device: torch.device, forwards: int
) -> tuple[list[float], torch.Tensor]:
    with torch.inference_mode():
        for _ in range(2):
            logits = model(ids)
        sync(device)
        times = []
        for _ in range(forwards):
            sync(device)
            start = time.perf_counter()
            logits = model(ids)
            sync(device)
            times.append(time.perf_counter() - start)
    return times, logits.float().cpu()


def load_worker(
    impl: str,
    depth: int,
    checkpoint: Path,
    shape: dict[str, int],
    device_map: dict[str, Any],
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Load with ``device_map`` (``None``: all on ``device``), time forwards, compare logits."""
    module = importlib.import_module("accelerate" if impl == "accelerate" else "accel_bigmodel")
    with module.init_empty_weights():
        model = make_model(shape)
    load = module.load_checkpoint_and_dispatch
    options: dict[str, Any] = {}
    if impl == "accel" and depth >= 0:
        if "prefetch_depth" in inspect.signature(load).parameters:
            options["prefetch_depth"] = depth
        elif depth != 0:
            raise SystemExit(f"this accel_bigmodel has no prefetch_depth (asked for {depth})")
    if "disk" in device_map.values():
        options["offload_folder"] = str(args.offload)
    gc.collect()
    start = time.perf_counter()
    load(model, str(checkpoint), device_map=device_map, **options)
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, logits = timed_forwards(
        model, token_ids(args.tokens, shape["vocab"], device), device, args.forwards
    )
    result: dict[str, Any] = {"load": seconds, "forward": times, "peak": peak_memory(device)}
    reference_file = args.offload.parent / "reference.pt"
    if depth < 0:
        torch.save(logits, reference_file)
        result["max_diff"] = 0.0
    else:
        reference = torch.load(reference_file)
        result["equal"] = bool(torch.equal(logits, reference))
        result["max_diff"] = float((logits - reference).abs().max())
        scale = float(reference.abs().max())
        if impl == "accel" and result["max_diff"] > ACCURACY * scale:
            raise SystemExit(
                f"accel prefetch_depth={depth}: logits differ from the resident model's "
                f"(max {result['max_diff']:.3g}, scale {scale:.3g})"
            )
    return result


def worker(args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    kind, impl, depth = args.worker.split(":")
    if kind == "copy":
        result = copy_worker(int(depth), device)
    else:
        shape = json.loads(args.shape)
        device_map = {"": str(device)} if kind == "resident" else json.loads(args.device_map)
        result = load_worker(impl, int(depth), args.checkpoint, shape, device_map, device, args)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not measured"
        return False
    return True


def run_worker(name: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, *extra]
    command += ["--forwards", str(args.forwards), "--tokens", str(args.tokens)]
    if args.dry_run:
        command.append("--dry-run")
    env = dict(os.environ)
    if args.dry_run:
        env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def report(results: dict[str, Any], command: str) -> None:
    """Print the Markdown table."""
    copy, layout = results["copy"], results["plan"]
    offloaded, pinned = layout["offloaded"], copy["pinned"]
    resident = statistics.median(results["resident"]["forward"])
    runs: dict[str, dict[str, Any] | None] = results["runs"]
    accelerate = runs.get("accelerate:0")
    tokens = results["tokens"]

    def name(key: str) -> str:
        return "Accelerate 1.15" if key == "accelerate:0" else f"accel, depth {key.split(':')[1]}"

    def cell(key: str, field: str) -> str:
        run = runs[key]
        if run is None:
            return "not measured (no `import accelerate`)"
        latency = statistics.median(run["forward"])
        if field == "latency":
            return f"{latency * 1e3:.1f}"
        if field == "tokens":
            text = f"{tokens / latency:.0f}"
            if accelerate is not None and key != "accelerate:0":
                text += f" (**{statistics.median(accelerate['forward']) / latency:.2f}×**)"
            return text
        if field == "h2d":
            achieved = offloaded / latency
            return f"{achieved / GB:.1f} (**{achieved / pinned:.0%}**)"
        if field == "bound":
            return f"{latency / max(resident, offloaded / pinned):.2f}×"
        if field == "peak":
            return f"{run['peak'] / GB:.2f}"
        if field == "load":
            return f"{run['load']:.2f}"
        return "yes" if run["equal"] else f"no (max diff {run['max_diff']:.2g})"

    keys = list(runs)
    rows = [
        ("load call, s", "load", ""),
        (f"forward, 1×{tokens} tokens, ms (median)", "latency", ""),
        ("tokens/s (× Accelerate)", "tokens", "≥ 2×"),
        ("achieved H2D GB/s (% of pinned-copy bandwidth)", "h2d", "≥ 70%"),
        ("forward ÷ max(resident forward, bytes ÷ pinned bandwidth)", "bound", ""),
        ("peak GPU memory allocated, GB", "peak", ""),
        ("logits equal to the resident model's", "equal", ""),
    ]
    device_map = layout["device_map"]
    counts: dict[str, int] = {}
    for device in device_map.values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    print()
    print(f"Command: `{command}`")
    print(
        f"Device: {results['device']}. Model: decoder, width {results['shape']['width']}, "
        f"{results['shape']['blocks']} blocks, fp32, {layout['total'] / MB:.0f} MB; budget "
        f"{results['budget'] / MB:.0f} MB; map entries per device {counts}; "
        f"{offloaded / MB:.0f} MB placed on {layout['tier']!r} (moved every forward)."
    )
    pageable = copy.get("pageable", 0.0)
    print(
        f"Pinned-copy bandwidth {pinned / GB:.1f} GB/s (pageable {pageable / GB:.1f} GB/s) on "
        f"{copy['bytes'] / MB:.0f} MB copies; resident forward {resident * 1e3:.1f} ms; "
        f"bound max(resident, bytes ÷ pinned) = {max(resident, offloaded / pinned) * 1e3:.1f} ms."
    )
    print()
    print("| measurement | " + " | ".join(name(k) for k in keys) + " | goal |")
    print("|---|" + "---|" * len(keys) + "---|")
    for text, field, goal in rows:
        print(f"| {text} | " + " | ".join(cell(k, field) for k in keys) + f" | {goal} |")


def main() -> None:
    """Parse options, write the checkpoint, run the workers, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model (CI)")
    parser.add_argument("--width", type=int, default=None, help="default 4096 (dry run: 128)")
    parser.add_argument("--blocks", type=int, default=None, help="default 8 (dry run: 6)")
    parser.add_argument("--gpu-budget-gb", type=float, default=None, help="default 2")
    parser.add_argument("--tokens", type=int, default=64, help="batch 1 x TOKENS (default 64)")
    parser.add_argument("--forwards", type=int, default=None, help="timed (default 10)")
    parser.add_argument("--depths", default="0,1,2", help="accel prefetch depths")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint cache folder")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--device-map", help=argparse.SUPPRESS)
    parser.add_argument("--offload", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    width = args.width if args.width is not None else (128 if dry else 4096)
    blocks = args.blocks if args.blocks is not None else (6 if dry else 8)
    budget_gb = args.gpu_budget_gb if args.gpu_budget_gb is not None else (0.002 if dry else 2.0)
    args.forwards = args.forwards if args.forwards is not None else (2 if dry else 10)
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--depths takes comma-separated integers, not {args.depths!r}")
    if any(d < 0 for d in depths) or min(width, blocks, args.tokens, args.forwards) < 1:
        parser.error("depths must be >= 0; width, blocks, tokens and forwards positive")
    shape = {"width": width, "blocks": blocks, "vocab": 512 if dry else VOCAB}
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir()) / "accel-bench-gpu"
    base.mkdir(parents=True, exist_ok=True)
    checkpoint = ensure_checkpoint(base, shape)
    layout = plan(shape, int(budget_gb * GB), dry)
    if layout["offloaded"] == 0:
        raise SystemExit(f"the model fits the budget ({budget_gb} GB): nothing is offloaded")
    device = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    print(f"device map: {json.dumps(layout['device_map'])}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="offload-gpu-", dir=base))
    try:
        common = ["--checkpoint", str(checkpoint), "--shape", json.dumps(shape)]
        common += ["--device-map", json.dumps(layout["device_map"])]
        common += ["--offload", str(work / "offload")]
        copy = run_worker(f"copy:torch:{layout['largest_block']}", args, [])
        print(f"copy: pinned {copy['pinned'] / GB:.1f} GB/s", flush=True)
        resident = run_worker("resident:accel:-1", args, common)
        print(f"resident: forward {statistics.median(resident['forward']):.4f} s", flush=True)
        runs: dict[str, dict[str, Any] | None] = {}
        for depth in depths:
            runs[f"accel:{depth}"] = run_worker(f"offload:accel:{depth}", args, common)
            shutil.rmtree(work / "offload", ignore_errors=True)
        runs["accelerate:0"] = (
            run_worker("offload:accelerate:0", args, common) if importable("accelerate") else None
        )
        for key, run in runs.items():
            if run is not None:
                print(f"{key}: forward {statistics.median(run['forward']):.4f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    accelerate = importable("accelerate")
    results = {
        "device": device,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "accelerate": importlib.metadata.version("accelerate") if accelerate else None,
        },
        "shape": shape,
        "budget": int(budget_gb * GB),
        "tokens": args.tokens,
        "forwards": args.forwards,
        "plan": layout,
        "copy": copy,
        "resident": resident,
        "runs": runs,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    report(results, ("python tools/bench/offload_gpu.py " + " ".join(sys.argv[1:])).strip())


if __name__ == "__main__":
    main()
