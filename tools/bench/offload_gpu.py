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
  1.15 when `import accelerate` works in this interpreter (else, or with `--no-accelerate`,
  "not measured"):
  `load_checkpoint_and_dispatch(model, folder, device_map=plan[, prefetch_depth=d])` on an
  `init_empty_weights()` model; then, for each batch size of `--batch` (default 1), 2 warm-up
  forwards and `--forwards` timed forwards of batch x `--tokens` token ids (default 64), each
  between two `torch.cuda.synchronize()`;
- accel at the deepest depth once more for each host staging of `--staging` other than
  `auto` (`register`: the CPU weights page-locked in place; `ring`: copied through a pinned
  ring), chosen with the environment variable ACCEL_OFFLOAD_STAGING in the worker;
- with `--busy N`, accel at the deepest depth once more while N processes spin on the CPU (a
  busy machine): its tokens/s against the idle run's.

Reported: median forward latency; tokens/s (batch x tokens / latency) at each batch size and
its ratio to Accelerate's; achieved H2D bandwidth = bytes of the "cpu"-placed weights /
latency at the first batch size, against the pinned-copy bandwidth; the bound max(resident
forward, offloaded bytes / pinned bandwidth); peak GPU memory allocated; whether the logits
equal the resident model's (the run fails when an accel forward is off by more than 1e-3
relative); busy ÷ idle tokens/s. Goals: tokens/s >= 2x Accelerate's (accel issue 9); achieved
H2D >= 85% of the pinned-copy bandwidth at batch 1, where the forward is transfer-bound,
tokens/s growing with the batch until compute-bound, busy ÷ idle >= 0.70 (accel issue 30).
Prints a Markdown table; `--out` also writes JSON.

`--dry-run`: the same workers on the CPU (no CUDA): tiny model (width 128, 6 blocks,
vocabulary 512), a
"cpu" budget instead of a GPU one, so the overflow goes to "disk" (blocks placed on "cpu"
are not offloaded when the forward runs on the CPU), and a plain tensor copy instead of the
pinned one.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
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
STAGINGS = ("auto", "register", "ring")


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


def token_ids(tokens: int, vocab: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, vocab, (batch, tokens), generator=generator).to(device)


def parse_ints(text: str, option: str, parser: argparse.ArgumentParser) -> list[int]:
    """A comma-separated list of integers (argparse error naming ``option`` otherwise)."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values:
        parser.error(f"{option} takes comma-separated integers, not {text!r}")
    return values


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
    batches: dict[str, dict[str, Any]] = {}
    for batch in args.batches:
        ids = token_ids(args.tokens, shape["vocab"], device, batch)
        times, logits = timed_forwards(model, ids, device, args.forwards)
        batches[str(batch)] = {"forward": times, **compare(logits, batch, impl, depth, args)}
    first = batches[str(args.batches[0])]
    result: dict[str, Any] = {"load": seconds, "peak": peak_memory(device), **first}
    result["batches"] = batches
    result["staging"] = staging_report(model)
    return result


def staging_report(model: nn.Module) -> dict[str, Any]:
    """accel's record of how the offloaded weights reached the GPU (bytes by route)."""
    for submodule in model.modules():
        hook = getattr(submodule, "_hf_hook", None)
        report = getattr(getattr(hook, "materializer", None), "staging_report", None)
        if callable(report):
            return dict(report())
    return {}


