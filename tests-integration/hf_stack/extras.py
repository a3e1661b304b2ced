"""Scenario: peft LoRA through ``Trainer``, trl's ``SFTTrainer``, ``auto_find_batch_size``.

    python extras.py OUT MODELS

- peft: LoRA adapters (q_proj, v_proj) on the tiny Llama, trained by ``Trainer`` for 4 steps.
- trl: ``SFTTrainer`` on a text dataset (the tiny word-level tokenizer), 4 steps.
- ``Trainer(auto_find_batch_size=True)`` with a model that runs out of memory above 2 samples
  per batch (it raises the CPU allocator's error): the batch size is halved from 8 to 2, through
  Accelerate's ``find_executable_batch_size``.
Writes each one's losses and trained weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from common import CausalData, library, save_tensors, tiny_llama, write
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

out, models = Path(sys.argv[1]), Path(sys.argv[2])
folder = tiny_llama(models / "llama")
results: dict[str, Any] = {"library": library()}


def arguments(name: str, **kwargs: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "output_dir": str(out / "checkpoints" / name),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "seed": 0,
        "report_to": [],
        "disable_tqdm": True,
    }
    settings.update(kwargs)
    return settings


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# --- peft LoRA -------------------------------------------------------------------------------
from peft import LoraConfig, get_peft_model  # noqa: E402

torch.manual_seed(0)
lora = get_peft_model(
    AutoModelForCausalLM.from_pretrained(folder),
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
)
trainer = Trainer(
    model=lora, args=TrainingArguments(**arguments("lora")), train_dataset=CausalData(32)
)
trainer.train()
results["lora"] = {"loss": losses(trainer)}
save_tensors(out, "lora", {k: v for k, v in lora.named_parameters() if v.requires_grad})

# --- trl SFTTrainer --------------------------------------------------------------------------
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(folder)
generator = torch.Generator().manual_seed(3)
texts = [
    " ".join(f"t{int(i)}" for i in torch.randint(3, 120, (12,), generator=generator))
    for _ in range(32)
]
torch.manual_seed(0)
sft = SFTTrainer(
    model=AutoModelForCausalLM.from_pretrained(folder),
    args=SFTConfig(**arguments("sft", max_length=16)),
    train_dataset=Dataset.from_dict({"text": texts}),
    processing_class=tokenizer,
)
sft.train()
results["sft"] = {"loss": losses(sft)}
save_tensors(out, "sft", dict(sft.model.named_parameters()))


# --- auto_find_batch_size --------------------------------------------------------------------
class SmallMemoryLlama(torch.nn.Module):
    """The tiny Llama, out of memory (the CPU allocator's error) above 2 samples a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = AutoModelForCausalLM.from_pretrained(folder)
        self.tried: list[int] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        self.tried.append(int(input_ids.shape[0]))
        if input_ids.shape[0] > 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
        return self.inner(input_ids=input_ids, labels=labels)


torch.manual_seed(0)
small = SmallMemoryLlama()
trainer = Trainer(
    model=small,
    args=TrainingArguments(
        **arguments("auto-batch", per_device_train_batch_size=8, auto_find_batch_size=True)
    ),
    train_dataset=CausalData(64),
)
trainer.train()
results["auto_batch"] = {
    "loss": losses(trainer),
    "batch_sizes_tried": sorted(set(small.tried), reverse=True),
    "final_batch_size": trainer._train_batch_size,
}
save_tensors(out, "auto-batch", dict(small.named_parameters()))
write(out, "extras", results)
