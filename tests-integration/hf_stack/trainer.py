"""Scenario: transformers' ``Trainer`` (accumulation, evaluation, checkpoints, resume).

    python trainer.py OUT MODELS [CHECKPOINTS]

Every run from scratch; then, given CHECKPOINTS, each run again from
``CHECKPOINTS/<run>/checkpoint-2`` (this library's own checkpoints, or the other library's).

Runs: a tiny Llama causal LM in fp32 and in bf16, and a tiny BERT classifier in bf16; each with
``gradient_accumulation_steps=4``, evaluation and a checkpoint every 2 optimizer steps, 6 steps.
Under a launcher with 2 processes the batches are split between them. Writes each run's
training and evaluation losses and its final weights; ``resume`` starts each run from
``CHECKPOINTS/<run>/checkpoint-2`` (this library's own checkpoints, or the other library's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    CausalData,
    ClassificationData,
    finish,
    library,
    save_tensors,
    tiny_classifier,
    tiny_llama,
    write,
)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainingArguments,
)

out, models = Path(sys.argv[1]), Path(sys.argv[2])
checkpoints = Path(sys.argv[3]) if len(sys.argv) > 3 else None

RUNS: dict[str, dict[str, Any]] = {
    "causal-fp32": {"kind": "causal", "bf16": False},
    "causal-bf16": {"kind": "causal", "bf16": True},
    "classifier-bf16": {"kind": "classifier", "bf16": True},
}


def build(kind: str) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    if kind == "causal":
        model = AutoModelForCausalLM.from_pretrained(tiny_llama(models / "llama"))
        return model, CausalData(64), CausalData(16, seed=1)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier(models / "bert"))
    return model, ClassificationData(64), ClassificationData(16, seed=1)


def run_all(phase: str, start_from: Path | None) -> None:
    """Every run (from scratch, or from ``start_from/<run>/checkpoint-2``); write the results."""
    results: dict[str, Any] = {"library": library()}
    for run, spec in RUNS.items():
        model, train_data, eval_data = build(spec["kind"])
        args = TrainingArguments(
            str(out / "checkpoints" / run) if start_from is None else str(out / "resumed" / run),
            per_device_train_batch_size=2,
            per_device_eval_batch_size=8,
            gradient_accumulation_steps=4,
            max_steps=6,
            learning_rate=1e-3,
            warmup_steps=2,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            bf16=spec["bf16"],
            use_cpu=True,
            seed=0,
            report_to=[],
            disable_tqdm=True,
            dataloader_drop_last=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data)
        start = None if start_from is None else str(start_from / run / "checkpoint-2")
        trainer.train(resume_from_checkpoint=start)
        history = trainer.state.log_history
        results[run] = {
            "loss": [entry["loss"] for entry in history if "loss" in entry],
            "eval_loss": [entry["eval_loss"] for entry in history if "eval_loss" in entry],
            "global_step": trainer.state.global_step,
            "world_size": args.world_size,
        }
        save_tensors(out, f"{phase}-{run}", dict(trainer.model.named_parameters()))
    write(out, phase, results)


run_all("train", None)
if checkpoints is not None:
    run_all("resume", checkpoints)
finish()
