"""Benchmark: a transformers model folder with half its blocks on disk, loaded and generating.

    python tools/bench/pretrained.py [--size-gb 1] [--prompt 16] [--tokens 32] [--repeats 3]
                                     [--via load_pretrained|transformers] [--threads N]
                                     [--dir DIR] [--quick] [--json FILE] [--no-cold]
                                     [--device cpu|cuda] [--gpu-budget-mb 700] [--dtype bf16]
                                     [--accelerate-python PYTHON | --no-accelerate]

Run it with an interpreter that has accel-bigmodel and transformers installed (e.g.
`.nox/upstream/bin/python` after `python3 tools/dev.py test -s upstream`). transformers +
Accelerate 1.15 run from their own venv (tools/reference_venv.py creates it; its workers run with
ACCELERATE_USE_CPU=1). Linux only (posix_fadvise, mincore) for the cold-cache rows.

Model (accel issue 17): a Llama decoder from a transformers `LlamaConfig` (vocabulary 32000,
intermediate size 2.75x hidden, 16 layers, fp32, untied head), seeded, written once with
`save_pretrained` (safetensors shards of 500 MB and an index) under `--dir` (default:
accel-bench-pretrained in the system temp dir) and reused. The hidden size is the multiple of
64 that brings the model closest to `--size-gb`.

Device map, the same for both libraries: embeddings, final norm, rotary embedding, lm_head and
the first half of the layers on "cpu", the second half on "disk", an offload folder given
(fresh per worker, removed afterwards). accel: `accel_bigmodel.load_pretrained(folder,
device_map=..., offload_folder=...)` (`--via load_pretrained`, the default), or, with `--via
transformers` (accel issue 29), transformers' own `AutoModelForCausalLM.from_pretrained(folder,
device_map=..., offload_folder=...)` with accel standing in for Accelerate
(`accel.install_as_accelerate()` before transformers is imported: the user's code unchanged);
Accelerate: `AutoModelForCausalLM.from_pretrained(folder,
device_map=..., offload_folder=...)`, which transformers runs through Accelerate's hooks; and,
as the floor, transformers alone with every weight in RAM (`from_pretrained(folder)`, no map).
Execution on the CPU with `--threads` compute threads (OMP_NUM_THREADS and
`torch.set_num_threads`; default 1, as tools/bench/offload.py: on a 2-core machine a reader
thread then has a core of its own).

Each measurement is one fresh worker process, libraries alternating, `--repeats` each:

- warm: every file of the folder read once before the worker starts;
- cold: the folder's files dropped from the page cache before the worker starts
  (posix_fadvise(POSIX_FADV_DONTNEED) after fdatasync; mincore checks that at most 5% stays).

The worker imports transformers, its Llama module and the library first (not timed), then
times from just before the load call: time to first token is the moment the
streamer receives the first generated token (load + prefill + one step); tokens/s is the
decoding rate over the other `--tokens` - 1 tokens (greedy, `min_new_tokens` = `max_new_tokens`,
a fixed prompt of `--prompt` token ids). It also records the bytes the offload folder holds and
what the process wrote (/proc/self/io write_bytes) after generating. The generated tokens of
every worker must be identical (the run fails otherwise). Goals (accel issue 17): first token
<= 0.5x Accelerate's, tokens/s >= 1.5x, warm and cold. Prints a Markdown table for
docs/benchmarks.md and the exact command. `--quick` is a smoke run (tiny model, 1 repeat);
`--no-cold` leaves out the cold page-cache rows.

On a GPU (`--device cuda`, accel issue 30): the weights are stored in `--dtype` (bf16 there by
default; `--size-gb` counts the stored bytes), the device map is accel's
`infer_auto_device_map` of the model under `max_memory={0: --gpu-budget-mb, "cpu": ...}` (the
decoder layers unsplit), given as it is to both libraries (the rest of the model on "cpu",
nothing on disk, so the cold rows are left out), and the floor is transformers alone with
the whole model on the GPU. `--accelerate-python` takes an interpreter that has transformers
and Accelerate 1.15 instead of the reference venv (a machine without network);
`--no-accelerate` leaves that side out ("not measured").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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
from tools.bench.measure import folder_bytes, median  # noqa: E402
from tools.bench.offload import PageCache, plain_read, whole_files  # noqa: E402

MB = 1 << 20
LAYERS = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB = 32000
SHARD = "500MB"
LIBRARIES = ("accel", "accelerate", "eager")


# ---------------------------------------------------------------------------------------------
# The model folder
# ---------------------------------------------------------------------------------------------


def config_for(
    size_gb: float, layers: int = LAYERS, vocab: int = VOCAB, element: int = 4
) -> dict[str, int]:
    """LlamaConfig arguments whose weights (``element`` bytes each) are closest to ``size_gb``."""

    def weight_bytes(hidden: int) -> int:
        intermediate = hidden * 11 // 4 // 64 * 64
        per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
        return element * (layers * per_layer + 2 * vocab * hidden + hidden)

    target = size_gb * 1e9
    hidden = min(range(128, 8192, 64), key=lambda h: abs(weight_bytes(h) - target))
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4 // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def ensure_folder(base: Path, config: dict[str, int], dtype: str = "fp32") -> Path:
    """Write the seeded model once (weights in ``dtype``); reuse it when it is there."""
    import torch
    import transformers

    stamp = config if dtype == "fp32" else {**config, "dtype": dtype}
    name = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    folder = base / f"llama-{name}"
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    # Built on the GPU where there is one: random initialisation of a large model is slow on CPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model = model.to(DTYPES[dtype])
    model.save_pretrained(folder, max_shard_size=SHARD)
    (folder / "done").write_text("complete\n")
    return folder


def device_map_for(layers: int) -> dict[str, str]:
    first = {f"model.layers.{i}": "cpu" for i in range(layers // 2)}
    second = {f"model.layers.{i}": "disk" for i in range(layers // 2, layers)}
    rest = dict.fromkeys(["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"], "cpu")
    return {**rest, **first, **second}


def gpu_device_map(config: dict[str, int], dtype: str, budget_mb: int) -> dict[str, Any]:
    """accel's device map of the model under a GPU budget, the rest on the CPU."""
    import transformers

    from accel_bigmodel import infer_auto_device_map, init_empty_weights

    with init_empty_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model = model.to(DTYPES[dtype])
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    max_memory: dict[int | str, int] = {0: budget_mb * 1_000_000, "cpu": 4 * total}
    classes = list(getattr(model, "_no_split_modules", None) or ["LlamaDecoderLayer"])
    plan = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=classes)
    if "cpu" not in plan.values():
        raise SystemExit(f"the model ({total / MB:.0f} MiB) fits the GPU budget ({budget_mb} MB)")
    return {name: d if isinstance(d, int | str) else str(d) for name, d in plan.items()}


