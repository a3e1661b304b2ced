"""What the hf-stack scenario scripts share: tiny models, data, and how results are written.

The scripts run twice, once on accel (through its ``accelerate`` alias: they import
transformers, peft and trl only, never accel) and once on Accelerate 1.15 in its own venv;
``tests-integration/test_hf_stack.py`` compares what the two wrote. Everything is built from
seeds on the CPU, so both runs see the same models and batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB = 128


def library() -> str:
    """Which library answered ``import accelerate``: ``"accel"`` or ``"accelerate"``."""
    import accelerate

    return "accel" if getattr(accelerate, "__accel_version__", None) else "accelerate"


def tiny_llama(folder: Path, *, layers: int = 4, shard: str | None = None) -> Path:
    """A random tiny Llama causal LM saved with ``save_pretrained`` (and a tokenizer-free
    generation config), once per folder."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    kwargs: dict[str, Any] = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(folder, **kwargs)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over ``t0`` ... ``t126`` and ``<unk>`` (``pipeline`` and trl need
    one), built here: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="t0", bos_token="t1",
        eos_token="t2",
    )  # fmt: skip


def tiny_classifier(folder: Path) -> Path:
    """A random tiny BERT sequence classifier (3 labels), once per folder."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=3,
    )
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


class CausalData(Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences of ``length`` random tokens, labels = inputs (causal LM)."""

    def __init__(self, n: int, length: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class ClassificationData(Dataset[dict[str, torch.Tensor]]):
    """``n`` random token sequences with a label that depends on them (learnable)."""

    def __init__(self, n: int, length: int = 12, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=generator)
        self.labels = self.ids[:, 0] % 3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def is_main() -> bool:
    """Rank 0 (or no launcher)."""
    return os.environ.get("RANK", "0") == "0"


def write(out: Path, name: str, data: dict[str, Any]) -> None:
    """Write ``data`` as ``<out>/<name>.json`` (main process only)."""
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def save_tensors(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write tensors as ``<out>/<name>.safetensors`` (main process only), for exact comparison."""
    from safetensors.torch import save_file

    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        plain = {key: value.detach().cpu().contiguous().clone() for key, value in tensors.items()}
        save_file(plain, str(out / f"{name}.safetensors"))


def finish() -> None:
    """End a script the way ``tests-integration/scripts/reference_exit.py`` ends the other
    comparison scripts: accel's processes leave normally (its exit handler releases the process
    group, and that stays under test); Accelerate 1.15's destroy the group and leave at once,
    before gloo's worker threads can abort a finished process at interpreter exit
    (pytorch/pytorch#190489: one CI run of ``trainer.py`` on 2 Accelerate processes failed so
    after all six of its runs had written their results)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from reference_exit import leave

    leave(library(), 0)