def compare(
    logits: torch.Tensor, batch: int, impl: str, depth: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Save the resident model's logits (``depth`` < 0) or compare with them."""
    reference_file = args.offload.parent / f"reference-b{batch}.pt"
    if depth < 0:
        torch.save(logits, reference_file)
        return {"equal": True, "max_diff": 0.0}
    reference = torch.load(reference_file)
    result = {
        "equal": bool(torch.equal(logits, reference)),
        "max_diff": float((logits - reference).abs().max()),
    }
    scale = float(reference.abs().max())
    if impl == "accel" and result["max_diff"] > ACCURACY * scale:
        raise SystemExit(
            f"accel prefetch_depth={depth}, batch {batch}: logits differ from the resident "
            f"model's (max {result['max_diff']:.3g}, scale {scale:.3g})"
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


def run_worker(
    name: str, args: argparse.Namespace, extra: list[str], staging: str = "auto"
) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, *extra]
    command += ["--forwards", str(args.forwards), "--tokens", str(args.tokens)]
    command += ["--batch", ",".join(str(b) for b in args.batches)]
    if args.dry_run:
        command.append("--dry-run")
    env = dict(os.environ)
    if args.dry_run:
        env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    env.pop("ACCEL_OFFLOAD_STAGING", None)
    if staging != "auto":
        env["ACCEL_OFFLOAD_STAGING"] = staging
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


@contextlib.contextmanager
def busy_cpu(processes: int) -> Iterator[None]:
    """``processes`` Python processes spinning on the CPU while the block runs."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def label(key: str) -> str:
    """The column title of a run key (``accel:2``, ``accel:2:ring``, ``accel:2:busy8``, ...)."""
    if key.startswith("accelerate"):
        return "Accelerate 1.15"
    parts = key.split(":")
    text = f"accel, depth {parts[1]}"
    if len(parts) > 2 and parts[2].startswith("busy"):
        return text + f", CPU busy ({parts[2][4:]} spinning processes)"
    return text + (f", staging {parts[2]}" if len(parts) > 2 else "")


def report(results: dict[str, Any], command: str) -> None:
    """Print the Markdown table."""
    copy, layout = results["copy"], results["plan"]
    offloaded, pinned = layout["offloaded"], copy["pinned"]
    resident = statistics.median(results["resident"]["forward"])
    runs: dict[str, dict[str, Any] | None] = results["runs"]
    accelerate = runs.get("accelerate:0")
    tokens = results["tokens"]
    batches = [int(b) for b in results.get("batches", [1])]

    def cell(key: str, field: str) -> str:
        run = runs[key]
        if run is None:
            return "not measured"
        latency = statistics.median(run["forward"])
        if field == "latency":
            return f"{latency * 1e3:.1f}"
        if field.startswith("tokens"):
            batch = field[6:] or str(batches[0])
            latency = statistics.median(run["batches"][batch]["forward"])
            text = f"{int(batch) * tokens / latency:.0f}"
            if accelerate is not None and key != "accelerate:0":
                theirs = statistics.median(accelerate["batches"][batch]["forward"])
                text += f" (**{theirs / latency:.2f}×**)"
            return text
        if field == "busy":
            idle = runs.get(key.rsplit(":", 1)[0]) if ":busy" in key else None
            if idle is None:
                return ""
            return f"**{statistics.median(idle['forward']) / latency:.2f}**"
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
        (f"forward, {batches[0]}×{tokens} tokens, ms (median)", "latency", ""),
        (f"tokens/s, batch {batches[0]} (× Accelerate)", "tokens", "≥ 2×"),
        *(
            (f"tokens/s, batch {batch} (× Accelerate)", f"tokens{batch}", "grows with the batch")
            for batch in batches[1:]
        ),
        ("achieved H2D GB/s (% of pinned-copy bandwidth)", "h2d", "≥ 85% at batch 1"),
        ("forward ÷ max(resident forward, bytes ÷ pinned bandwidth)", "bound", ""),
        ("peak GPU memory allocated, GB", "peak", ""),
        ("logits equal to the resident model's", "equal", ""),
    ]
    if any(":busy" in key for key in keys):
        rows.append(("tokens/s busy ÷ idle", "busy", "≥ 0.70"))
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
    print("| measurement | " + " | ".join(label(k) for k in keys) + " | goal |")
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
    parser.add_argument("--tokens", type=int, default=64, help="BATCH x TOKENS (default 64)")
    parser.add_argument("--batch", default="1", help="batch sizes, comma-separated (default 1)")
    parser.add_argument(
        "--staging",
        default="auto",
        help="host stagings (auto, register, ring), comma-separated: each one other than auto "
        "runs accel at the deepest depth with ACCEL_OFFLOAD_STAGING set to it",
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="N: one more run with N CPU-spinning processes"
    )
    parser.add_argument("--no-accelerate", action="store_true", help="leave Accelerate out")
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
        args.batches = parse_ints(args.batch, "--batch", parser)
        worker(args)
        return
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    width = args.width if args.width is not None else (128 if dry else 4096)
    blocks = args.blocks if args.blocks is not None else (6 if dry else 8)
    budget_gb = args.gpu_budget_gb if args.gpu_budget_gb is not None else (0.002 if dry else 2.0)
    args.forwards = args.forwards if args.forwards is not None else (2 if dry else 10)
    depths = parse_ints(args.depths, "--depths", parser)
    args.batches = parse_ints(args.batch, "--batch", parser)
    if any(d < 0 for d in depths) or min(width, blocks, args.tokens, args.forwards) < 1:
        parser.error("depths must be >= 0; width, blocks, tokens and forwards positive")
    if min(args.batches) < 1 or args.busy < 0:
        parser.error(f"--batch sizes must be >= 1 and --busy >= 0, not {args.batch!r}, {args.busy}")
    stagings = [item.strip() for item in args.staging.split(",") if item.strip()]
    unknown = sorted(set(stagings) - set(STAGINGS))
    if unknown or not stagings:
        parser.error(
            f"--staging takes {', '.join(STAGINGS)} (comma-separated), not {args.staging!r}"
        )
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
        deepest = max(depths)
        for staging in stagings:
            if staging != "auto":
                name = f"offload:accel:{deepest}"
                runs[f"accel:{deepest}:{staging}"] = run_worker(name, args, common, staging)
                shutil.rmtree(work / "offload", ignore_errors=True)
        if args.busy:
            with busy_cpu(args.busy):
                busy = run_worker(f"offload:accel:{deepest}", args, common)
            runs[f"accel:{deepest}:busy{args.busy}"] = busy
            shutil.rmtree(work / "offload", ignore_errors=True)
        measured = importable("accelerate") and not args.no_accelerate
        runs["accelerate:0"] = (
            run_worker("offload:accelerate:0", args, common) if measured else None
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
        "batches": args.batches,
        "busy": args.busy,
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
