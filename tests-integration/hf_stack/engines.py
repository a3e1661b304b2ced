"""Scenario: ``Trainer`` with FSDP2 and with DeepSpeed ZeRO-2 on 2 CPU processes, and its oracle.

    accelerate launch --cpu --num_processes 2 engines.py OUT MODELS ENGINE
    python engines.py OUT MODELS oracle

ENGINE is ``ddp``, ``fsdp2`` (``fsdp="full_shard"`` with an FSDP2 config: full checkpoint files),
``fsdp2-sharded`` (the same with sharded DCP checkpoints) or ``zero2`` (a DeepSpeed ZeRO-2
config with "auto" values). Accelerate 1.15 cannot run FSDP or DeepSpeed on CPU
processes (it drops them and trains DDP), so these runs are compared with ``oracle``: the same
training written in plain PyTorch in one process on the global batch (AdamW, linear warmup and
decay, gradient clipping at 1.0, the mean token loss of each optimizer step's 16 samples).
Batches are taken in order (a sequential sampler), so every run sees the same samples.
Each engine trains 4 steps with a checkpoint after step 2 (``<ENGINE>-train``), then a new
``Trainer`` resumes from that checkpoint (``<ENGINE>-resume``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from common import CausalData, library, save_tensors, tiny_llama, write
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

out, models, engine = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
folder = tiny_llama(models / "llama")
STEPS, ACCUMULATION, PER_DEVICE, LR, WARMUP = 4, 2, 4, 2e-3, 1
DATA = CausalData(64)

ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp2": {
        "fsdp": "full_shard",
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    },
    "fsdp2-sharded": {
        "fsdp": "full_shard",
        "fsdp_config": {
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    },
    "zero2": {
        "deepspeed": {
            "zero_optimization": {"stage": 2},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        }
    },
}


class InOrder(Trainer):
    """Batches in dataset order, so that the oracle can take the same samples."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
        return SequentialSampler(self.train_dataset)


def oracle() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: each optimizer step on its global batch of samples."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def factor(step: int) -> float:  # linear warmup, then linear decay to 0
        if step < WARMUP:
            return step / WARMUP
        return max(0.0, (STEPS - step) / (STEPS - WARMUP))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    global_batch = PER_DEVICE * ACCUMULATION * 2  # 2 processes
    losses = []
    for step in range(STEPS):
        ids = DATA.ids[step * global_batch : (step + 1) * global_batch]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    write(out, "oracle", {"loss": losses})
    return dict(model.named_parameters())


if engine == "oracle":
    save_tensors(out, "oracle", oracle())
    sys.exit(0)


def train(phase: str) -> None:
    """Train (``train``) or resume from the step-2 checkpoint (``resume``); write the results."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    checkpoints = out / "checkpoints" / engine
    args = TrainingArguments(
        str(checkpoints if phase == "train" else out / "resumed" / engine),
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=LR,
        warmup_steps=WARMUP,
        weight_decay=0.0,
        logging_steps=1,
        save_steps=2,
        use_cpu=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        **ENGINES[engine],
    )
    trainer = InOrder(model=model, args=args, train_dataset=DATA)
    start = str(checkpoints / "checkpoint-2") if phase == "resume" else None
    trainer.train(resume_from_checkpoint=start)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    history = trainer.state.log_history
    files = sorted(str(p.relative_to(checkpoints)) for p in checkpoints.rglob("*") if p.is_file())
    write(
        out,
        f"{engine}-{phase}",
        {
            "library": library(),
            "loss": [entry["loss"] for entry in history if "loss" in entry],
            "distributed_type": str(trainer.accelerator.distributed_type),
            "checkpoint_files": files,
        },
    )
    if state is not None:
        save_tensors(out, f"{engine}-{phase}", dict(state))


train("train")
train("resume")
