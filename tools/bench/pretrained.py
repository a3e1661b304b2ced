"""Benchmark: a transformers model folder with half its blocks on disk, loaded and generating.

    python tools/bench/pretrained.py [--size-gb 1] [--prompt 16] [--tokens 32] [--repeats 3]
                                     [--via load_pretrained|transformers] [--threads N]
                                     [--dir DIR] [--quick] [--json FILE]

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
docs/benchmarks.md and the exact command. `--quick` is a smoke run (tiny model, 1 repeat).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.bench.measure import folder_bytes, median  # noqa: E402
from tools.bench.offload import PageCache, plain_read, whole_files  # noqa: E402

MB = 1 << 20
LAYERS = 16
VOCAB = 32000
SHARD = "500MB"
LIBRARIES = ("accel", "accelerate", "eager")


# ---------------------------------------------------------------------------------------------
# The model folder
# ---------------------------------------------------------------------------------------------


def config_for(size_gb: float, layers: int = LAYERS, vocab: int = VOCAB) -> dict[str, int]:
    """LlamaConfig arguments whose fp32 weights are closest to ``size_gb``."""

    def weight_bytes(hidden: int) -> int:
        intermediate = hidden * 11 // 4 // 64 * 64
        per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
        return 4 * (layers * per_layer + 2 * vocab * hidden + hidden)

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


def ensure_folder(base: Path, config: dict[str, int]) -> Path:
    """Write the seeded model once; reuse it when the same config is there."""
    import torch
    import transformers

    name = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    folder = base / f"llama-{name}"
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(folder, max_shard_size=SHARD)
    (folder / "done").write_text("complete\n")
    return folder


def device_map_for(layers: int) -> dict[str, str]:
    first = {f"model.layers.{i}": "cpu" for i in range(layers // 2)}
    second = {f"model.layers.{i}": "disk" for i in range(layers // 2, layers)}
    rest = dict.fromkeys(["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"], "cpu")
    return {**rest, **first, **second}


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
    device_map = device_map_for(args.layers)

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
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    from_pretrained = AutoModelForCausalLM.from_pretrained
    if args.library == "accel" and args.via == "load_pretrained":
        from accel_bigmodel import load_pretrained

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=generator)
    written_before = write_bytes()
    start = time.perf_counter()
    if args.library == "accel" and args.via == "load_pretrained":
        model = load_pretrained(folder, device_map=device_map, offload_folder=offload)
    elif args.library in ("accel", "accelerate"):  # transformers, on accel's alias or Accelerate
        model = from_pretrained(folder, device_map=device_map, offload_folder=str(offload))
    else:  # the floor: every weight in RAM, transformers alone (no device_map, no hooks)
        model = from_pretrained(folder).eval()
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
    if library == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", "--library", library]
    command += ["--folder", str(folder), "--offload", str(offload)]
    command += ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
    command += ["--threads", str(args.threads), "--via", args.via]
    command += ["--layers", str(config["num_hidden_layers"]), "--vocab", str(config["vocab_size"])]
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
    rows = []
    for phase in ("warm", "cold"):
        runs = results[phase]
        if not runs:
            continue
        by = {lib: [r for r in runs if r["library"] == lib] for lib in LIBRARIES}

        def mid(library: str, field: str, by: dict[str, list[Any]] = by) -> float:
            return median([r[field] for r in by[library]])

        def values(library: str, field: str, fmt: str, by: dict[str, list[Any]] = by) -> str:
            return cell([r[field] for r in by[library]], fmt)

        ttft = mid("accel", "first_token") / mid("accelerate", "first_token")
        rate = mid("accel", "tokens_per_s") / mid("accelerate", "tokens_per_s")
        rows.append(
            f"| {phase}: time to first token, s (of which load) | "
            f"{values('accel', 'first_token', '.2f')} ({mid('accel', 'load'):.2f}) | "
            f"{values('accelerate', 'first_token', '.2f')} ({mid('accelerate', 'load'):.2f}) | "
            f"**{ttft:.2f}×** | {values('eager', 'first_token', '.2f')} "
            f"({mid('eager', 'load'):.2f}) | {ttft_goal} |"
        )
        rows.append(
            f"| {phase}: decoding, tokens/s | {values('accel', 'tokens_per_s', '.2f')} | "
            f"{values('accelerate', 'tokens_per_s', '.2f')} | **{rate:.2f}×** | "
            f"{values('eager', 'tokens_per_s', '.2f')} | {rate_goal} |"
        )
        rows.append(
            f"| {phase}: MB in the offload folder (process write_bytes, MB) | "
            f"{max(r['folder_bytes'] for r in by['accel']) / MB:.0f} "
            f"({max(r['written'] for r in by['accel']) / MB:.0f}) | "
            f"{max(r['folder_bytes'] for r in by['accelerate']) / MB:.0f} "
            f"({max(r['written'] for r in by['accelerate']) / MB:.0f}) | | — | 0 |"
        )
    model = results["model"]
    print()
    print(
        f"Model: Llama, hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
        f"{results['bytes'] / MB:.0f} MB fp32 in {results['files']} files; "
        f"{model['num_hidden_layers'] // 2} layers on disk; prompt {results['prompt']} tokens, "
        f"{results['tokens']} new tokens, greedy; {results['threads']} compute thread(s); "
        f"{results['repeats']} workers per cell "
        "(median, range)."
    )
    print()
    ours = (
        "accel `load_pretrained`"
        if via == "load_pretrained"
        else "transformers + accel (alias) `from_pretrained(device_map=...)`"
    )
    print(
        f"| measurement | {ours} | transformers + Accelerate 1.15 "
        "`from_pretrained(device_map=...)` | accel ÷ Accelerate | transformers alone, all in "
        "RAM | goal |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    print()
    print(f"Command: `{command}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--offload", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.size_gb, args.repeats, args.tokens, args.prompt = 0.02, 1, 6, 8
    config = config_for(args.size_gb, vocab=VOCAB if not args.quick else 1024)
    folder = ensure_folder(args.dir / "accel-bench-pretrained", config)
    sys.path.insert(0, str(ROOT / "tools"))
    from reference_venv import ensure_accelerate_venv

    reference = str(ensure_accelerate_venv())
    pythons = {"accel": sys.executable, "accelerate": reference, "eager": sys.executable}
    cache = PageCache() if PageCache.available() else None
    results: dict[str, Any] = {
        "model": config,
        "bytes": sum(p.stat().st_size for p in files_of(folder)),
        "files": len(files_of(folder)),
        "threads": args.threads,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "warm": [],
        "cold": [],
    }
    for phase in ("warm", "cold"):
        if phase == "cold" and cache is None:
            print("cold page cache: not measured (no posix_fadvise/mincore here)")
            continue
        for repeat in range(args.repeats):
            for library in LIBRARIES if repeat % 2 == 0 else LIBRARIES[::-1]:
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
    if len(outputs) != 1:
        raise SystemExit(f"the libraries generated different tokens: {sorted(outputs)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    command = " ".join(["python", "tools/bench/pretrained.py", *sys.argv[1:]])
    report(results, command, args.via)


if __name__ == "__main__":
    main()
