"""Scenario: transformers' ``from_pretrained(device_map=...)`` and ``pipeline(device_map=...)``.

    python loading.py OUT MODEL_FOLDER

Loads the tiny Llama with every weight on the CPU (the reference), then with
``device_map="auto"`` under a CPU budget that sends some blocks to disk, with an explicit map
of CPU and disk entries, and through ``pipeline("text-generation", device_map="auto")``;
writes the device maps, the files written to the offload folders, the logits and the
generated tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import library, save_tensors, write
from transformers import AutoModelForCausalLM, pipeline

out, folder = Path(sys.argv[1]), Path(sys.argv[2])
offload = out / "offload"
ids = torch.tensor([[1, 5, 9, 33, 7, 64, 90, 12]])
results: dict[str, object] = {"library": library()}
tensors: dict[str, torch.Tensor] = {}

reference = AutoModelForCausalLM.from_pretrained(folder)
with torch.no_grad():
    tensors["eager.logits"] = reference(ids).logits

explicit = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}
cases = {
    "auto": {"device_map": "auto", "max_memory": {"cpu": "420KB"}},
    "explicit": {"device_map": explicit},
}
for name, kwargs in cases.items():
    target = offload / name
    model = AutoModelForCausalLM.from_pretrained(folder, offload_folder=str(target), **kwargs)
    with torch.no_grad():
        tensors[f"{name}.logits"] = model(ids).logits
        tensors[f"{name}.generate"] = model.generate(ids, max_new_tokens=8, do_sample=False)
    results[f"{name}.device_map"] = {key: str(value) for key, value in model.hf_device_map.items()}
    results[f"{name}.offload_files"] = sorted(
        str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()
    )

generator = pipeline("text-generation", model=str(folder), device_map="auto")
text = generator("t1 t5 t9 t33", max_new_tokens=6, do_sample=False)[0]["generated_text"]
results["pipeline.text"] = text
placed = getattr(generator.model, "hf_device_map", None)  # absent when one device holds it all
results["pipeline.device_map"] = None if placed is None else {k: str(v) for k, v in placed.items()}
results["pipeline.device"] = str(generator.model.device)
write(out, "loading", results)
save_tensors(out, "loading", tensors)
