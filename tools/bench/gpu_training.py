"""Training check on one device: a prepared loop against the same loop written by hand.

    python tools/bench/gpu_training.py [--out FILE] [--precisions fp32,bf16,fp16]
                                       [--accelerate-python PYTHON] [--pairs 30] [--dry-run]

Part of tools/gpu_check.py (accel issue 30); it runs alone too. On a machine with CUDA it uses
`cuda:0`; `--dry-run` runs the same code on the CPU with a tiny model and fewer steps (CI).
accel comes from this interpreter (installed, or the repository's sources); Accelerate 1.15
from `--accelerate-python` (an interpreter where `import accelerate` is the real Accelerate),
else that side is "not measured".

Equivalence and overhead, one fresh worker process per library and precision (the
Accelerator's state is one per process): an MLP (GPU: 1024 -> 4096 -> 4096 -> 1024, GELU,
batch 256; dry run: 64 -> 128 -> 128 -> 64, batch 32), AdamW (lr 1e-3), gradient
accumulation 4, `clip_grad_norm_(..., 1.0)` at every optimizer step, MSE loss on fixed
random batches. The hand-written loop is what the library promises to do: autocast around
the forward (bf16, fp16), the loss divided by 4, `torch.amp.GradScaler` for fp16 (scale,
unscale before clipping, step, update), step and zero_grad every 4th micro-batch. The prepared
loop is `Accelerator(mixed_precision=..., gradient_accumulation_steps=4)`, `prepare(model,
optimizer)`, `with accelerator.accumulate(model)`, `accelerator.backward(loss)`,
`accelerator.clip_grad_norm_` when `accelerator.sync_gradients`, `optimizer.step()`,
`optimizer.zero_grad()`. Both start from the same weights; after 32 micro-batches (8 optimizer
steps) the largest absolute difference of any weight is reported (goal: 0.0, at most 1e-6).
Then both loops are timed in `--pairs` paired blocks of 8 micro-batches (order alternating,
garbage collector off, a device synchronisation at each block's ends): the median of the
per-pair ratios prepared / raw, with its interquartile range.

Exact resume (accel): a dropout MLP, AdamW, a StepLR scheduler, a shuffled DataLoader of 11
batches, gradient accumulation 4, bf16 autocast where the device supports it (else fp32),
40 micro-batches. Worker 1 trains them uninterrupted (the reference weights), then, from the
same seed, stops after 13 micro-batches (mid-epoch and mid-window) with
`accelerator.save_state`; worker 2, a new process, builds the same objects, calls
`accelerator.load_state`, continues with `accelerator.skip_first_batches(loader, 2)` for the
rest of that epoch (Accelerate's recipe) and whole epochs after it, and compares its final
weights with the reference: `torch.equal` for every tensor (and the reference must differ from
the initial weights, so that an untrained model cannot pass).

Prints a Markdown table; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("accel") is None:  # not installed: the repository's sources
    for _src in sorted((ROOT / "packages").glob("*/src")):
        sys.path.insert(0, str(_src))

SEED = 0
ACCUM = 4
EQUIVALENCE_MICRO_STEPS = 32
BLOCK = 8  # micro-batches per timed block: 2 optimizer steps
TOLERANCE = 1e-6
PRECISIONS = ("fp32", "bf16", "fp16")
MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RESUME_TOTAL = 40
RESUME_STOP = 13  # 11 batches an epoch: epoch 1, batch 2, inside an accumulation window
RESUME_SAMPLES = 88
RESUME_BATCH = 8


def shapes(dry_run: bool) -> dict[str, int]:
    return (
        {"width": 64, "hidden": 128, "batch": 32}
        if dry_run
        else {"width": 1024, "hidden": 4096, "batch": 256}
    )


def build(shape: dict[str, int]) -> nn.Module:
    width, hidden = shape["width"], shape["hidden"]
    return nn.Sequential(
        nn.Linear(width, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, width),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Equivalence and overhead
# ---------------------------------------------------------------------------------------------


class RawLoop:
    """The hand-written loop: autocast, loss / ACCUM, GradScaler for fp16, clip, step."""

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.dtype = DTYPES.get(precision)
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.micro = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        autocast = (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            out = self.model(x)
        loss = F.mse_loss(out.float(), y) / ACCUM
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.micro += 1
        if self.micro % ACCUM:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()


def prepared_loop(
    impl: str, model: nn.Module, precision: str, device: torch.device
) -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], None]]:
    """The library's loop over ``model``: (the unwrapped prepared model, one micro-batch step)."""
    top = importlib.import_module(impl)
    accelerator = top.Accelerator(
        mixed_precision=MIXED[precision],
        gradient_accumulation_steps=ACCUM,
        cpu=device.type == "cpu",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer = accelerator.prepare(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with accelerator.accumulate(prepared):
            loss = F.mse_loss(prepared(x).float(), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

    return accelerator.unwrap_model(prepared), step


def loop_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Equivalence, then paired timing, of one library at one precision."""
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    shape = shapes(args.dry_run)
    torch.manual_seed(SEED)
    initial = build(shape).state_dict()
    raw_model, model = build(shape), build(shape)
    raw_model.load_state_dict(initial)
    model.load_state_dict(initial)
    raw = RawLoop(raw_model.to(device), args.precision, device)
    prepared, prepared_step = prepared_loop(args.impl, model, args.precision, device)
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = [
        (
            torch.randn(shape["batch"], shape["width"], generator=generator).to(device),
            torch.randn(shape["batch"], shape["width"], generator=generator).to(device),
        )
        for _ in range(EQUIVALENCE_MICRO_STEPS)
    ]
    for x, y in batches:
        raw.step(x, y)
    for x, y in batches:
        prepared_step(x, y)
    sync(device)
    theirs = dict(prepared.named_parameters())
    max_diff = max(
        float((param.detach().float() - theirs[name].detach().float()).abs().max())
        for name, param in raw_model.named_parameters()
    )
    changed = not torch.equal(raw_model.state_dict()["0.weight"].cpu(), initial["0.weight"])

    def block(step: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        sync(device)
        start = time.perf_counter()
        for index in range(BLOCK):
            step(*batches[index])
        sync(device)
        return (time.perf_counter() - start) / (BLOCK / ACCUM) * 1e3  # ms per optimizer step

    times: dict[str, list[float]] = {"raw": [], "prepared": []}
    block(raw.step), block(prepared_step)  # warm-up
    gc.disable()
    try:
        for index in range(args.pairs):
            order = ("raw", "prepared") if index % 2 else ("prepared", "raw")
            for name in order:
                times[name].append(block(raw.step if name == "raw" else prepared_step))
    finally:
        gc.enable()
    ratios = [p / r for p, r in zip(times["prepared"], times["raw"], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "impl": args.impl,
        "precision": args.precision,
        "max_diff": max_diff,
        "trained": changed,
        "raw_ms": statistics.median(times["raw"]),
        "prepared_ms": statistics.median(times["prepared"]),
        "ratio": statistics.median(ratios),
        "iqr": [q1, q3],
    }


# ---------------------------------------------------------------------------------------------
# Exact resume (accel)
# ---------------------------------------------------------------------------------------------


class Counter:
    """Micro-batches done, saved with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


def resume_precision(device: torch.device) -> str:
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16"


def resume_loop(device: torch.device, checkpoint: Path, stop_at: int, resume: bool) -> Any:
    """Train (or resume) the dropout MLP; stop and save after ``stop_at`` micro-batches."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.state import AcceleratorState, GradientState
    from accel.utils import set_seed

    AcceleratorState._reset_state()
    GradientState._reset_state()
    set_seed(SEED)
    precision = resume_precision(device)
    accelerator = Accelerator(
        mixed_precision=MIXED[precision],
        gradient_accumulation_steps=ACCUM,
        cpu=device.type == "cpu",
    )
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    generator = torch.Generator().manual_seed(SEED + 2)
    data = TensorDataset(
        torch.randn(RESUME_SAMPLES, 16, generator=generator),
        torch.randn(RESUME_SAMPLES, 4, generator=generator),
    )
    loader = DataLoader(data, batch_size=RESUME_BATCH, shuffle=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume:
        accelerator.load_state(str(checkpoint))
    skip = counter.n % len(loader)
    while counter.n < RESUME_TOTAL:
        active = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for x, y in active:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.n += 1
            if counter.n == stop_at:
                accelerator.save_state(str(checkpoint))
                return None
            if counter.n >= RESUME_TOTAL:
                break
    final = accelerator.unwrap_model(model).state_dict()
    return {k: v.detach().cpu().clone() for k, v in final.items()}, initial, precision


def resume_worker(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    folder = Path(args.dir)
    if args.worker == "resume-first":
        reference, initial, precision = resume_loop(device, folder / "unused", -1, False)
        torch.save({"reference": reference, "initial": initial}, folder / "reference.pt")
        resume_loop(device, folder / "checkpoint", RESUME_STOP, False)
        return {"saved": (folder / "checkpoint").is_dir(), "precision": precision}
    resumed, _, precision = resume_loop(device, folder / "checkpoint", -1, True)
    saved = torch.load(folder / "reference.pt", weights_only=True)
    reference, initial = saved["reference"], saved["initial"]
    equal = all(torch.equal(resumed[k], reference[k]) for k in reference)
    max_diff = max(
        float((resumed[k].float() - reference[k].float()).abs().max()) for k in reference
    )
    trained = any(not torch.equal(reference[k], initial[k]) for k in reference)
    return {"equal": equal, "max_diff": max_diff, "trained": trained, "precision": precision}


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def run_worker(python: str, extra: list[str], dry_run: bool) -> dict[str, Any]:
    """One worker process; its JSON line, or {"error": ...} when it fails."""
    command = [python, str(Path(__file__).resolve()), *extra] + (["--dry-run"] if dry_run else [])
    env = dict(os.environ)
    if dry_run:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
        return {"error": f"exit code {done.returncode}: " + " / ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every worker; the figures."""
    pythons = {"accel": sys.executable}
    if args.accelerate_python:
        pythons["accelerate"] = args.accelerate_python
    common = ["--pairs", str(args.pairs)]
    loops: dict[str, dict[str, Any] | None] = {"accel": {}, "accelerate": None}
    for impl, python in pythons.items():
        results: dict[str, Any] = {}
        for precision in args.precision_list:
            extra = ["--worker", "loop", "--impl", impl, "--precision", precision, *common]
            results[precision] = run_worker(python, extra, args.dry_run)
            print(f"{impl} {precision}: {json.dumps(results[precision])}", flush=True)
        loops[impl] = results
    with tempfile.TemporaryDirectory(prefix="gpu-training-") as folder:
        first = run_worker(
            sys.executable, ["--worker", "resume-first", "--dir", folder], args.dry_run
        )
        resume = (
            run_worker(sys.executable, ["--worker", "resume-rest", "--dir", folder], args.dry_run)
            if "error" not in first
            else first
        )
    print(f"resume: {json.dumps(resume)}", flush=True)
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    return {"device": device, "shape": shapes(args.dry_run), "loops": loops, "resume": resume}


def report(results: dict[str, Any], command: str) -> None:
    """Print the Markdown table."""

    def cell(impl: str, precision: str, field: str) -> str:
        side = results["loops"].get(impl)
        if side is None:
            return "not measured (no Accelerate)"
        run = side.get(precision, {})
        if "error" in run:
            return f"failed: {run['error'][:120]}"
        if field == "diff":
            return "identical" if run["max_diff"] == 0 else f"{run['max_diff']:.3g}"
        return (
            f"{run['ratio']:.3f}× ({run['prepared_ms']:.2f} vs {run['raw_ms']:.2f} ms, IQR "
            f"{run['iqr'][0]:.3f}-{run['iqr'][1]:.3f})"
        )

    shape = results["shape"]
    print()
    print(f"Device: {results['device']}. MLP {shape['width']}-{shape['hidden']}-{shape['width']}")
    print()
    print("| measurement | accel | Accelerate 1.15 | goal |")
    print("|---|---|---|---|")
    for precision in results["loops"]["accel"]:
        print(
            f"| {precision}: max abs weight difference vs the hand-written loop | "
            f"{cell('accel', precision, 'diff')} | {cell('accelerate', precision, 'diff')} | "
            f"≤ {TOLERANCE:g} |"
        )
        print(
            f"| {precision}: optimizer step time ÷ hand-written | "
            f"{cell('accel', precision, 'ratio')} | {cell('accelerate', precision, 'ratio')} | |"
        )
    resume = results["resume"]
    text = (
        f"failed: {resume['error']}"
        if "error" in resume
        else ("bit-identical" if resume["equal"] else f"differs (max {resume['max_diff']:.3g})")
    )
    print(f"| exact mid-epoch resume in a new process | {text} | | bit-identical |")
    print()
    print(f"Command: `{command}`")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model (CI)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("--precisions", default=None, help="default fp32,bf16,fp16 (dry: no fp16)")
    parser.add_argument("--pairs", type=int, default=None, help="timed pairs (default 30; dry 4)")
    parser.add_argument("--accelerate-python", help="an interpreter with Accelerate 1.15")
    parser.add_argument(
        "--worker", choices=["loop", "resume-first", "resume-rest"], help=argparse.SUPPRESS
    )
    parser.add_argument("--impl", choices=["accel", "accelerate"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.pairs = args.pairs if args.pairs is not None else (4 if args.dry_run else 30)
    if args.pairs < 4:
        parser.error(f"--pairs must be >= 4, not {args.pairs}")
    if args.worker == "loop":
        print(json.dumps(loop_worker(args)), flush=True)
        return
    if args.worker:
        print(json.dumps(resume_worker(args)), flush=True)
        return
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    default = "fp32,bf16" if args.dry_run else ",".join(PRECISIONS)
    args.precision_list = [p.strip() for p in (args.precisions or default).split(",") if p.strip()]
    unknown = sorted(set(args.precision_list) - set(PRECISIONS))
    if unknown or not args.precision_list:
        parser.error(f"--precisions takes {', '.join(PRECISIONS)}, comma-separated: {unknown}")
    results = measure(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    report(results, ("python tools/bench/gpu_training.py " + " ".join(sys.argv[1:])).strip())


if __name__ == "__main__":
    main()
