"""Benchmark: seconds per save_state / load_state of a ~300 MB model with Adam state vs raw files.

    python tools/bench/checkpoint.py [--size-mb 300] [--repeats 5] [--dir /tmp]
                                     [--no-accel | --no-accelerate]

Run it with an interpreter that has accel installed (e.g. .venv/bin/python after
`nox -s dev`); Accelerate 1.15 runs from its own venv (tools/reference_venv.py creates it,
and its worker runs with ACCELERATE_USE_CPU=1). Each library runs in its own single-process
worker on the CPU: a stack of `Linear(2048, 2048)` layers (ReLU between) with about
`--size-mb` MB of fp32 weights (75.5M parameters, 302 MB for the default), Adam after one
step, so the optimizer state (exp_avg, exp_avg_sq) is twice the weights.

Library: `Accelerator(cpu=True)`, `prepare(model, optimizer)`, `save_state(dir)` and
`load_state(dir)`. Raw, in the same process on the same tensors: `safetensors.torch.save_file`
of `model.state_dict()` plus `torch.save` of `optimizer.state_dict()`, read back with
`safetensors.torch.load_file` + `torch.load(weights_only=True)` + `load_state_dict`. Before
timing, every way of saving is checked once: save, overwrite the weights and the Adam state
with zeros, load, and compare a SHA-1 of every tensor with the one taken before the save.

Timing: `--repeats` rounds; in each, every save (raw, library and, for accel, save_state with
`fsync_file` / `fsync_directory` patched to no-ops) writes a fresh directory (order rotating
between rounds), then the raw and the library checkpoint are loaded (order alternating).
Untimed, between two timed calls: the old directory is deleted and `os.sync()` flushes the
dirty pages, so the write-back of one save does not slow the next measurement. Raw saves do
not fsync (their time is the time to hand the bytes to the page cache); accel's save_state
fsyncs every file and the directory, so the "(no fsync)" row separates that cost. The page
cache is not dropped (that needs root): every load reads files just written, from memory
(warm). Reported: median seconds of each, and the median of the per-round ratios
library/raw with their range. Each library times its own raw baseline in its own process,
so compare ratios, not seconds. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
WIDTH = 2048
SEED = 0
MB = 1_000_000


def layers_for(size_mb: float) -> int:
    """Number of Linear(WIDTH, WIDTH) layers whose fp32 weights come closest to size_mb MB."""
    per_layer = 4 * (WIDTH * WIDTH + WIDTH)
    return max(1, round(size_mb * MB / per_layer))


def build(torch: Any, layers: int) -> Any:
    """The benchmark model: ``layers`` Linear(WIDTH, WIDTH), ReLU between them."""
    nn = torch.nn
    modules: list[Any] = []
    for index in range(layers):
        if index:
            modules.append(nn.ReLU())
        modules.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*modules)


def digest(torch: Any, model: Any, optimizer: Any) -> str:
    """SHA-1 over the model's tensors and the optimizer's state dict (bit-exact check)."""
    sha = hashlib.sha1(usedforsecurity=False)

    def add(name: str, tensor: Any) -> None:
        sha.update(name.encode())
        flat = tensor.detach().contiguous().reshape(-1)
        sha.update(flat.view(torch.uint8).numpy())

    for name, tensor in model.state_dict().items():
        add(name, tensor)
    state = optimizer.state_dict()
    for key in sorted(state["state"]):
        for field, value in sorted(state["state"][key].items()):
            if isinstance(value, torch.Tensor):
                add(f"{key}.{field}", value)
            else:
                sha.update(f"{key}.{field}={value!r}".encode())
    sha.update(repr(state["param_groups"]).encode())
    return sha.hexdigest()


def zero_everything(torch: Any, model: Any, optimizer: Any) -> None:
    """Overwrite the weights and every optimizer state tensor with zeros, in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for entry in optimizer.state.values():
            for value in entry.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


def file_sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}


@contextmanager
def no_fsync(impl: str) -> Iterator[None]:
    """Make accel's checkpoint writer skip its fsyncs (files and directories)."""
    module = importlib.import_module(f"{impl}.checkpoint_writing")
    names = ("fsync_file", "fsync_directory")
    saved = {name: getattr(module, name) for name in names}

    def skip(path: Path) -> None:
        return None

    for name in names:
        setattr(module, name, skip)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


