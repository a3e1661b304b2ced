"""A tiny regression problem for tests (Accelerate's ``accelerate.test_utils.training``).

``RegressionDataset(a, b, length, seed)`` draws ``x`` from a standard normal and
``y = a * x + b`` plus noise with numpy's ``default_rng(seed)`` (the same numbers as
Accelerate's for the same seed); ``RegressionModel`` learns ``a`` and ``b``. numpy is imported
when a dataset is built. ``mocked_dataloaders`` builds MRPC loaders with datasets and
transformers (both needed then, and the ``bert-base-cased`` tokenizer from the Hub).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from accel_state import DistributedType

__all__ = [
    "RegressionDataset",
    "RegressionModel",
    "mocked_dataloaders",
    "mocked_dataloaders_for_autoregressive_models",
]


class RegressionDataset:
    """``length`` samples ``{"x": x, "y": a * x + b + noise}`` (float32 scalars)."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with learnable scalars ``a`` and ``b``; prints dtypes on the first batch."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``x * a + b``."""
        if x is None:
            raise ValueError("RegressionModel.forward needs x")
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b


def _mrpc(tokenizer_name: str) -> Any:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    files = {
        "train": "tests/test_samples/MRPC/train.csv",
        "validation": "tests/test_samples/MRPC/dev.csv",
    }
    return tokenizer, load_dataset("csv", data_files=files)


def mocked_dataloaders(accelerator: Any, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """MRPC train/eval loaders (batch 2 and 1) tokenised for ``bert-base-cased``."""
    tokenizer, data = _mrpc("bert-base-cased")
    label_to_id = {label: index for index, label in enumerate(data["train"].unique("label"))}

    def tokenize(examples: dict[str, Any]) -> Any:
        out = tokenizer(
            examples["sentence1"],
            examples["sentence2"],
            truncation=True,
            max_length=None,
            padding="max_length",
        )
        if "label" in examples:
            out["labels"] = [label_to_id[label] for label in examples["label"]]
        return out

    tokenized = data.map(tokenize, batched=True, remove_columns=["sentence1", "sentence2", "label"])

    def collate(examples: list[Any]) -> Any:
        if accelerator.distributed_type == DistributedType.XLA:
            return tokenizer.pad(
                examples, padding="max_length", max_length=128, return_tensors="pt"
            )
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train = DataLoader(tokenized["train"], shuffle=True, collate_fn=collate, batch_size=2)
    evaluation = DataLoader(
        tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1
    )
    return train, evaluation


def mocked_dataloaders_for_autoregressive_models(
    accelerator: Any, batch_size: int = 16
) -> tuple[DataLoader, DataLoader]:
    """MRPC first sentences as next-token data for ``HuggingFaceTB/SmolLM-360M``."""
    tokenizer, data = _mrpc("HuggingFaceTB/SmolLM-360M")
    tokenizer.pad_token = tokenizer.eos_token

    def tokenize(examples: dict[str, Any]) -> Any:
        return tokenizer(
            examples["sentence1"], truncation=True, max_length=None, return_attention_mask=False
        )

    with accelerator.main_process_first():
        tokenized = data.map(
            tokenize, batched=True, remove_columns=["sentence1", "sentence2", "label"]
        )

    def collate(examples: list[Any]) -> Any:
        if accelerator.distributed_type == DistributedType.XLA:
            longest = 128
        else:
            longest = max(len(example["input_ids"]) for example in examples)
        multiple = {"fp8": 16, "no": None}.get(accelerator.mixed_precision, 8)
        batch = tokenizer.pad(
            examples,
            padding="max_length",
            max_length=longest + 1,
            pad_to_multiple_of=multiple,
            return_tensors="pt",
        )
        batch["labels"] = batch["input_ids"][:, 1:]
        batch["input_ids"] = batch["input_ids"][:, :-1]
        if "attention_mask" in batch:
            batch["attention_mask"] = batch["attention_mask"][:, :-1]
        batch["labels"] = torch.where(
            batch["labels"] == tokenizer.pad_token_id, -100, batch["labels"]
        )
        return batch

    train = DataLoader(tokenized["train"], shuffle=False, collate_fn=collate, batch_size=2)
    evaluation = DataLoader(
        tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1
    )
    return train, evaluation