def dtype_option(transformers_version: str, dtype: str) -> dict[str, Any]:
    """from_pretrained's dtype argument: ``dtype`` since transformers 4.56, else ``torch_dtype``."""
    major, minor = (int(part) for part in transformers_version.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": DTYPES[dtype]}


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != "done")


# ---------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------


def write_bytes() -> int:
    try:
        with open("/proc/self/io", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(args.threads)
    folder, offload = Path(args.folder), Path(args.offload)
    device_map = json.loads(args.device_map) if args.device_map else device_map_for(args.layers)

    class Clock(BaseStreamer):
        """Records when each generated token comes out (the first ``put`` is the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    # Imports are not timed: transformers, its Llama modelling module and the library's API.
    if args.library == "accel" and args.via == "transformers":
        import accel

        accel.install_as_accelerate()  # before transformers looks for Accelerate
    import transformers
    import transformers.models.llama.modeling_llama
    from transformers import AutoModelForCausalLM

    from_pretrained = AutoModelForCausalLM.from_pretrained
    if args.library == "accel" and args.via == "load_pretrained":
        from accel_bigmodel import load_pretrained

    typed = dtype_option(transformers.__version__, args.dtype) if args.dtype != "fp32" else {}
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=generator).to(args.device)
    written_before = write_bytes()
    start = time.perf_counter()
    model: Any
    if args.library == "accel" and args.via == "load_pretrained":
        dtype = DTYPES[args.dtype] if typed else None
        model = load_pretrained(folder, device_map=device_map, offload_folder=offload, dtype=dtype)
    elif args.library in ("accel", "accelerate"):  # transformers, on accel's alias or Accelerate
        model = from_pretrained(folder, device_map=device_map, offload_folder=str(offload), **typed)
    else:  # the floor: every weight in RAM (or on the GPU), transformers alone (no hooks)
        model = from_pretrained(folder, **typed).eval().to(args.device)
    loaded = time.perf_counter()
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
            streamer=clock,
        )
    times = clock.times
    folder_size, folder_files = folder_bytes(offload)
    result = {
        "library": args.library,
        "load": loaded - start,
        "first_token": times[0] - start,
        "tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
        "tokens": out[0, args.prompt :].tolist(),
        "folder_bytes": folder_size,
        "folder_files": folder_files,
        "written": write_bytes() - written_before,
        "map": sorted(set(getattr(model, "hf_device_map", {}).values())),
    }
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def run_worker(
    python: str, library: str, folder: Path, args: argparse.Namespace, config: dict[str, int]
) -> dict[str, Any]:
    offload = Path(tempfile.mkdtemp(prefix="offload-", dir=folder.parent))
    shutil.rmtree(offload)  # the library creates it when it needs it
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env["ACCEL_DISABLE_PROGRESS_BAR"] = "1"
    if library == "accelerate" and args.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", "--library", library]
    command += ["--folder", str(folder), "--offload", str(offload)]
    command += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
    command += ["--threads", str(args.threads), "--via", args.via]
    command += ["--layers", str(config["num_hidden_layers"]), "--vocab", str(config["vocab_size"])]
    command += ["--device", args.device, "--dtype", args.dtype]
    if args.device_map:
        command += ["--device-map", args.device_map]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(offload, ignore_errors=True)
        os.sync()
    if done.returncode != 0:
        raise SystemExit(f"worker {library} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def warm(folder: Path) -> None:
    for path in files_of(folder):
        plain_read({str(path): [(0, path.stat().st_size)]})


def cell(values: list[float], fmt: str) -> str:
    text = f"{median(values):{fmt}}"
    return f"{text} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else text


def report(results: dict[str, Any], command: str, via: str = "load_pretrained") -> None:
    # Goals: load_pretrained (issue 17); transformers on the alias (issue 29: never slower)
    ttft_goal, rate_goal = ("≤ 0.5×", "≥ 1.5×") if via == "load_pretrained" else ("≤ 1×", "≥ 2×")
    missing = "not measured"
    rows = []
    for phase in ("warm", "cold"):
        runs = results[phase]
        if not runs:
            continue
        by = {lib: [r for r in runs if r["library"] == lib] for lib in LIBRARIES}

        def mid(library: str, field: str, by: dict[str, list[Any]] = by) -> float:
            return median([r[field] for r in by[library]])

        def timing(library: str, field: str, by: dict[str, list[Any]] = by) -> str:
            if not by[library]:
                return missing
            text = cell([r[field] for r in by[library]], ".2f")
            return text + (f" ({mid(library, 'load'):.2f})" if field == "first_token" else "")

        def written(library: str, by: dict[str, list[Any]] = by) -> str:
            if not by[library]:
                return missing
            folder = max(r["folder_bytes"] for r in by[library]) / MB
            return f"{folder:.0f} ({max(r['written'] for r in by[library]) / MB:.0f})"

        def ratio(field: str, by: dict[str, list[Any]] = by) -> str:
            if not by["accelerate"]:
                return ""
            return f"**{mid('accel', field) / mid('accelerate', field):.2f}×**"

        rows.append(
            f"| {phase}: time to first token, s (of which load) | "
            f"{timing('accel', 'first_token')} | {timing('accelerate', 'first_token')} | "
            f"{ratio('first_token')} | {timing('eager', 'first_token')} | {ttft_goal} |"
        )
        rows.append(
            f"| {phase}: decoding, tokens/s | {timing('accel', 'tokens_per_s')} | "
            f"{timing('accelerate', 'tokens_per_s')} | {ratio('tokens_per_s')} | "
            f"{timing('eager', 'tokens_per_s')} | {rate_goal} |"
        )
        rows.append(
            f"| {phase}: MB in the offload folder (process write_bytes, MB) | "
            f"{written('accel')} | {written('accelerate')} | | — | 0 |"
        )
    model = results["model"]
    where = results.get("placement") or f"{model['num_hidden_layers'] // 2} layers on disk"
    print()
    print(
        f"Model: Llama, hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
        f"{results['bytes'] / MB:.0f} MB {results.get('dtype', 'fp32')} in {results['files']} "
        f"files; {where}; prompt {results['prompt']} tokens, "
        f"{results['tokens']} new tokens, greedy; {results['threads']} compute thread(s); "
        f"{results['repeats']} workers per cell (median, range); the same tokens from every "
        f"worker: {'yes' if results.get('tokens_equal', True) else '**no**'}."
    )
    print()
    ours = (
        "accel `load_pretrained`"
        if via == "load_pretrained"
        else "transformers + accel (alias) `from_pretrained(device_map=...)`"
    )
    floor = "on the GPU" if results.get("device") == "cuda" else "in RAM"
    print(
        f"| measurement | {ours} | transformers + Accelerate 1.15 "
        f"`from_pretrained(device_map=...)` | accel ÷ Accelerate | transformers alone, all {floor}"
        " | goal |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    print()
    print(f"Command: `{command}`")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=None, help="default 1 (cuda: 1.4)")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--via",
        choices=["load_pretrained", "transformers"],
        default="load_pretrained",
        help="accel's load_pretrained, or transformers' from_pretrained on accel's alias",
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-cold", action="store_true", help="leave out the cold rows")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpu-budget-mb", type=int, default=700, help="with --device cuda")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="stored weights (cuda: bf16)"
    )
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--accelerate-python", help="interpreter with transformers + Accelerate")
    side.add_argument("--no-accelerate", action="store_true", help="leave Accelerate out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--offload", help=argparse.SUPPRESS)
    parser.add_argument("--device-map", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.size_gb is None:
        args.size_gb = 1.4 if args.device == "cuda" else 1.0
    if args.device == "cuda" and not args.worker and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.gpu_budget_mb < 1:
        parser.error(f"--gpu-budget-mb must be positive, not {args.gpu_budget_mb}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.size_gb, args.repeats, args.tokens, args.prompt = 0.02, 1, 6, 8
    element = DTYPES[args.dtype].itemsize
    config = config_for(args.size_gb, vocab=VOCAB if not args.quick else 1024, element=element)
    folder = ensure_folder(args.dir / "accel-bench-pretrained", config, args.dtype)
    pythons = {"accel": sys.executable, "accelerate": "", "eager": sys.executable}
    if args.accelerate_python:
        pythons["accelerate"] = args.accelerate_python
    elif not args.no_accelerate:
        sys.path.insert(0, str(ROOT / "tools"))
        from reference_venv import ensure_accelerate_venv

        pythons["accelerate"] = str(ensure_accelerate_venv())
    libraries = [library for library in LIBRARIES if pythons[library]]
    args.device_map = ""
    placement = ""
    if args.device == "cuda":
        plan = gpu_device_map(config, args.dtype, args.gpu_budget_mb)
        args.device_map = json.dumps(plan)
        on_gpu = sum(1 for device in plan.values() if device not in ("cpu", "disk"))
        placement = (
            f"{args.gpu_budget_mb} MB GPU budget: {on_gpu} of {len(plan)} map entries on the "
            "GPU, the rest on the CPU"
        )
    cache = PageCache() if PageCache.available() else None
    results: dict[str, Any] = {
        "model": config,
        "dtype": args.dtype,
        "device": args.device,
        "placement": placement,
        "device_map": json.loads(args.device_map) if args.device_map else None,
        "bytes": sum(p.stat().st_size for p in files_of(folder)),
        "files": len(files_of(folder)),
        "threads": args.threads,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "libraries": libraries,
        "warm": [],
        "cold": [],
    }
    for phase in ("warm", "cold"):
        if phase == "cold" and (args.no_cold or args.device == "cuda"):
            continue
        if phase == "cold" and cache is None:
            print("cold page cache: not measured (no posix_fadvise/mincore here)")
            continue
        for repeat in range(args.repeats):
            for library in libraries if repeat % 2 == 0 else libraries[::-1]:
                if phase == "warm":
                    warm(folder)
                else:
                    assert cache is not None
                    cache.drop_checked(whole_files(files_of(folder)))
                run = run_worker(pythons[library], library, folder, args, config)
                results[phase].append(run)
                print(
                    f"{phase} {library}: first token {run['first_token']:.2f} s "
                    f"(load {run['load']:.2f} s), {run['tokens_per_s']:.2f} tokens/s, "
                    f"offload folder {run['folder_bytes'] / MB:.0f} MB",
                    flush=True,
                )
    outputs = {tuple(r["tokens"]) for phase in ("warm", "cold") for r in results[phase]}
    results["tokens_equal"] = len(outputs) == 1
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    command = " ".join(["python", "tools/bench/pretrained.py", *sys.argv[1:]])
    report(results, command, args.via)
    if len(outputs) != 1:
        raise SystemExit(f"the libraries generated different tokens: {sorted(outputs)}")


if __name__ == "__main__":
    main()
