"""The GPT-like decoder and its seeded sharded checkpoint, shared by the big-model demo and bench.

``tools/examples/bigmodel_offload.py`` (the main job's big-model run) and
``tools/bench/bigmodel.py`` build the same model and write its checkpoint the same way: seeded
random fp32 weights, written shard by shard (never the whole model in memory) as safetensors
files plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

VOCAB = 4096
INDEX = "model.safetensors.index.json"


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        shape = (batch, tokens, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    """Token embedding, ``blocks`` decoder blocks, final LayerNorm, untied lm_head."""

    def __init__(self, width: int, blocks: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, width // 64) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def fp32_bytes(width: int, vocab: int = VOCAB) -> tuple[int, int]:
    """(bytes of one block, bytes outside the blocks) of the decoder's fp32 weights."""
    return 4 * (12 * width * width + 13 * width), 4 * (2 * vocab * width + 2 * width)


def shard_names(count: int) -> list[str]:
    """Hugging Face's shard file names: ``model-00001-of-00005.safetensors``, ..."""
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_checkpoint(
    folder: Path, width: int, blocks: int, shards: int, seed: int, vocab: int = VOCAB
) -> int:
    """Write the seeded checkpoint into ``folder`` shard by shard; return its total bytes.

    Raises:
        SystemExit: the model is too small to fill ``shards`` shards.
    """
    with torch.device("meta"):
        model = Decoder(width, blocks, vocab)
    entries = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    total = sum(4 * math.prod(shape) for _, shape in entries)
    generator = torch.Generator().manual_seed(seed)
    names = shard_names(shards)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    written = 0
    for position, (name, shape) in enumerate(entries):
        mean = 1.0 if name.endswith("weight") and len(shape) == 1 else 0.0  # LayerNorm scales
        value = torch.empty(shape).normal_(mean, 0.02, generator=generator)
        index = min(shards - 1, written * shards // total)
        shard[name] = value
        weight_map[name] = names[index]
        written += value.numel() * 4
        if position == len(entries) - 1 or min(shards - 1, written * shards // total) != index:
            save_file(shard, str(folder / names[index]), metadata={"format": "pt"})
            shard = {}
    if sorted(set(weight_map.values())) != names:
        raise SystemExit(f"{folder}: the model is too small for {shards} shards")
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index_doc, indent=2) + "\n", encoding="utf-8")
    return total
