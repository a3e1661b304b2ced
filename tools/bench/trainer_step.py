"""Benchmark: ms per transformers ``Trainer`` step, on accel (its alias) and on Accelerate 1.15.

    python tools/bench/trainer_step.py [--rounds 8] [--steps 80] [--quick] [--json FILE]

Run it with an interpreter that has accel and transformers installed (e.g.
`.nox/hf-stack/bin/python` after `python3 tools/dev.py test -s hf-stack`); Accelerate 1.15 runs
from its own venv (tools/reference_venv.py --hf-stack creates it). Each measurement is one fresh
worker process; a round runs one worker per library, the order alternating between rounds, and
the rounds' ratios are paired so that drift on a shared machine hits both alike.

The worker trains a tiny Llama (hidden 64, 2 layers, vocabulary 128; seeded) with
``Trainer`` on the CPU: batch 8 x 32 tokens, AdamW, linear schedule, gradient clipping at 1.0,
no accumulation, no logging, saving or evaluation inside the timed steps, one compute thread.
A ``TrainerCallback`` stamps the end of every step; ms/step is the median interval after the
first 10 steps. accel's worker calls ``accel.install_as_accelerate()`` before importing
transformers (in an environment where ``accel alias install`` ran, it is already active): the
script is otherwise the same for both. ``raw``, for scale, is the same steps written by hand in
PyTorch (forward, backward, clip, AdamW step, schedule step, zero_grad) over the same batches.
Goal (accel issue 29): accel <= 1.02x Accelerate's ms/step. Prints a Markdown table for
docs/benchmarks.md and the exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("accel", "accelerate", "raw")
WARMUP = 10
BATCH, LENGTH, VOCAB = 8, 32, 128


def build_model() -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def dataset(steps: int) -> Any:
    import torch
    from torch.utils.data import Dataset

    class Tokens(Dataset[dict[str, Any]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, VOCAB, (BATCH * steps, LENGTH), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    return Tokens()


def worker(library: str, steps: int, out: Path) -> None:
    """Train ``steps`` steps; print the step intervals in ms as one JSON line."""
    if library == "accel":
        import accel

        accel.install_as_accelerate()
    import torch

    torch.set_num_threads(1)
    stamps: list[float] = []
    total = steps + WARMUP
    if library == "raw":
        stamps = raw_steps(total)
    else:
        from transformers import Trainer, TrainerCallback, TrainingArguments

        class Stamp(TrainerCallback):
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                stamps.append(time.perf_counter())

        args = TrainingArguments(
            str(out),
            per_device_train_batch_size=BATCH,
            max_steps=total,
            learning_rate=1e-3,
            logging_strategy="no",
            save_strategy="no",
            use_cpu=True,
            seed=0,
            report_to=[],
            disable_tqdm=True,
            dataloader_drop_last=True,
        )
        trainer = Trainer(
            model=build_model(), args=args, train_dataset=dataset(total), callbacks=[Stamp()]
        )
        trainer.train()
    timed = stamps[WARMUP:]
    intervals = [(b - a) * 1000 for a, b in zip(timed, timed[1:], strict=False)]
    print(json.dumps({"library": library, "ms": intervals}), flush=True)


def raw_steps(total: int) -> list[float]:
    """The same training written in plain PyTorch; the end of each step, stamped."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(
        dataset(total),
        batch_size=BATCH,
        sampler=RandomSampler(dataset(total), generator=generator),
        drop_last=True,
    )
    stamps = []
    model.train()
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    return stamps


def run_worker(python: str, library: str, steps: int, out: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    if library == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"
    command = [python, str(Path(__file__).resolve()), "--worker", library, "--steps", str(steps)]
    command += ["--out", str(out / library)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"worker {library} failed:\n{done.stdout}\n{done.stderr}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    return list(json.loads(line)["ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    if args.quick:
        args.rounds, args.steps = 1, 15
    import tempfile

    sys.path.insert(0, str(ROOT / "tools"))
    from reference_venv import ensure_accelerate_venv

    pythons = {
        "accel": sys.executable,
        "accelerate": str(ensure_accelerate_venv(hf_stack=True)),
        "raw": sys.executable,
    }
    medians: dict[str, list[float]] = {library: [] for library in LIBRARIES}
    with tempfile.TemporaryDirectory(prefix="accel-bench-trainer-") as tmp:
        for round_index in range(args.rounds):
            order = LIBRARIES if round_index % 2 == 0 else LIBRARIES[::-1]
            for library in order:
                ms = run_worker(pythons[library], library, args.steps, Path(tmp))
                medians[library].append(statistics.median(ms))
                print(f"round {round_index} {library}: {medians[library][-1]:.2f} ms/step")
    ratios = [a / b for a, b in zip(medians["accel"], medians["accelerate"], strict=True)]
    if args.json:
        args.json.write_text(json.dumps({"medians": medians, "ratios": ratios}, indent=1))
    command = " ".join(["python", "tools/bench/trainer_step.py", *sys.argv[1:]])

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print()
    print(
        f"Trainer on a tiny Llama (2 layers, hidden 64), batch {BATCH} x {LENGTH} tokens, 1 "
        f"thread, {args.steps} timed steps per worker, {args.rounds} rounds (median, range)."
    )
    print()
    header = ["measurement", "accel (alias)", "Accelerate 1.15", "accel ÷ Accelerate"]
    print("| " + " | ".join([*header, "raw PyTorch", "goal"]) + " |")
    print("|---|---|---|---|---|---|")
    print(
        f"| `Trainer` step, ms | {cell(medians['accel'])} | {cell(medians['accelerate'])} | "
        f"**{statistics.median(ratios):.3f}×** ({min(ratios):.3f}-{max(ratios):.3f}) | "
        f"{cell(medians['raw'])} | ≤ 1.02× |"
    )
    print()
    print(f"Command: `{command}`")


if __name__ == "__main__":
    main()