def timed(call: Callable[[], Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    finally:
        gc.enable()


def worker(impl: str, size_mb: float, repeats: int, work: Path) -> None:
    """Check, then time raw vs library saves and loads in this process; print one JSON line."""
    import torch
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    accelerator = importlib.import_module(impl).Accelerator(cpu=True)
    torch.manual_seed(SEED)
    model = build(torch, layers_for(size_mb))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    # One step, so Adam's exp_avg / exp_avg_sq exist (optimizer state = 2x the weights).
    inputs = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(SEED))
    accelerator.backward(prepared_model(inputs).square().mean())
    prepared_optimizer.step()
    prepared_optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())

    def raw_save(directory: Path) -> None:
        directory.mkdir()
        save_file(model.state_dict(), directory / "model.safetensors", metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), directory / "optimizer.bin")

    def raw_load(directory: Path) -> None:
        model.load_state_dict(load_file(directory / "model.safetensors", device="cpu"))
        state = torch.load(directory / "optimizer.bin", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)

    def library_save(directory: Path) -> None:
        accelerator.save_state(str(directory))

    def library_save_no_fsync(directory: Path) -> None:
        with no_fsync(impl):
            accelerator.save_state(str(directory))

    def library_load(directory: Path) -> None:
        accelerator.load_state(str(directory))

    saves: dict[str, Callable[[Path], None]] = {"raw": raw_save, "library": library_save}
    if impl == "accel":
        saves["library_no_fsync"] = library_save_no_fsync
    loads: dict[str, Callable[[Path], None]] = {"raw": raw_load, "library": library_load}
    directories = {name: work / name for name in saves}

    def fresh(directory: Path) -> None:
        if directory.exists():
            shutil.rmtree(directory)
        os.sync()

    # Round trip, once per way of saving: the loaded state is bit for bit the saved one.
    reference = digest(torch, model, optimizer)
    sizes: dict[str, dict[str, int]] = {}
    for name, save in saves.items():
        fresh(directories[name])
        save(directories[name])
        zero_everything(torch, model, optimizer)
        assert digest(torch, model, optimizer) != reference, "zeroing changed nothing"
        loads["raw" if name == "raw" else "library"](directories[name])
        after = digest(torch, model, optimizer)
        assert after == reference, f"{impl} {name}: the loaded state differs from the saved one"
        sizes[name] = file_sizes(directories[name])

    save_times: dict[str, list[float]] = {name: [] for name in saves}
    load_times: dict[str, list[float]] = {name: [] for name in loads}
    names = list(saves)
    for index in range(repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            fresh(directories[name])
            save_times[name].append(timed(lambda: saves[name](directories[name])))  # noqa: B023
            os.sync()
        for name in ("raw", "library") if index % 2 else ("library", "raw"):
            load_times[name].append(timed(lambda: loads[name](directories[name])))  # noqa: B023
    assert digest(torch, model, optimizer) == reference, f"{impl}: state drifted while timing"
    for directory in directories.values():
        shutil.rmtree(directory, ignore_errors=True)
    try:
        import resource

        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # KiB on Linux
    except ImportError:  # not on Windows
        peak_mb = float("nan")
    result = {
        "impl": impl,
        "peak_rss_mb": peak_mb,
        "params": params,
        "layers": layers_for(size_mb),
        "sizes": sizes,
        "save": save_times,
        "load": load_times,
    }
    print(json.dumps(result), flush=True)


def run_worker(python: str, impl: str, size_mb: float, repeats: int, work: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if impl == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", impl]
    command += ["--size-mb", str(size_mb), "--repeats", str(repeats), "--dir", str(work)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        hint = " (no accel here? pass --no-accel)" if impl == "accel" else ""
        raise SystemExit(f"{impl} worker failed{hint}:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def row(label: str, library: list[float], raw: list[float]) -> str:
    ratios = [lib / r for lib, r in zip(library, raw, strict=True)]
    spread = f", ratio range {min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
    fastest = f"; fastest {min(library):.3f} vs {min(raw):.3f} s"
    return (
        f"| {label} (median of {len(ratios)}{spread}{fastest}) | "
        f"{statistics.median(library):.3f} | "
        f"{statistics.median(raw):.3f} | {statistics.median(ratios):.2f}× |"
    )


def main() -> None:
    """Parse options, run each library's worker, print the Markdown table and notes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=300, help="fp32 weights, MB (1e6 B)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per library")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the checkpoints go (default: a /tmp folder)"
    )
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--no-accel", action="store_true", help="skip the accel side")
    skip.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate side")
    parser.add_argument("--worker", choices=["accel", "accelerate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.size_mb <= 0:
        parser.error("--repeats and --size-mb must be positive")
    if args.worker:
        worker(args.worker, args.size_mb, args.repeats, args.dir)
        return

    pythons: dict[str, str] = {}
    if not args.no_accel:
        pythons["accel"] = sys.executable
    if not args.no_accelerate:
        ensure: Callable[[], Path] = importlib.import_module(
            "reference_venv"
        ).ensure_accelerate_venv
        pythons["accelerate"] = str(ensure())

    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    weights_mb = layers_for(args.size_mb) * 4 * (WIDTH * WIDTH + WIDTH) / MB
    needed = 3 * 3 * weights_mb * MB  # three checkpoints of weights + 2x Adam state
    free = shutil.disk_usage(base).free
    if free < 1.2 * needed:
        raise SystemExit(f"{base}: {free / MB:.0f} MB free, about {needed / MB:.0f} MB needed")
    work = Path(tempfile.mkdtemp(prefix="accel-bench-checkpoint-", dir=base))
    try:
        results = {
            impl: run_worker(python, impl, args.size_mb, args.repeats, work / impl)
            for impl, python in pythons.items()
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    any_result = next(iter(results.values()))
    what = (
        f"{any_result['layers']}× Linear({WIDTH}, {WIDTH}) fp32, "
        f"{any_result['params'] / 1e6:.1f}M params, Adam after 1 step, cpu, single process"
    )
    print(f"Model: {what}. Checkpoints under {work} (deleted afterwards).")
    print()
    print("| measurement | library s | raw s | ratio |")
    print("|---|---|---|---|")
    notes: list[str] = []
    for impl, result in results.items():
        name = "Accelerate 1.15" if impl == "accelerate" else "accel"
        save, load = result["save"], result["load"]
        total_mb = {k: sum(v.values()) / MB for k, v in result["sizes"].items()}
        label = f"{name} `save_state`, {total_mb['library']:.0f} MB"
        print(row(label, save["library"], save["raw"]))
        if "library_no_fsync" in save:
            print(
                row(
                    f"{name} `save_state` (no fsync), {total_mb['library_no_fsync']:.0f} MB",
                    save["library_no_fsync"],
                    save["raw"],
                )
            )
            cost = [a - b for a, b in zip(save["library"], save["library_no_fsync"], strict=True)]
            notes.append(
                f"{name}'s fsyncs cost {statistics.median(cost):.3f} s per save_state (median "
                "of per-round differences save_state - save_state without fsync)."
            )
        print(row(f"{name} `load_state`, warm page cache", load["library"], load["raw"]))
        files = ", ".join(f"{k} {v / MB:.1f} MB" for k, v in result["sizes"]["library"].items())
        raw_files = ", ".join(f"{k} {v / MB:.1f} MB" for k, v in result["sizes"]["raw"].items())
        notes.append(
            f"{name} checkpoint: {files}; raw: {raw_files}. Peak RSS of the worker: "
            f"{result['peak_rss_mb']:.0f} MB."
        )
    print()
    print(
        "Raw saves (safetensors `save_file` + `torch.save`) do not fsync: their time is the "
        "time to hand the bytes to the page cache. accel's `save_state` fsyncs every file and "
        "the directory; Accelerate 1.15's does not fsync. Loads read files just written "
        "(warm page cache; dropping it needs root). 'fastest': the quickest single run of "
        "each, a guide when a busy machine makes the medians jump. Untimed between runs: the "
        "previous directory is deleted and `os.sync()` flushes dirty pages. Each library times "
        "its own raw baseline in its own process: compare ratios, not seconds."
    )
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
